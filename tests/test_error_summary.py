"""Shape and dtype errors fit on a line: the first line of every jaxtyping failure at a
public entry point names the argument, what was expected and what came
(`eqx_flash._core.checking`); jaxtyping's long message follows unchanged. A wrong shape
also states the layout and points jax.nn's layout at `eqx_flash.dot_product_attention`;
the modules say they take one example."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest

import eqx_flash

Q = jnp.zeros((2, 8, 16, 64))  # (batch, heads, seq_q, dim)
K = V = jnp.zeros((2, 2, 16, 64))  # (batch, kv_heads, seq_k, dim)
POINTER = "eqx_flash.dot_product_attention"


def _mha() -> eqx_flash.FlashMultiheadAttention:
    return eqx_flash.FlashMultiheadAttention(4, 16, key=jax.random.key(0))


# (id, call, entry, argument, what the first line must contain, a shape error?)
CASES: list[tuple[str, Callable[[], Any], str, str, list[str], bool]] = [
    ("head-dim", lambda: eqx_flash.flash_attention(Q, jnp.zeros((2, 2, 16, 32)), V),
     "flash_attention", "k", ["(*batch, kv_heads, seq_k, dim)", "dim=64 as q has it",
                              "float32[2,2,16,32]", "(dim=32)"], True),
    ("seq-k", lambda: eqx_flash.flash_attention(Q, K, jnp.zeros((2, 2, 17, 64))),
     "flash_attention", "v", ["seq_k=16 as k has it", "(seq_k=17)"], True),
    ("batch", lambda: eqx_flash.plain_attention(Q, jnp.zeros((3, 2, 16, 64)), V),
     "plain_attention", "k", ["*batch=(2,) as q has it", "(*batch=(3,))"], True),
    ("float-mask", lambda: eqx_flash.flash_attention(Q, K, V, jnp.ones((2, 16))),
     "flash_attention", "mask", ["a bool or integer array", "got float32[2,16]"], False),
    ("one-axis-q", lambda: eqx_flash.flash_attention(jnp.zeros(64), K, V),
     "flash_attention", "q", ["(*batch, heads, seq_q, dim) or (seq_q, dim)",
                              "got float32[64]"], True),
    ("list", lambda: eqx_flash.causal_flash_attention([[1.0]], K, V),
     "causal_flash_attention", "q", ["JAX or NumPy", "got list"], False),
    ("ids", lambda: eqx_flash.flash_attention(
        Q, K, V, q_segment_ids=jnp.zeros((2, 15), jnp.int32),
        kv_segment_ids=jnp.zeros((2, 16), jnp.int32)),
     "flash_attention", "q_segment_ids", ["seq_q=16 as q has it", "(seq_q=15)"], True),
    ("cosine", lambda: eqx_flash.cosine_sim_flash_attention(Q, jnp.zeros((2, 2, 16, 8)), V),
     "cosine_sim_flash_attention", "k", ["dim=64 as q has it"], True),
    ("module-batched", lambda: _mha()(jnp.zeros((2, 6, 16)), jnp.zeros((2, 6, 16)),
                                      jnp.zeros((2, 6, 16))),
     "FlashMultiheadAttention", "query",
     ["got float32[2,6,16]", "takes one example — use jax.vmap for a batch"], True),
    ("module-float-mask", lambda: _mha()(jnp.zeros((6, 16)), jnp.zeros((6, 16)),
                                         jnp.zeros((6, 16)), jnp.ones((6,))),
     "FlashMultiheadAttention", "mask", ["a bool array", "got float32[6]"], False),
    ("attention-batched", lambda: eqx_flash.FlashAttention()(Q, K, V),
     "FlashAttention", "q", ["(heads, seq_q, dim)", "use jax.vmap for a batch"], True),
    ("decode-batched", lambda: _mha().decode(jnp.zeros((2, 1, 16)),
                                             _mha().init_cache(max_len=8)),
     "FlashMultiheadAttention.decode", "x", ["use jax.vmap for a batch"], True),
]


@pytest.mark.parametrize("call, entry, argument, wanted, shape",
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_first_line_says_argument_expected_and_got(call, entry, argument, wanted, shape):
    with pytest.raises(jaxtyping.TypeCheckError) as error:
        call()
    message = str(error.value)
    first, *rest = message.splitlines()
    assert first.startswith(f"{entry}: parameter '{argument}' expected "), first
    assert ", got " in first, first
    for part in wanted:
        assert part in first, (part, first)
    assert len(first) < 250, first
    # The layout line follows a wrong shape of a function (not a module, not a dtype).
    assert (POINTER in rest[0]) == (shape and entry.endswith("attention")), rest[0]
    # jaxtyping's own message follows, and is what the tests and users matched before.
    assert "The problem arose whilst typechecking parameter" in message
    assert isinstance(error.value, TypeError)


def test_under_jit():
    """The summary is computed from tracers' shapes and dtypes too."""
    with pytest.raises(TypeError) as error:
        jax.jit(eqx_flash.flash_attention)(Q, jnp.zeros((2, 2, 16, 32)), V)
    assert "dim=64 as q has it" in str(error.value).splitlines()[0]


def test_numpy_arrays():
    with pytest.raises(TypeError) as error:
        eqx_flash.flash_attention(np.zeros((2, 8, 16, 64), np.float32),
                                  np.zeros((2, 2, 16, 32), np.float32), np.asarray(V))
    assert "dim=64 as q has it" in str(error.value).splitlines()[0]


def test_jax_nn_layout_points_at_dot_product_attention():
    """jax.nn's (batch, seq, heads, dim): sizes that do not fit eqx_flash's layout give an
    error whose message says the layout and where jax.nn's goes, whichever check catches
    them, with jaxtyping's checks on or off."""
    q = jnp.zeros((2, 100, 8, 32))  # (batch, seq_q, heads, dim): jax.nn's layout
    k = v = jnp.zeros((2, 160, 2, 32))  # 160 "kv heads" do not divide 100 "heads"
    for disabled in (False, True):
        before = jaxtyping.config.jaxtyping_disable
        jaxtyping.config.update("jaxtyping_disable", disabled)
        try:
            with pytest.raises(ValueError, match="heads before seq") as error:
                eqx_flash.flash_attention(q, k, v)
        finally:
            jaxtyping.config.update("jaxtyping_disable", before)
        assert POINTER in str(error.value)


def test_checks_off_shape_error_states_the_layout():
    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        with pytest.raises(ValueError) as error:
            eqx_flash.flash_attention(Q, jnp.zeros((2, 2, 16, 32)), V)
    finally:
        jaxtyping.config.update("jaxtyping_disable", before)
    first, layout = str(error.value).splitlines()
    assert "q and k must have the same head dim" in first and POINTER in layout


def test_a_nested_error_is_left_alone():
    """A `score_mod` whose own checked function fails keeps its own message."""

    @jaxtyping.jaxtyped(typechecker=__import__("beartype").beartype)
    def bad_mod(score: jaxtyping.Float[jax.Array, "a b"], b, h, i, j):
        return score

    with pytest.raises(Exception) as error:  # noqa: B017 - whatever the tracing raises
        eqx_flash.flash_attention(Q, K, V, score_mod=bad_mod)
    assert not str(error.value).startswith("flash_attention: parameter")
