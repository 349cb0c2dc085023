"""The jaxtyping annotations: which shapes they accept, what they catch, the off switch."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from helpers import assert_close, assert_lse_close, qkv

import eqx_flash
from eqx_flash._api import flash as _flash
from eqx_flash._semantics import masking as _masking

H, KH, SQ, SK, D, DV = 4, 2, 8, 12, 16, 8


def _qkv(lead: tuple[int, ...], kv_lead: tuple[int, ...], dtype=jnp.float32):
    return qkv(0, (*lead, SQ, D), (*kv_lead, SK, D), dim_v=DV, dtype=dtype)


@pytest.fixture
def unchecked():
    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    yield
    jaxtyping.config.update("jaxtyping_disable", before)


@pytest.mark.parametrize(
    "lead, kv_lead",
    [((), ()), ((H,), (KH,)), ((2, H), (2, KH)), ((3, 2, H), (3, 2, 1))],
    ids=["no-leading-axes", "heads", "batch-heads", "two-batch-axes-mqa"],
)
def test_every_rank_passes(lead, kv_lead):
    """`(seq_q, dim)` and `(*batch, heads, seq_q, dim)` for any number of batch axes."""
    q, k, v = _qkv(lead, kv_lead)
    out, lse = eqx_flash.flash_attention(q, k, v, causal=True)
    assert out.shape == (*lead, SQ, DV)
    assert lse.shape == (*lead, SQ)
    # The reference compiled whole (eagerly each of its ops was a program).
    ref_out, ref_lse = jax.jit(lambda q, k, v: eqx_flash.plain_attention(q, k, v, causal=True))(
        q, k, v)
    assert_close(out, ref_out)
    assert_lse_close(lse, ref_lse)


def test_numpy_inputs_accepted():
    q, k, v = _qkv((2, H), (2, KH))
    mask = np.arange(SK)[None, :] < np.array([[SK], [SK - 3]])
    from_numpy = eqx_flash.flash_attention(np.asarray(q), np.asarray(k), np.asarray(v), mask)
    from_jax = eqx_flash.flash_attention(q, k, v, jnp.asarray(mask))
    for a, b in zip(from_numpy, from_jax, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_low_precision_and_legacy_key():
    q, k, v = _qkv((2, H), (2, KH), jnp.bfloat16)
    legacy_key = jax.random.PRNGKey(0)  # uint32[2]: PRNGKeyArray allows it
    # The kernels' `promote_types(bfloat16, float32)` is itself an error under the strict
    # promotion conftest sets (a kernel matter, reported); this test is about annotations.
    with jax.numpy_dtype_promotion("standard"):
        out, lse = eqx_flash.flash_attention(q, k, v, dropout_rate=0.25, key=legacy_key)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32


def test_traced_arguments_pass_under_jit():
    """Tracers of every kind (floats, bool/int masks, a PRNG key) satisfy the annotations."""
    q, k, v = _qkv((2, H), (2, KH))
    arrays = dict(
        q=q, k=k, v=v, mask=jnp.ones((2, SK), jnp.int32), attn_mask=jnp.ones((SQ, SK), bool),
        q_segment_ids=jnp.zeros((2, H, SQ), jnp.int32),
        kv_segment_ids=jnp.zeros((2, 1, SK), jnp.uint8), key=jax.random.key(1),
    )
    out, lse = jax.jit(lambda a: eqx_flash.flash_attention(**a, dropout_rate=0.1))(arrays)
    ref_out, ref_lse = jax.jit(  # (compiled whole, as above)
        lambda a: eqx_flash.plain_attention(**a, dropout_rate=0.1))(arrays)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-5)


@pytest.mark.parametrize(
    "change, parameter, axis",
    [
        ({"k": (2, KH, SK, D + 1)}, "k", "dim=16"),
        ({"v": (2, KH, SK + 1, DV)}, "v", "seq_k=12"),
        ({"k": (3, KH, SK, D), "v": (3, KH, SK, DV)}, "k", "batch=(2,)"),
        ({"mask": (2, SK - 1)}, "mask", "seq_k=12"),
        ({"attn_mask": (SQ - 1, SK)}, "attn_mask", "seq_q=8"),
        ({"q_segment_ids": (2, H, SQ + 1)}, "q_segment_ids", "seq_q=8"),
    ],
)
def test_mismatch_caught_by_axis_name(change, parameter, axis):
    """The same name on two arguments binds one size: the error names the parameter and
    shows the size the axis was bound to by an earlier argument."""
    q, k, v = _qkv((2, H), (2, KH))
    kwargs = dict(q=q, k=k, v=v)
    for name, shape in change.items():
        dtype = jnp.int32 if "ids" in name else bool if "mask" in name else jnp.float32
        kwargs[name] = jnp.zeros(shape, dtype)
    if parameter == "q_segment_ids":
        kwargs["kv_segment_ids"] = jnp.zeros((2, SK), jnp.int32)
    with pytest.raises(jaxtyping.TypeCheckError) as error:
        eqx_flash.flash_attention(**kwargs)
    message = str(error.value)
    assert f"parameter '{parameter}'" in message
    assert axis in message


def test_return_value_is_checked(monkeypatch):
    """The return annotation binds dim_v to v's: a kernel that got it wrong is caught."""
    q, k, v = _qkv((2, H), (2, KH))

    def wrong_blockwise(*args, **kwargs):
        return jnp.zeros((2, H, SQ, DV + 1)), jnp.zeros((2, H, SQ))

    monkeypatch.setattr(_flash, "_blockwise", wrong_blockwise)
    with pytest.raises(jaxtyping.TypeCheckError, match="return value"):
        eqx_flash.flash_attention(q, k, v)


def test_off_switch_leaves_explicit_checks(unchecked):
    """With jaxtyping's checks off, the explicit checks still reject every mismatch (a
    ValueError of our own instead of jaxtyping's TypeCheckError)."""
    q, k, v = _qkv((2, H), (2, KH))
    with pytest.raises(ValueError, match=r"k\.shape=\(2, 2, 12, 17\)"):
        eqx_flash.flash_attention(q, jnp.zeros((2, KH, SK, D + 1)), v)
    out, _ = eqx_flash.flash_attention(q, k, v)
    assert out.shape == (2, H, SQ, DV)


def test_off_switch_environment_variable():
    """`JAXTYPING_DISABLE=1` in the environment switches the checks off from the start."""
    code = (
        "import jax.numpy as jnp, eqx_flash\n"
        "q, k, v = jnp.zeros((4, 8, 16)), jnp.zeros((4, 8, 17)), jnp.zeros((4, 8, 8))\n"
        "try:\n"
        "    eqx_flash.flash_attention(q, k, v)\n"
        "except Exception as e:\n"
        "    print(type(e).__name__)\n"
    )
    names = []
    for disable in ("0", "1"):
        env = {**os.environ, "JAXTYPING_DISABLE": disable, "JAX_PLATFORMS": "cpu"}
        result = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr
        names.append(result.stdout.strip())
    assert names == ["TypeCheckError", "ValueError"]


def test_internal_functions_are_checked_in_tests():
    """pyproject's `--jaxtyping-packages=eqx_flash,...` instruments every annotated
    function of the package during the test suite, not just the public ones."""
    float_positions = jnp.arange(4.0)[:, None]
    int_positions = jnp.arange(4)[None, :]
    window = eqx_flash._core.options.Window()
    with pytest.raises(jaxtyping.TypeCheckError, match="q_pos"):
        _masking.positional_mask(float_positions, int_positions, 0, 4, window)


def test_cosine_sim_flash_attention_is_checked():
    q, k, v = _qkv((2, H), (2, KH))
    out, lse = eqx_flash.cosine_sim_flash_attention(q, k, v, jnp.ones((2, SK), bool))
    assert out.shape == (2, H, SQ, DV) and lse.shape == (2, H, SQ)
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'v'"):
        eqx_flash.cosine_sim_flash_attention(q, k, jnp.zeros((2, KH, SK + 1, DV)))
