"""Documented semantics: fully masked rows, dtypes, lse gradients, independent references."""

import functools

import flash_attention_jax as seed
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, assert_lse_close, enable_x64, qkv, values_and_grads

from eqx_flash import flash_attention, plain_attention, value_and_grad_difference


@pytest.mark.parametrize("fn", [flash_attention, plain_attention], ids=["flash", "plain"])
def test_fully_masked_rows_give_zero_and_neg_inf(fn, getkey):
    q, k, v = qkv(getkey(), (2, 2, 24, 8), (2, 2, 24, 8))
    # (Made in NumPy and checked in NumPy: no eager op to compile.)
    mask = np.ones((2, 24), bool)
    mask[1] = False  # batch 1 sees no key at all
    segments_q = np.zeros((2, 24), np.int32)
    segments_q[0, :5] = 7  # id 7 exists in no key
    mask, segments_q, segments_k = jax.device_put((mask, segments_q,
                                                   np.zeros((2, 24), np.int32)))
    kwargs = dict(q_segment_ids=segments_q, kv_segment_ids=segments_k)
    if fn is flash_attention:
        kwargs.update(block_q=8, block_k=8)

    def loss(q, k, v):
        out, lse = fn(q, k, v, mask, **kwargs)
        return jnp.sum(out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)

    grads, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    grads, out, lse = [np.asarray(g) for g in grads], np.asarray(out), np.asarray(lse)
    np.testing.assert_array_equal(out[1], 0.0)
    np.testing.assert_array_equal(out[0, :, :5], 0.0)
    assert np.isneginf(lse[1]).all() and np.isneginf(lse[0, :, :5]).all()
    assert np.isfinite(lse[0, :, 5:]).all()
    for g in grads:
        assert np.isfinite(g).all()
    np.testing.assert_array_equal(grads[0][1], 0.0)  # dq of rows with no key
    np.testing.assert_array_equal(grads[0][0, :, :5], 0.0)
    np.testing.assert_array_equal(grads[1][1], 0.0)  # nothing flows into unattended keys
    np.testing.assert_array_equal(grads[2][1], 0.0)


def test_causal_with_more_queries_than_keys_masks_early_rows(getkey):
    q, k, v = qkv(getkey(), (1, 10, 8), (1, 4, 8))
    out, lse = (np.asarray(x) for x in flash_attention(q, k, v, causal=True))
    # Bottom-right alignment: query i sees keys j <= i - 6, so rows 0..5 see nothing.
    np.testing.assert_array_equal(out[0, :6], 0.0)
    assert np.isneginf(lse[0, :6]).all() and np.isfinite(lse[0, 6:]).all()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_keeps_dtype_and_accuracy(dtype, getkey):
    """Also under conftest's strict dtype promotion, which once rejected the statistics
    dtype of half-precision inputs (it came from `promote_types`)."""
    q, k, v = qkv(getkey(), (2, 2, 70, 16), (2, 2, 90, 16), dtype=dtype)
    mask = jax.device_put(np.random.default_rng(0).random((2, 90)) < 0.8)
    # (`values_and_grads`: fixed NumPy weights, no random-number program in each compile.)
    (out, lse), grads = values_and_grads(flash_attention, q, k, v, mask=mask,
                                         causal=True, block_q=32, block_k=32)
    f32 = jax.device_put([np.asarray(x, np.float32) for x in (q, k, v)])
    (ref_out, ref_lse), ref_grads = values_and_grads(plain_attention, *f32, mask=mask,
                                                     causal=True)
    assert out.dtype == dtype and lse.dtype == jnp.float32
    assert all(g.dtype == dtype for g in grads)
    assert_close(out, ref_out, dtype=dtype)
    assert_lse_close(lse, ref_lse, dtype=dtype)
    for g, r in zip(grads, ref_grads, strict=True):
        assert_close(g, r, dtype=dtype, kind="grad", scale=3.0)


def test_float64_is_exact_to_float64_roundoff(getkey):
    with enable_x64(True):
        q, k, v = qkv(getkey(), (2, 33, 8), (2, 47, 8), dtype=jnp.float64)
        (out, lse), grads = values_and_grads(flash_attention, q, k, v, causal=True,
                                             block_q=8, block_k=16)
        (ref_out, ref_lse), ref_grads = values_and_grads(plain_attention, q, k, v,
                                                         causal=True)
        assert out.dtype == jnp.float64 and lse.dtype == jnp.float64
        assert_close(out, ref_out, dtype=jnp.float64)
        assert_lse_close(lse, ref_lse, dtype=jnp.float64)
        for g, r in zip(grads, ref_grads, strict=True):
            assert g.dtype == jnp.float64
            assert_close(g, r, dtype=jnp.float64, kind="grad")


def test_lse_gradient_only(getkey):
    """A loss of lse alone (a z-loss) differentiates as d lse / d logits = softmax."""
    q, k, v = qkv(getkey(), (2, 40, 16), (2, 50, 16))

    def z_loss(fn, **kw):
        return lambda q, k: jnp.sum(fn(q, k, v, causal=True, **kw)[1] ** 2)

    g = jax.jit(jax.grad(z_loss(flash_attention, block_q=16, block_k=16), argnums=(0, 1)))(q, k)
    r = jax.jit(jax.grad(z_loss(plain_attention), argnums=(0, 1)))(q, k)
    for a, b in zip(g, r, strict=True):
        assert_close(a, b, kind="grad", scale=2.0, rtol_scale=0.5)


def _to_bthd(x):
    return np.swapaxes(x, -2, -3)


# MHA without causal, GQA with it (each against `plain_attention` in the other pairing:
# `test_against_reference`'s "causal-q<k" and `test_per_head_key_mask_under_gqa`).
@pytest.mark.parametrize(("causal", "kv_heads"), [(False, 4), (True, 2)])
def test_matches_jax_nn_dot_product_attention(causal, kv_heads, getkey):
    q, k, v = qkv(getkey(), (2, 4, 64, 16), (2, kv_heads, 64, 16))
    mask = np.random.default_rng(kv_heads).random((2, 64)) < 0.8
    mask[:, 0] = True
    out, _ = flash_attention(q, k, v, jax.device_put(mask), causal=causal, block_q=16,
                             block_k=32)
    # (The layout changed in NumPy, and the reference compiled whole: faster than op by op.)
    ref = jax.jit(functools.partial(
        jax.nn.dot_product_attention, is_causal=causal, implementation="xla"))(
        *jax.device_put([_to_bthd(np.asarray(x)) for x in (q, k, v)]),
        mask=jax.device_put(mask[:, None, None, :]))
    assert_close(out, _to_bthd(np.asarray(ref)), rtol_scale=0.5)


def test_matches_seed_package(getkey):
    """The seed's flash_attention and causal_flash_attention, at shapes where they work."""
    q, k, v = qkv(getkey(), (2, 2, 128, 32), (2, 2, 128, 32))
    mask = np.random.default_rng(1).random((2, 128)) < 0.7
    mask[:, 0] = True
    mask = jax.device_put(mask)
    out, _ = flash_attention(q, k, v, mask)
    assert_close(out, seed.flash_attention(q, k, v, mask), scale=5.0, rtol_scale=0.5)
    out, _ = flash_attention(q, k, v, causal=True)
    assert_close(out, seed.causal_flash_attention(q, k, v), scale=5.0, rtol_scale=0.5)
    # And the seed's own sanity check, run on our function against its reference
    # (compiled whole: faster than op by op; `test_main` runs it eagerly).
    diff, grads = _compiled_difference(seed.plain_attention, flash_attention, batch=1,
                                       heads=2, q_seq_len=64, k_seq_len=96, dim=16)
    assert float(diff) < 1e-5 and max(float(g) for g in grads) < 1e-4


def _compiled_difference(fn1, fn2, **kwargs):
    """`value_and_grad_difference`, compiled whole: faster than op by op."""
    return jax.jit(functools.partial(value_and_grad_difference, fn1, fn2, **kwargs))()


def test_value_and_grad_difference_detects_a_difference():
    def wrong(q, k, v, mask):
        return flash_attention(q, k, v, mask, scale=0.9 / q.shape[-1] ** 0.5)

    diff, grads = _compiled_difference(plain_attention, wrong, batch=1, heads=1,
                                       q_seq_len=32, k_seq_len=32, dim=16)
    assert float(diff) > 1e-3 and min(float(g) for g in grads) > 1e-4
    diff, grads = _compiled_difference(plain_attention, flash_attention, batch=1, heads=2,
                                       q_seq_len=32, k_seq_len=48, dim=16, kv_heads=1,
                                       causal=True)
    assert float(diff) < 1e-5 and max(float(g) for g in grads) < 1e-4


def test_reference_does_not_trip_debug_infs():
    """Masked keys never form an -inf (or NaN) inside `plain_attention`, run op by op with
    `jax_debug_infs` on; only the documented lse = -inf of an empty row may appear."""
    q, k, v = (jnp.asarray(np.random.default_rng(i).standard_normal((2, 8, 4)), jnp.float32)
               for i in range(3))
    mask = jnp.asarray([[True] * 6 + [False] * 2, [True] * 8])
    with jax.debug_infs(True):
        out, lse = plain_attention(q, k, v, mask, causal=True)
        jax.grad(lambda q: plain_attention(q, k, v, mask, causal=True)[0].sum())(q)
    ref_out, ref_lse = flash_attention(q, k, v, mask, causal=True)
    np.testing.assert_allclose(out, ref_out, atol=2e-6)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-6)
    empty = jnp.zeros((2, 8), bool).at[1].set(True)  # batch 0: every key masked
    with pytest.raises(FloatingPointError), jax.debug_infs(True):
        plain_attention(q, k, v, empty)  # its lse is -inf, as documented
