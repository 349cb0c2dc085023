"""Zero-size and size-one axes through every public function: either the documented empty
result (the same as `plain_attention`'s where it has one) or a `ValueError` naming the
argument or axis, never a `ZeroDivisionError` from inside.

The choices: zero heads or an empty batch give empty `out`/`lse` (no query rows, nothing to
compute); a zero-length sequence or head dim raises naming `seq_q`/`seq_k`/`dim`; `decode`
of zero tokens returns an empty output and the cache unchanged; `make_block_mask` and
`init_cache` refuse zero sizes naming them; `merge_attention` of zero parts raises naming
`outs`, and of empty rows returns them empty.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import seeded_qkv

import eqx_flash

D = 8
FUNCTIONS = {
    "flash_attention": eqx_flash.flash_attention,
    "causal_flash_attention": eqx_flash.causal_flash_attention,
    "plain_attention": eqx_flash.plain_attention,
    "cosine_sim_flash_attention": eqx_flash.cosine_sim_flash_attention,
}


def _qkv(batch, heads, kv_heads, seq_q, seq_k, dim=D):
    # Drawn by NumPy: `jax.random` compiled three programs per shape.
    return seeded_qkv((*batch, heads, seq_q, dim), (*batch, kv_heads, seq_k, dim))


EMPTY = {  # (batch, heads, kv_heads, seq_q, seq_k): empty out and lse of q's rows
    "batch0": ((0,), 2, 1, 4, 5),
    "batch2x0": ((2, 0), 2, 2, 4, 5),
    "heads0": ((2,), 0, 1, 4, 5),
}
REFUSED = {  # ... raise a ValueError naming:
    "seq_q0": (((2,), 2, 1, 0, 5), "seq_q"),
    "seq_k0": (((2,), 2, 1, 4, 0), "seq_k"),
    "kv_heads0": (((2,), 0, 0, 4, 5), "heads axis"),
}
ONE = {
    "all1": ((1,), 1, 1, 1, 1),
    "seq_q1": ((2,), 2, 1, 1, 7),
    "seq_k1": ((2,), 2, 1, 7, 1),
    "unbatched_seq1": ((), 1, 1, 1, 1),
}


@pytest.mark.parametrize("case", list(EMPTY))
@pytest.mark.parametrize("fn", list(FUNCTIONS))
def test_no_query_rows_give_empty_results(fn, case):
    batch, heads, kv_heads, seq_q, seq_k = EMPTY[case]
    q, k, v = _qkv(batch, heads, kv_heads, seq_q, seq_k)
    out, lse = FUNCTIONS[fn](q, k, v)
    assert out.shape == (*batch, heads, seq_q, D) and out.dtype == q.dtype
    assert lse.shape == (*batch, heads, seq_q) and lse.dtype == jnp.float32
    ref_out, ref_lse = jax.eval_shape(eqx_flash.plain_attention, q, k, v)
    assert (ref_out.shape, ref_lse.shape) == (out.shape, lse.shape)
    # Gradients and the jitted call as one program (eagerly each op of the backward
    # compiled its own).
    grads, (jitted, _) = jax.jit(lambda q, k, v: (
        jax.grad(lambda q, k, v: jnp.sum(FUNCTIONS[fn](q, k, v)[0]), argnums=(0, 1, 2))(
            q, k, v), FUNCTIONS[fn](q, k, v)))(q, k, v)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert jitted.shape == out.shape


@pytest.mark.parametrize("case", list(REFUSED))
@pytest.mark.parametrize("fn", list(FUNCTIONS))
def test_zero_length_axes_raise_naming_them(fn, case):
    shape, name = REFUSED[case]
    q, k, v = _qkv(*shape)
    with pytest.raises(ValueError, match=name):
        FUNCTIONS[fn](q, k, v)


@pytest.mark.parametrize("case", list(ONE))
@pytest.mark.parametrize("fn", [f for f in FUNCTIONS if f != "plain_attention"])
def test_size_one_axes_match_plain_attention(fn, case):
    batch, heads, kv_heads, seq_q, seq_k = ONE[case]
    q, k, v = _qkv(batch, heads, kv_heads, seq_q, seq_k)
    if not batch:
        q, k, v = q[0], k[0], v[0]
    out, lse = FUNCTIONS[fn](q, k, v)
    if fn == "cosine_sim_flash_attention":
        norm = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
        q, k = norm(np.asarray(q)), norm(np.asarray(k))
    # The reference compiled whole (eagerly, each op was a program).
    ref_out, ref_lse = jax.jit(functools.partial(
        eqx_flash.plain_attention, causal=fn == "causal_flash_attention",
        scale=10.0 if fn == "cosine_sim_flash_attention" else None))(q, k, v)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-5, rtol=1e-5)


def test_flash_attention_module():
    fa = eqx.nn.inference_mode(eqx_flash.FlashAttention())
    q, k, v = _qkv((), 0, 1, 4, 5)
    assert fa(q, k, v).shape == (0, 4, D)
    for shape, name in REFUSED.values():
        q, k, v = _qkv(*shape)
        with pytest.raises(ValueError, match=name):
            fa(q[0], k[0], v[0])
    q, k, v = _qkv((), 1, 1, 1, 1)
    np.testing.assert_allclose(np.asarray(fa(q, k, v)), np.asarray(v), rtol=1e-6)


def test_flash_multihead_attention_and_decode():
    mha = eqx_flash.FlashMultiheadAttention(2, 8, key=jax.random.key(1), causal=True)
    x = jax.random.normal(jax.random.key(2), (5, 8))
    with pytest.raises(ValueError, match="seq_q"):
        mha(x[:0], x, x)
    with pytest.raises(ValueError, match="seq_k"):
        mha(x, x[:0], x[:0])
    np.testing.assert_allclose(np.asarray(mha(x[:1], x[:1], x[:1])),
                               np.asarray(mha(x, x, x)[:1]), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="max_len"):
        mha.init_cache(0)
    with pytest.raises(ValueError, match="window"):
        mha.init_cache(8, window=0)
    rolling = eqx_flash.FlashMultiheadAttention(2, 8, key=jax.random.key(1), causal=True,
                                                window=(3, 0))
    for layer, cache in ((mha, mha.init_cache(8)), (rolling, rolling.init_cache(8, window=4))):
        out, after = layer.decode(x[:0], cache)
        assert out.shape == (0, 8)
        assert int(after.length) == 0
        out, after = layer.decode(x[:1], after)  # then one token, as from empty
        np.testing.assert_allclose(np.asarray(out), np.asarray(layer(x[:1], x[:1], x[:1])),
                                   atol=1e-5, rtol=1e-5)
        out, again = eqx.filter_jit(layer.decode)(x[:0], after)
        assert out.shape == (0, 8) and int(again.length) == 1


def test_make_block_mask():
    causal = lambda b, h, i, j: j <= i  # noqa: E731
    for kwargs, name in ((dict(heads=0), "heads"), (dict(seq_q=0), "seq_q"),
                         (dict(seq_k=0), "seq_k"), (dict(batch_shape=(0,)), "batch_shape"),
                         (dict(batch_shape=0), "batch_shape")):
        args = dict(batch_shape=(), heads=1, seq_q=8, seq_k=8) | kwargs
        with pytest.raises(ValueError, match=name):
            eqx_flash.make_block_mask(causal, **args)
    bm = eqx_flash.make_block_mask(causal, (1,), 1, 1, 1)
    assert bm.flags.shape == (1, 1, 1, 1) and int(bm.flags[0, 0, 0, 0]) == 2
    q, k, v = _qkv((1,), 1, 1, 1, 1)
    out, _ = eqx_flash.flash_attention(q, k, v, mask_mod=causal, block_mask=bm)
    np.testing.assert_allclose(np.asarray(out), np.asarray(v), rtol=1e-6)


def test_merge_attention():
    def ones(shape):
        return np.ones(shape, np.float32)

    with pytest.raises(ValueError, match="outs"):
        eqx_flash.merge_attention(ones((0, 2, 3, 4)), ones((0, 2, 3)))
    out, lse = eqx_flash.merge_attention(ones((2, 2, 0, 4)), ones((2, 2, 0)))
    assert out.shape == (2, 0, 4) and lse.shape == (2, 0)
    out, lse = eqx_flash.merge_attention(ones((2, 0, 3, 4)), ones((2, 0, 3)))
    assert out.shape == (0, 3, 4) and lse.shape == (0, 3)
    one_out, one_lse = 2 * ones((1, 1, 1, 4)), 0.5 * ones((1, 1, 1))
    out, lse = eqx_flash.merge_attention(one_out, one_lse)
    np.testing.assert_allclose(np.asarray(out), np.asarray(one_out[0]))
    np.testing.assert_allclose(np.asarray(lse), np.asarray(one_lse[0]))
