"""The blockwise kernels against `plain_attention`: values, lse and gradients (through
both `out` and `lse`) over the configurations the kernels special-case for speed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_flash import flash_attention, plain_attention

# (name, seq_q, seq_k, heads, kv_heads, keywords, blocks)
CASES = [
    ("dense", 100, 130, 2, 2, {}, (32, 48)),
    ("dense_one_block", 7, 7, 2, 1, {}, (None, None)),
    ("causal", 130, 130, 2, 2, {"causal": True}, (32, 32)),
    ("causal_rect", 100, 130, 2, 1, {"causal": True}, (32, 48)),
    ("causal_short_k", 130, 100, 2, 2, {"causal": True}, (48, 32)),
    ("window", 130, 130, 2, 2, {"window": (20, 5)}, (32, 32)),
    ("gqa_key_mask", 100, 130, 4, 2, {"key_mask": True}, (32, 48)),
    ("segments_causal", 130, 130, 2, 2, {"segments": True, "causal": True}, (32, 32)),
    ("softcap_dropout", 100, 130, 2, 2, {"softcap": 5.0, "dropout_rate": 0.3}, (32, 48)),
    ("default_blocks_1500", 1500, 1500, 1, 1, {"causal": True, "key_mask": True},
     (None, None)),
]


def _inputs(seq_q, seq_k, heads, kv_heads, dtype, seed=0):
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (2, heads, seq_q, 16), dtype)
    k = jax.random.normal(kk, (2, kv_heads, seq_k, 16), dtype)
    v = jax.random.normal(kv, (2, kv_heads, seq_k, 16), dtype)
    return q, k, v, kd


def _keywords(spec, seq_q, seq_k, key):
    kw = dict(spec)
    if kw.pop("key_mask", False):
        mask = jnp.arange(seq_k)[None, :] < jnp.array([[seq_k - 37], [seq_k // 3]])
        # The second batch row masks a whole block range; the first row's last key too.
        kw["mask"] = mask
    if kw.pop("segments", False):
        ids = (jnp.arange(seq_q) // 45).astype(jnp.int32)
        kw["q_segment_ids"] = jnp.broadcast_to(ids, (2, seq_q))
        kw["kv_segment_ids"] = jnp.broadcast_to((jnp.arange(seq_k) // 45).astype(jnp.int32),
                                                (2, seq_k))
    if kw.get("dropout_rate"):
        kw["key"] = key
    return kw


def _loss(fn, kw):
    def loss(q, k, v):
        out, lse = fn(q, k, v, **kw)
        lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out.astype(jnp.float32) * jnp.cos(out.astype(jnp.float32))) + jnp.sum(
            jnp.sin(lse)
        )

    return jax.value_and_grad(loss, argnums=(0, 1, 2))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_plain(case):
    _, seq_q, seq_k, heads, kv_heads, spec, (bq, bk) = case
    q, k, v, kd = _inputs(seq_q, seq_k, heads, kv_heads, jnp.float32)
    kw = _keywords(spec, seq_q, seq_k, kd)
    out, lse = flash_attention(q, k, v, block_q=bq, block_k=bk, **kw)
    ref_out, ref_lse = plain_attention(q, k, v, **kw)
    np.testing.assert_allclose(out, ref_out, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(ref_lse))
    finite = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(ref_lse)[finite], atol=2e-5)

    flash = _loss(lambda *a, **k_: flash_attention(*a, block_q=bq, block_k=bk, **k_), kw)
    value, grads = flash(q, k, v)
    ref_value, ref_grads = _loss(plain_attention, kw)(q, k, v)
    np.testing.assert_allclose(value, ref_value, rtol=1e-4)
    for g, r in zip(grads, ref_grads, strict=True):
        assert np.all(np.isfinite(np.asarray(g)))
        np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4)


def test_fully_masked_rows():
    q, k, v, _ = _inputs(70, 70, 2, 2, jnp.float32)
    mask = jnp.zeros((2, 70), bool).at[0, :10].set(True)  # batch 1 sees no key at all
    seg_q = jnp.broadcast_to(jnp.where(jnp.arange(70) < 35, 1, 7), (2, 70)).astype(jnp.int32)
    seg_k = jnp.broadcast_to(jnp.where(jnp.arange(70) < 35, 1, 2), (2, 70)).astype(jnp.int32)
    kw = dict(mask=mask, q_segment_ids=seg_q, kv_segment_ids=seg_k, causal=True)
    out, lse = flash_attention(q, k, v, block_q=16, block_k=16, **kw)
    assert np.all(np.asarray(out)[1] == 0) and np.all(np.isneginf(np.asarray(lse)[1]))
    assert np.all(np.asarray(out)[0, :, 35:] == 0)
    _, grads = _loss(lambda *a, **k_: flash_attention(*a, block_q=16, block_k=16, **k_), kw)(
        q, k, v
    )
    _, ref_grads = _loss(plain_attention, kw)(q, k, v)
    for g, r in zip(grads, ref_grads, strict=True):
        assert np.all(np.isfinite(np.asarray(g)))
        np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16(causal):
    q, k, v, _ = _inputs(100, 130, 4, 2, jnp.bfloat16)
    out, lse = flash_attention(q, k, v, causal=causal, block_q=32, block_k=48)
    ref_out, ref_lse = plain_attention(q, k, v, causal=causal)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    np.testing.assert_allclose(out.astype(jnp.float32), ref_out.astype(jnp.float32),
                               atol=3e-2, rtol=3e-2)
    np.testing.assert_allclose(lse, ref_lse, atol=3e-2)
    _, grads = _loss(lambda *a, **k_: flash_attention(*a, block_q=32, block_k=48, **k_),
                     {"causal": causal})(q, k, v)
    _, ref = _loss(plain_attention, {"causal": causal})(q, k, v)
    for g, r in zip(grads, ref, strict=True):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_allclose(g.astype(jnp.float32), r.astype(jnp.float32),
                                   atol=0.1, rtol=0.1)
