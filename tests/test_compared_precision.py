"""The checks compare at a stated matmul precision on every backend (`PRECISION`), with
one per-backend widening of the tolerance table (`tolerance_for`)."""

import os

import jax
import jax.numpy as jnp
import pytest
from helpers import seeded_qkv

from eqx_flash import plain_attention
from eqx_flash.testing import (
    PRECISION,
    TOLERANCES,
    AttentionInputs,
    check_attention,
    tolerance_for,
)
from eqx_flash.testing._tolerances import BACKEND_FACTORS

PROBLEM = AttentionInputs(*seeded_qkv((2, 16, 8), (2, 24, 8)), kwargs={"causal": True})


def recording(seen: list, name: str):
    """`plain_attention` that notes the matmul precision in effect when it runs."""

    def attention(q, k, v, **kwargs):
        seen.append((name, jax.config.jax_default_matmul_precision))
        return plain_attention(q, k, v, **kwargs)

    return attention


@pytest.mark.parametrize("precision", [PRECISION, "default", "bfloat16"])
def test_check_attention_runs_both_sides_at_the_stated_precision(precision):
    seen = []
    # Values only: the calls are recorded when made, and `check_attention` sets the
    # precision around all of its work (eager gradients compiled each op of the backward,
    # ~90 programs, and recorded nothing more).
    check_attention(recording(seen, "fn"), PROBLEM, reference=recording(seen, "ref"),
                    jit=False, precision=precision, grads=False)
    assert seen and set(seen) == {("fn", precision), ("ref", precision)}


def test_check_attention_defaults_to_highest_and_none_keeps_the_setting():
    seen = []
    with jax.default_matmul_precision("high"):
        check_attention(recording(seen, "fn"), PROBLEM, jit=False, grads=False)  # (as above)
        check_attention(recording(seen, "fn"), PROBLEM, jit=False, precision=None, grads=False)
    assert [p for _, p in seen] == ["highest", "high"]
    assert PRECISION == "highest"


def test_check_attention_names_a_bad_precision():
    with pytest.raises(ValueError, match="precision must be None or a JAX matmul precision"):
        check_attention(plain_attention, PROBLEM, precision="fastest")


def test_a_mismatch_report_says_the_precision():
    def off(q, k, v, **kwargs):
        return plain_attention(q, k, v, scale=0.9 / q.shape[-1] ** 0.5, **kwargs)

    with pytest.raises(AssertionError, match="matmul precision 'highest'"):
        check_attention(off, PROBLEM, grads=False)


def test_tolerance_for_widens_the_table_by_the_backend_factor():
    for dtype in (jnp.float32, jnp.bfloat16):
        table = TOLERANCES[jnp.dtype(dtype)]
        assert tolerance_for(dtype, "cpu") == table
        assert tolerance_for(dtype, "an unmeasured backend") == table
        wide = tolerance_for(dtype, "tpu")
        factor = BACKEND_FACTORS["tpu"]
        for kind in ("out", "lse", "grad"):
            assert getattr(wide, kind) == pytest.approx(
                tuple(factor * x for x in getattr(table, kind)))
    # The measured TPU miss (3.6e-5 against atol 2e-5 at "highest") is within it.
    assert tolerance_for(jnp.float32, "tpu").out[0] >= 3.6e-5
    assert tolerance_for(jnp.float32) == tolerance_for(jnp.float32, jax.default_backend())


def test_the_suite_runs_at_the_stated_precision():
    # tests/conftest.py sets it unless the environment asks for another.
    expected = os.environ.get("JAX_DEFAULT_MATMUL_PRECISION", PRECISION)
    assert jax.config.jax_default_matmul_precision == expected
