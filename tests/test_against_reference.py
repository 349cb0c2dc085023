"""flash_attention against plain_attention: values, lse and gradients over fixed cases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, assert_lse_close, outputs_and_grads, qkv

from eqx_flash import causal_flash_attention, flash_attention, plain_attention


def _masks(key, lead, seq_q, seq_k, kinds):
    """Random masks/ids over `lead` leading axes (without heads) for the named kinds."""
    k1, k2, k3, k4 = jax.random.split(key, 4)
    out = {}
    if "mask" in kinds:
        out["mask"] = jax.random.bernoulli(k1, 0.7, (*lead, seq_k))
    if "int_mask" in kinds:
        out["mask"] = jax.random.randint(k1, (*lead, seq_k), 0, 2)
    if "attn_mask" in kinds:
        out["attn_mask"] = jax.random.bernoulli(k2, 0.8, (seq_q, seq_k))
    if "segments" in kinds:
        # Sorted ids: packed documents of random lengths.
        out["q_segment_ids"] = jnp.sort(jax.random.randint(k3, (*lead, seq_q), 0, 3), axis=-1)
        out["kv_segment_ids"] = jnp.sort(jax.random.randint(k4, (*lead, seq_k), 0, 3), axis=-1)
    return out


# id, q shape, k shape, dim_v, mask kinds, keywords, (block_q, block_k)
CASES = [
    ("2d-no-leading", (33, 16), (33, 16), None, (), {}, (8, 8)),
    ("3d-heads", (2, 40, 16), (2, 40, 16), None, ("mask",), {}, (16, 16)),
    ("seed-4d-key-mask", (2, 2, 64, 16), (2, 2, 64, 16), None, ("mask",), {}, (16, 32)),
    ("5d-leading", (2, 1, 2, 20, 8), (2, 1, 2, 24, 8), None, ("mask",), {}, (8, 8)),
    ("int-mask", (2, 2, 30, 16), (2, 2, 30, 16), None, ("int_mask",), {}, (None, None)),
    ("dim-v-differs", (1, 2, 48, 16), (1, 2, 56, 16), 24, (), {}, (16, 16)),
    ("gqa-4-to-2", (2, 4, 37, 16), (2, 2, 45, 16), None, ("mask",), {}, (16, 16)),
    ("mqa-4-to-1", (1, 4, 50, 8), (1, 1, 50, 8), None, (), dict(causal=True), (16, 8)),
    ("causal-square", (1, 2, 100, 16), (1, 2, 100, 16), None, (), dict(causal=True), (32, 16)),
    ("causal-q<k", (1, 2, 20, 16), (1, 2, 100, 16), None, ("mask",), dict(causal=True), (8, 16)),
    ("causal-q>k", (1, 2, 100, 16), (1, 2, 20, 16), None, (), dict(causal=True), (16, 8)),
    ("window-sym", (1, 2, 64, 16), (1, 2, 64, 16), None, (), dict(window=5), (8, 8)),
    ("window-left-causal", (1, 2, 70, 16), (1, 2, 90, 16), None, ("mask",),
     dict(window=(10, None), causal=True), (16, 16)),
    ("window-right-only", (1, 2, 64, 16), (1, 2, 64, 16), None, (), dict(window=(None, 3)),
     (8, 16)),
    ("attn-mask", (2, 2, 40, 16), (2, 2, 48, 16), None, ("attn_mask",), {}, (16, 16)),
    ("segments", (2, 2, 64, 16), (2, 2, 64, 16), None, ("segments",), {}, (16, 16)),
    ("everything", (2, 4, 45, 16), (2, 2, 61, 16), 8, ("mask", "attn_mask", "segments"),
     dict(causal=True, window=(20, 2), softcap=5.0, scale=0.3), (16, 8)),
    ("softcap", (1, 2, 64, 16), (1, 2, 64, 16), None, (), dict(softcap=2.0, scale=1.0), (32, 32)),
    ("lengths-1", (1, 1, 1, 8), (1, 1, 1, 8), None, (), {}, (None, None)),
    ("seq-1500", (1, 1, 1500, 8), (1, 1, 1500, 8), None, ("mask",), {}, (None, None)),
    ("blocks-larger-than-seq", (1, 2, 7, 8), (1, 2, 9, 8), None, (), dict(causal=True),
     (64, 64)),
    ("blocks-not-dividing", (1, 2, 100, 8), (1, 2, 130, 8), None, ("mask",), {}, (7, 13)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(case, getkey):
    _, q_shape, k_shape, dim_v, kinds, kwargs, (bq, bk) = case
    q, k, v = qkv(getkey(), q_shape, k_shape, dim_v)
    lead = q_shape[:-3] if len(q_shape) > 2 else ()
    kwargs = {**kwargs, **_masks(getkey(), lead, q_shape[-2], k_shape[-2], kinds)}

    wkey = getkey()
    (out, lse), grads = outputs_and_grads(
        flash_attention, q, k, v, wkey, block_q=bq, block_k=bk, **kwargs
    )
    (ref_out, ref_lse), ref_grads = outputs_and_grads(plain_attention, q, k, v, wkey, **kwargs)
    assert out.shape == (*q_shape[:-1], v.shape[-1]) and out.dtype == q.dtype
    assert lse.shape == q_shape[:-1] and lse.dtype == jnp.float32
    # rtol_scale=0.5 keeps float32's rtol at 1e-5 (atol 2e-5), as before the tables merged.
    assert_close(out, ref_out, rtol_scale=0.5, name="out")
    assert_lse_close(lse, ref_lse, rtol_scale=0.5)
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        assert bool(jnp.isfinite(g).all()), f"d{name} not finite"
        assert_close(g, r, kind="grad", scale=2.0, rtol_scale=0.5, name=f"d{name}")


def test_causal_flash_attention_is_causal(getkey):
    q, k, v = qkv(getkey(), (2, 2, 50, 16), (2, 2, 70, 16))
    a = causal_flash_attention(q, k, v, block_q=16, block_k=16)
    b = flash_attention(q, k, v, causal=True, block_q=16, block_k=16)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    with pytest.raises(TypeError, match="causal"):
        causal_flash_attention(q, k, v, causal=False)


def test_default_scale_is_inverse_sqrt_dim(getkey):
    q, k, v = qkv(getkey(), (2, 30, 16), (2, 30, 16))
    a, _ = flash_attention(q, k, v)
    b, _ = flash_attention(q, k, v, scale=0.25)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_causal_alignment_is_bottom_right(getkey):
    """With one query and many keys (decoding), causal attends to every key."""
    q, k, v = qkv(getkey(), (2, 1, 16), (2, 40, 16))
    causal, _ = flash_attention(q, k, v, causal=True, block_k=16)
    full, _ = flash_attention(q, k, v, block_k=16)
    np.testing.assert_allclose(causal, full, rtol=1e-6, atol=1e-6)
    # Last query row of a square problem sees everything too; first sees only key 0.
    q, k, v = qkv(getkey(), (1, 20, 8), (1, 20, 8))
    out, _ = flash_attention(q, k, v, causal=True, block_q=8, block_k=8)
    np.testing.assert_allclose(out[0, 0], v[0, 0], rtol=1e-6, atol=1e-6)


def test_mask_broadcasting_forms_agree(getkey):
    """(batch, seq_k) seed style, (batch, heads, seq_k) and (seq_k,) masks broadcast alike."""
    q, k, v = qkv(getkey(), (2, 3, 20, 8), (2, 3, 24, 8))
    m = jax.random.bernoulli(getkey(), 0.6, (2, 24))
    a, _ = flash_attention(q, k, v, m, block_k=8)
    b, _ = flash_attention(q, k, v, jnp.broadcast_to(m[:, None], (2, 3, 24)), block_k=8)
    c, _ = flash_attention(q, k, v, attn_mask=m[:, None, None, :], block_k=8)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(a, c, rtol=1e-6, atol=1e-6)
    shared = jax.random.bernoulli(getkey(), 0.6, (24,))
    d, _ = flash_attention(q, k, v, shared)
    e, _ = flash_attention(q, k, v, jnp.broadcast_to(shared, (2, 24)))
    np.testing.assert_allclose(d, e, rtol=1e-6, atol=1e-6)


def test_per_head_key_mask_under_gqa(getkey):
    """A key mask that differs between query heads of one kv group is honoured per head."""
    q, k, v = qkv(getkey(), (1, 4, 16, 8), (1, 2, 24, 8))
    m = jax.random.bernoulli(getkey(), 0.5, (1, 4, 24)).at[..., 0].set(True)
    out, lse = flash_attention(q, k, v, m, block_q=8, block_k=8)
    ref_out, ref_lse = plain_attention(q, k, v, m)
    assert_close(out, ref_out, rtol_scale=0.5)
    assert_lse_close(lse, ref_lse, rtol_scale=0.5)
