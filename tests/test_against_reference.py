"""flash_attention against plain_attention: values, lse and gradients over fixed cases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, assert_lse_close, values_and_grads

from eqx_flash import causal_flash_attention, flash_attention, plain_attention


# Inputs are drawn with NumPy and placed on the device: eager jax.random compiles a
# program for every shape.
def qkv(seed, q_shape, k_shape, dim_v=None):
    """Standard normal float32 q `q_shape`, k `k_shape` and v (k's shape with last axis
    `dim_v`, default k's) from NumPy's generator `seed`."""
    rng = np.random.default_rng(seed)
    v_shape = (*k_shape[:-1], k_shape[-1] if dim_v is None else dim_v)
    return jax.device_put(tuple(rng.standard_normal(shape, np.float32)
                                for shape in (q_shape, k_shape, v_shape)))


def _masks(seed, lead, seq_q, seq_k, kinds):
    """Random masks/ids over `lead` leading axes (without heads) for the named kinds."""
    rng = np.random.default_rng(seed)
    out = {}
    if "mask" in kinds:
        out["mask"] = rng.random((*lead, seq_k)) < 0.7
    if "int_mask" in kinds:
        out["mask"] = rng.integers(0, 2, (*lead, seq_k), np.int32)
    if "attn_mask" in kinds:
        out["attn_mask"] = rng.random((seq_q, seq_k)) < 0.8
    if "segments" in kinds:
        # Sorted ids: packed documents of random lengths.
        out["q_segment_ids"] = np.sort(rng.integers(0, 3, (*lead, seq_q), np.int32), axis=-1)
        out["kv_segment_ids"] = np.sort(rng.integers(0, 3, (*lead, seq_k), np.int32), axis=-1)
    return jax.device_put(out)


# id, q shape, k shape, dim_v, mask kinds, keywords, (block_q, block_k). Each case puts
# several features together (each compiled case costs seconds): a 4-d problem with a key
# mask, seed style, is "causal-q<k" and "blocks-not-dividing" (and
# `test_semantics.test_matches_seed_package`); GQA with a key mask, "everything"; causal on
# a square problem over several blocks, "mqa-4-to-1".
CASES = [
    ("2d-no-leading", (33, 16), (33, 16), None, (), {}, (8, 8)),
    ("3d-heads-window-sym", (2, 40, 16), (2, 40, 16), None, ("mask",), dict(window=5),
     (8, 8)),
    ("5d-leading-window-right-only", (2, 1, 2, 20, 8), (2, 1, 2, 24, 8), None, ("mask",),
     dict(window=(None, 3)), (8, 16)),
    ("mqa-4-to-1", (1, 4, 50, 8), (1, 1, 50, 8), None, (), dict(causal=True), (16, 8)),
    ("causal-q<k", (1, 2, 20, 16), (1, 2, 100, 16), None, ("mask",), dict(causal=True), (8, 16)),
    ("causal-q>k", (1, 2, 100, 16), (1, 2, 20, 16), None, (), dict(causal=True), (16, 8)),
    ("window-left-causal", (1, 2, 70, 16), (1, 2, 90, 16), None, ("mask",),
     dict(window=(10, None), causal=True), (16, 16)),
    ("pair-mask-int-mask-segments", (2, 2, 40, 16), (2, 2, 48, 16), None,
     ("attn_mask", "int_mask", "segments"), {}, (16, 16)),
    ("everything", (2, 4, 45, 16), (2, 2, 61, 16), 8, ("mask", "attn_mask", "segments"),
     dict(causal=True, window=(20, 2), softcap=5.0, scale=0.3), (16, 8)),
    ("softcap-dim-v-differs", (1, 2, 48, 16), (1, 2, 56, 16), 24, (),
     dict(softcap=2.0, scale=1.0), (32, 32)),
    ("lengths-1", (1, 1, 1, 8), (1, 1, 1, 8), None, (), {}, (None, None)),
    ("seq-1500", (1, 1, 1500, 8), (1, 1, 1500, 8), None, ("mask",), {}, (None, None)),
    ("blocks-larger-than-seq", (1, 2, 7, 8), (1, 2, 9, 8), None, (), dict(causal=True),
     (64, 64)),
    ("blocks-not-dividing", (1, 2, 100, 8), (1, 2, 130, 8), None, ("mask",), {}, (7, 13)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(case):
    _, q_shape, k_shape, dim_v, kinds, kwargs, (bq, bk) = case
    q, k, v = qkv(0, q_shape, k_shape, dim_v)
    lead = q_shape[:-3] if len(q_shape) > 2 else ()
    kwargs = {**kwargs, **_masks(1, lead, q_shape[-2], k_shape[-2], kinds)}

    # (`values_and_grads`: fixed NumPy weights, no random-number program in each compile.)
    (out, lse), grads = values_and_grads(
        flash_attention, q, k, v, block_q=bq, block_k=bk, **kwargs
    )
    (ref_out, ref_lse), ref_grads = values_and_grads(plain_attention, q, k, v, **kwargs)
    assert out.shape == (*q_shape[:-1], v.shape[-1]) and out.dtype == q.dtype
    assert lse.shape == q_shape[:-1] and lse.dtype == jnp.float32
    # rtol_scale=0.5 keeps float32's rtol at 1e-5 (atol 2e-5), as before the tables merged.
    assert_close(out, ref_out, rtol_scale=0.5, name="out")
    assert_lse_close(lse, ref_lse, rtol_scale=0.5)
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        assert np.isfinite(np.asarray(g)).all(), f"d{name} not finite"
        assert_close(g, r, kind="grad", scale=2.0, rtol_scale=0.5, name=f"d{name}")


def test_causal_flash_attention_is_causal():
    q, k, v = qkv(2, (2, 2, 50, 16), (2, 2, 70, 16))
    a = causal_flash_attention(q, k, v, block_q=16, block_k=16)
    b = flash_attention(q, k, v, causal=True, block_q=16, block_k=16)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    with pytest.raises(TypeError, match="causal"):
        causal_flash_attention(q, k, v, causal=False)


def test_default_scale_is_inverse_sqrt_dim():
    q, k, v = qkv(3, (2, 30, 16), (2, 30, 16))
    a, _ = flash_attention(q, k, v)
    b, _ = flash_attention(q, k, v, scale=0.25)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_causal_alignment_is_bottom_right():
    """With one query and many keys (decoding), causal attends to every key."""
    q, k, v = qkv(4, (2, 1, 16), (2, 40, 16))
    causal, _ = flash_attention(q, k, v, causal=True, block_k=16)
    full, _ = flash_attention(q, k, v, block_k=16)
    np.testing.assert_allclose(causal, full, rtol=1e-6, atol=1e-6)
    # Last query row of a square problem sees everything too; first sees only key 0.
    q, k, v = qkv(5, (1, 20, 8), (1, 20, 8))
    out, _ = flash_attention(q, k, v, causal=True, block_q=8, block_k=8)
    np.testing.assert_allclose(np.asarray(out)[0, 0], np.asarray(v)[0, 0], rtol=1e-6, atol=1e-6)


def test_mask_broadcasting_forms_agree():
    """(batch, seq_k) seed style, (batch, heads, seq_k) and (seq_k,) masks broadcast alike."""
    q, k, v = qkv(6, (2, 3, 20, 8), (2, 3, 24, 8))
    m = np.random.default_rng(7).random((2, 24)) < 0.6  # (NumPy: no eager op to compile)
    a, _ = flash_attention(q, k, v, jax.device_put(m), block_k=8)
    b, _ = flash_attention(q, k, v, jax.device_put(np.broadcast_to(m[:, None], (2, 3, 24))),
                           block_k=8)
    c, _ = flash_attention(q, k, v, attn_mask=jax.device_put(m[:, None, None, :]), block_k=8)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(a, c, rtol=1e-6, atol=1e-6)
    shared = np.random.default_rng(8).random(24) < 0.6
    d, _ = flash_attention(q, k, v, jax.device_put(shared))
    e, _ = flash_attention(q, k, v, jax.device_put(np.broadcast_to(shared, (2, 24))))
    np.testing.assert_allclose(d, e, rtol=1e-6, atol=1e-6)


def test_per_head_key_mask_under_gqa():
    """A key mask that differs between query heads of one kv group is honoured per head."""
    q, k, v = qkv(9, (1, 4, 16, 8), (1, 2, 24, 8))
    m = np.random.default_rng(10).random((1, 4, 24)) < 0.5
    m[..., 0] = True
    m = jax.device_put(m)
    out, lse = flash_attention(q, k, v, m, block_q=8, block_k=8)
    ref_out, ref_lse = jax.jit(plain_attention)(q, k, v, m)  # (faster than op by op)
    assert_close(out, ref_out, rtol_scale=0.5)
    assert_lse_close(lse, ref_lse, rtol_scale=0.5)
