"""Additive score terms: `bias` and `alibi_slopes`, values and gradients (including the
bias's and the slopes' own), against `plain_attention` and `jax.nn.dot_product_attention`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, examples, seeded_normal, seeded_qkv, values_and_grads
from hypothesis import given

from eqx_flash import causal_flash_attention, flash_attention, plain_attention
from eqx_flash.testing import TOLERANCES, attention_inputs, check_attention

B, H, KH, SQ, SK, D = 2, 4, 2, 40, 56, 16
BLOCKS = dict(block_q=16, block_k=24)  # several blocks, neither length a multiple


def _qkv(heads=H, kv_heads=KH, seq_q=SQ, seq_k=SK):
    return seeded_qkv((B, heads, seq_q, D), (B, kv_heads, seq_k, D))


def _values_and_grads(fn, q, k, v, bias, slopes, **kwargs):
    """out, lse and the gradients w.r.t. q, k, v, bias, slopes of `seeded_linear_loss`."""
    return values_and_grads(
        lambda q, k, v, b, s: fn(q, k, v, bias=b, alibi_slopes=s, **kwargs),
        q, k, v, bias, slopes)


def _assert_grads_close(got, expected, rtol=1e-4, atol=1e-4):
    for name, g, e in zip(("dq", "dk", "dv", "dbias", "dslopes"), got, expected, strict=True):
        if e is None:
            assert g is None
            continue
        assert g.shape == e.shape and g.dtype == e.dtype, name
        scale = max(float(np.max(np.abs(np.asarray(e, np.float32)))), 1.0)
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(e, np.float32),
                                   rtol=rtol, atol=atol * scale, err_msg=name)


BIAS_SHAPES = [
    (B, H, SQ, SK),  # full
    (H, SQ, SK),  # shared over batch
    (SQ, SK),  # shared over batch and heads
    (1, 1, SK),  # a key bias
    (B, 1, SQ, 1),  # a per-query bias
    (B, H, 1, 1),  # one number per head
]


@pytest.mark.parametrize("bias_shape", BIAS_SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_bias_matches_reference(bias_shape, causal):
    q, k, v = _qkv()
    bias = seeded_normal(5, bias_shape)
    slopes = None
    got = _values_and_grads(
        lambda *a, **kw: flash_attention(*a, **BLOCKS, **kw), q, k, v, bias, slopes,
        causal=causal,
    )
    expected = _values_and_grads(plain_attention, q, k, v, bias, slopes, causal=causal)
    tol = TOLERANCES[jnp.dtype(jnp.float32)]
    np.testing.assert_allclose(got[0][0], expected[0][0], atol=tol.out[0], rtol=tol.out[1])
    np.testing.assert_allclose(got[0][1], expected[0][1], atol=tol.lse[0], rtol=tol.lse[1])
    _assert_grads_close(got[1], expected[1])


@pytest.mark.parametrize("slopes_shape", [(H,), (B, H), (1, H)], ids=str)
def test_alibi_matches_reference(slopes_shape):
    q, k, v = _qkv()
    slopes = np.abs(np.asarray(seeded_normal(6, slopes_shape))) * np.float32(0.3)
    got = _values_and_grads(lambda *a, **kw: flash_attention(*a, **BLOCKS, **kw),
                            q, k, v, None, slopes, window=(20, 5))
    expected = _values_and_grads(plain_attention, q, k, v, None, slopes, window=(20, 5))
    np.testing.assert_allclose(got[0][0], expected[0][0], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(got[0][1], expected[0][1], atol=2e-5, rtol=2e-5)
    _assert_grads_close(got[1], expected[1])


def test_alibi_definition():
    """`-slope * |i + seq_k - seq_q - j|`, FlashAttention-2's definition, equals the same
    bias written out."""
    q, k, v = _qkv()
    slopes = np.asarray([0.5, 0.25, 0.125, 0.0625], np.float32)
    i = np.arange(SQ)[:, None]
    j = np.arange(SK)[None, :]
    bias = -slopes[:, None, None] * np.abs(i + SK - SQ - j).astype(np.float32)[None]
    (out, lse), (ref_out, ref_lse) = jax.jit(lambda q, k, v, slopes, bias: (
        flash_attention(q, k, v, alibi_slopes=slopes, causal=True, **BLOCKS),
        flash_attention(q, k, v, bias=bias, causal=True, **BLOCKS)))(q, k, v, slopes, bias)
    np.testing.assert_allclose(out, ref_out, atol=2e-6)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-6)


def test_bias_with_everything():
    """Bias and ALiBi with GQA, a key mask, segment ids, a window, softcap and dropout."""
    q, k, v = _qkv()
    bias = seeded_normal(7, (H, SQ, SK))
    slopes = jnp.asarray([0.3, 0.2, 0.1, 0.05])
    kwargs = dict(
        mask=jnp.asarray(np.random.default_rng(8).random((B, SK)) < 0.8),
        q_segment_ids=jnp.asarray(np.sort(np.random.default_rng(9).integers(0, 2, (B, SQ)))),
        kv_segment_ids=jnp.asarray(np.sort(np.random.default_rng(10).integers(0, 2, (B, SK)))),
        window=(30, 10), softcap=5.0, dropout_rate=0.2, key=jax.random.key(3),
    )
    got = _values_and_grads(lambda *a, **kw: flash_attention(*a, **BLOCKS, **kw),
                            q, k, v, bias, slopes, **kwargs)
    expected = _values_and_grads(plain_attention, q, k, v, bias, slopes, **kwargs)
    np.testing.assert_allclose(got[0][0], expected[0][0], atol=3e-5, rtol=3e-5)
    np.testing.assert_array_equal(np.isneginf(got[0][1]), np.isneginf(expected[0][1]))
    _assert_grads_close(got[1], expected[1])


def test_against_jax_nn():
    """`jax.nn.dot_product_attention(bias=...)` (BTNH layout, MHA) agrees, with gradients
    of the bias."""
    q, k, v = _qkv(heads=H, kv_heads=H, seq_q=SK)
    bias = seeded_normal(11, (1, H, SK, SK))

    def ours(q, k, v, bias):
        return jnp.sum(jnp.sin(flash_attention(q, k, v, bias=bias, causal=True, **BLOCKS)[0]))

    def theirs(q, k, v, bias):
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # BTNH
        out = jax.nn.dot_product_attention(q, k, v, bias=bias, is_causal=True)
        return jnp.sum(jnp.sin(jnp.swapaxes(out, 1, 2)))

    got = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    expected = jax.jit(jax.value_and_grad(theirs, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5)
    for g, e in zip(got[1], expected[1], strict=True):
        np.testing.assert_allclose(g, e, atol=2e-5 * max(float(np.abs(np.asarray(e)).max()), 1.0))


@pytest.mark.parametrize("bias_dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_bias_dtype_kept(bias_dtype):
    """The bias may have any float dtype; its cotangent comes back in that dtype."""
    q, k, v = _qkv()
    bias = seeded_normal(12, (SQ, SK), bias_dtype)
    grad, ref = jax.jit(lambda b: (
        jax.grad(lambda b: flash_attention(q, k, v, bias=b, **BLOCKS)[0].sum())(b),
        jax.grad(lambda b: plain_attention(q, k, v, bias=b)[0].sum())(b)))(bias)
    assert grad.dtype == bias_dtype and grad.shape == bias.shape
    np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(ref, np.float32),
                               atol=2e-2, rtol=2e-2)


def test_minus_inf_bias_empties_rows():
    """A bias of -inf over a whole row behaves as a mask: out 0, lse -inf, finite zero
    gradients."""
    q, k, v = _qkv()
    bias = np.zeros((SQ, SK), np.float32)
    bias[3] = -np.inf

    @jax.jit
    def values_and_grads(q, k, v, bias):
        return flash_attention(q, k, v, bias=bias, **BLOCKS), jax.grad(
            lambda q, k, v: flash_attention(q, k, v, bias=bias, **BLOCKS)[0].sum(),
            argnums=(0, 1, 2))(q, k, v)

    (out, lse), grads = values_and_grads(q, k, v, bias)
    assert np.all(np.asarray(out)[:, :, 3] == 0) and np.all(np.isneginf(np.asarray(lse)[:, :, 3]))
    assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)
    assert np.all(np.asarray(grads[0])[:, :, 3] == 0)


def test_causal_flash_attention_and_transforms():
    q, k, v = _qkv()
    bias = seeded_normal(13, (B, H, SQ, SK))
    slopes = np.asarray([0.3, 0.2, 0.1, 0.05], np.float32)
    out, _ = causal_flash_attention(q, k, v, bias=bias, alibi_slopes=slopes, **BLOCKS)
    ref, _ = jax.jit(lambda q, k, v, bias: plain_attention(
        q, k, v, bias=bias, alibi_slopes=slopes, causal=True))(q, k, v, bias)
    assert_close(out, ref)
    # vmap over the batch, mapping the bias with it, equals the batched call
    mapped = jax.jit(jax.vmap(
        lambda q, k, v, b: causal_flash_attention(q, k, v, bias=b, alibi_slopes=slopes,
                                                  **BLOCKS)[0]
    ))(q, k, v, bias)
    np.testing.assert_allclose(mapped, out, atol=2e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(bias=jnp.zeros((SQ + 1, SK))), "bias"),
        (dict(bias=jnp.zeros((3, SQ, SK))), "bias"),
        (dict(bias=jnp.zeros((SQ, SK), jnp.int32)), "bias"),
        (dict(alibi_slopes=jnp.zeros((H + 1,))), "alibi_slopes"),
        (dict(alibi_slopes=jnp.zeros((3, H))), "alibi_slopes"),
        (dict(alibi_slopes=jnp.zeros((H,), jnp.int32)), "alibi_slopes"),
    ],
)
@pytest.mark.parametrize("fn", [flash_attention, plain_attention])
def test_errors_name_the_argument(kwargs, match, fn):
    q, k, v = _qkv()
    with pytest.raises((TypeError, ValueError), match=match):
        fn(q, k, v, **kwargs)


@examples(10)
@given(inputs=attention_inputs(bias=None, alibi=None, dtypes=(jnp.float32,), max_seq=64))
def test_property_bias_and_alibi(inputs):
    """Values, lse and gradients (q, k, v, bias, slopes) against `plain_attention` over the
    strategy, with every other feature drawn too."""
    check_attention(flash_attention, inputs)


@pytest.mark.parametrize("argnums", [(0,), (3,), (4,), (0, 4), (1, 2, 3)], ids=str)
def test_gradients_of_some_arguments_only(argnums):
    """A bias or slopes with no tangent (constants) skip their cotangent accumulation in
    the backward kernel: what is asked for is the same as when everything is."""
    q, k, v = _qkv()
    bias = seeded_normal(5, (H, SQ, SK)) * np.float32(0.5)
    slopes = (2.0 ** -np.arange(1.0, H + 1)).astype(np.float32)

    def loss(fn):
        def f(*args):
            out, _ = fn(*args[:3], bias=args[3], alibi_slopes=args[4], causal=True)
            return jnp.sum(out * out)
        return f

    args = (q, k, v, bias, slopes)
    got = jax.jit(jax.grad(loss(flash_attention), argnums=argnums))(*args)
    expected = jax.jit(jax.grad(loss(plain_attention), argnums=argnums))(*args)
    for g, e in zip(got, expected, strict=True):
        scale = max(float(np.max(np.abs(np.asarray(e)))), 1.0)
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4, atol=1e-4 * scale)
