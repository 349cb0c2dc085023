"""Dropout on the attention weights: a pure function of (key, leading index, i, j)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import qkv

from eqx_flash import flash_attention, plain_attention


def _weights(fn, q, k, rate, key, **kwargs):
    """The dropped, rescaled attention weights: with v the identity, out = weights."""
    seq_k = k.shape[-2]
    # Built in NumPy (eager jax.numpy compiled a program per op), the call compiled whole.
    eye = np.broadcast_to(np.eye(seq_k, dtype=q.dtype), (*k.shape[:-2], seq_k, seq_k))
    out, _ = jax.jit(lambda q, k, eye, key: fn(q, k, eye, dropout_rate=rate, key=key,
                                               **kwargs))(q, k, eye, key)
    return np.asarray(out)


def test_deterministic_given_key(getkey):
    q, k, v = qkv(getkey(), (2, 3, 40, 16), (2, 3, 40, 16))
    key = jax.random.key(7)
    a, _ = flash_attention(q, k, v, dropout_rate=0.3, key=key)
    b, _ = flash_attention(q, k, v, dropout_rate=0.3, key=jax.random.key(7))
    c, _ = flash_attention(q, k, v, dropout_rate=0.3, key=jax.random.key(8))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
    jitted, _ = jax.jit(lambda q, k, v, key: flash_attention(q, k, v, dropout_rate=0.3, key=key))(
        q, k, v, key
    )
    np.testing.assert_allclose(jitted, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("blocks", [(8, 8), (16, 32), (32, 8), (None, None)])
def test_pattern_independent_of_blocks(getkey, blocks):
    # 40 x 56 is not a multiple of any block size, so padding is exercised too.
    q, k, _ = qkv(getkey(), (2, 4, 40, 16), (2, 2, 56, 16))
    key = jax.random.key(3)
    block_q, block_k = blocks
    flash = _weights(flash_attention, q, k, 0.4, key, block_q=block_q, block_k=block_k)
    plain = _weights(plain_attention, q, k, 0.4, key)
    # The same entries are dropped exactly; the kept ones agree to round-off.
    np.testing.assert_array_equal(flash == 0, plain == 0)
    np.testing.assert_allclose(flash, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"causal": True},
        {"window": (5, 3), "softcap": 3.0},
    ],
)
def test_matches_plain_forward_and_backward(getkey, options):
    # GQA (4 query heads on 2 kv heads), seq_q != seq_k, a key-padding mask.
    q, k, v = qkv(getkey(), (2, 4, 24, 8), (2, 2, 40, 8), dim_v=12)
    mask = np.arange(40)[None, :] < np.array([[40], [31]])
    d_out = jax.random.normal(getkey(), (2, 4, 24, 12))
    key = jax.random.key(11)

    def loss(fn, blocks):
        def f(q, k, v):
            out, lse = fn(q, k, v, mask, dropout_rate=0.25, key=key, **options, **blocks)
            # Include lse so its cotangent path is checked with dropout on.
            return jnp.sum(out * d_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v)

    val_f, grads_f = loss(flash_attention, {"block_q": 8, "block_k": 16})
    val_p, grads_p = loss(plain_attention, {})
    np.testing.assert_allclose(val_f, val_p, rtol=1e-5)
    for gf, gp in zip(grads_f, grads_p, strict=True):
        assert np.all(np.isfinite(gf))
        np.testing.assert_allclose(gf, gp, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_keep_rate(getkey, rate):
    q, k, _ = qkv(getkey(), (4, 128, 16), (4, 128, 16))
    w = _weights(flash_attention, q, k, rate, jax.random.key(5), block_q=32, block_k=64)
    kept = np.asarray(w != 0)
    n = kept.size  # 65536 Bernoulli draws: standard error <= 0.002
    assert abs(kept.mean() - (1 - rate)) < 0.01
    # Every head, row and column keeps about the same fraction (no stripes).
    tol = 5 * np.sqrt(rate * (1 - rate) / 128)
    assert np.all(np.abs(kept.mean(axis=(1, 2)) - (1 - rate)) < 0.01)
    assert np.abs(kept.mean(axis=(0, 2)) - (1 - rate)).max() < tol
    assert np.abs(kept.mean(axis=(0, 1)) - (1 - rate)).max() < tol
    # Neighbouring heads, rows and columns are independent: P(both kept) = (1-rate)^2.
    both = (1 - rate) ** 2
    for pair in (
        kept[1:] & kept[:-1],
        kept[:, 1:] & kept[:, :-1],
        kept[:, :, 1:] & kept[:, :, :-1],
    ):
        assert abs(pair.mean() - both) < 5 * np.sqrt(both * (1 - both) / (n * 3 / 4))


def test_unbiased(getkey):
    # Identical problems along the batch axis get independent patterns; their mean
    # approaches the attention without dropout (inverted scaling 1 / (1 - rate)).
    q, k, v = qkv(getkey(), (1, 2, 16, 8), (1, 2, 16, 8))
    batch = 512
    # The statistics in NumPy (eager jax.numpy compiled a program per op).
    qb, kb, vb = (np.broadcast_to(np.asarray(x), (batch, *x.shape[1:])) for x in (q, k, v))
    dropped, _ = flash_attention(qb, kb, vb, dropout_rate=0.5, key=jax.random.key(2))
    clean, _ = flash_attention(q, k, v)
    dropped, clean = np.asarray(dropped), np.asarray(clean)
    spread = np.std(dropped, axis=0) / np.sqrt(batch)
    assert np.all(np.abs(dropped.mean(axis=0) - clean[0]) < 5 * spread + 1e-6)
    assert not np.allclose(dropped[0], dropped[1])


def test_lse_unaffected(getkey):
    q, k, v = qkv(getkey(), (2, 2, 24, 16), (2, 2, 24, 16))
    mask = np.arange(24) < 20
    _, lse_drop = flash_attention(q, k, v, mask, causal=True, dropout_rate=0.5,
                                  key=jax.random.key(1))
    _, lse = flash_attention(q, k, v, mask, causal=True)
    np.testing.assert_allclose(lse_drop, lse, rtol=1e-6)
    # (The reference compiled whole: eagerly each of its ops was a program.)
    _, lse_plain = jax.jit(lambda q, k, v, key: plain_attention(
        q, k, v, mask, causal=True, dropout_rate=0.5, key=key))(q, k, v, jax.random.key(1))
    np.testing.assert_allclose(lse_plain, lse, rtol=1e-5)


def test_rate_zero_ignores_key(getkey):
    q, k, v = qkv(getkey(), (2, 16, 16), (2, 16, 16))
    a, _ = flash_attention(q, k, v, dropout_rate=0.0, key=jax.random.key(0))
    b, _ = flash_attention(q, k, v)
    np.testing.assert_array_equal(a, b)


def test_legacy_key_accepted(getkey):
    q, k, v = qkv(getkey(), (2, 16, 16), (2, 16, 16))
    a, _ = flash_attention(q, k, v, dropout_rate=0.5, key=jax.random.PRNGKey(4))
    b, _ = flash_attention(q, k, v, dropout_rate=0.5,
                           key=jax.random.wrap_key_data(jax.random.PRNGKey(4)))
    np.testing.assert_array_equal(a, b)


def test_fully_masked_rows_with_dropout(getkey):
    q, k, v = qkv(getkey(), (2, 8, 16), (2, 8, 16))
    attn_mask = np.ones((8, 8), bool)
    attn_mask[3] = False

    def f(q, k, v):
        out, _ = flash_attention(q, k, v, attn_mask=attn_mask, dropout_rate=0.5,
                                 key=jax.random.key(0))
        return out

    out = np.asarray(f(q, k, v))
    assert np.all(out[:, 3] == 0)
    # (The gradients compiled whole: eagerly each op of the backward was a program.)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2)))(q, k, v)
    grads = [np.asarray(g) for g in grads]
    assert all(np.all(np.isfinite(g)) for g in grads)
    assert np.all(grads[0][:, 3] == 0)


@pytest.mark.parametrize("fn", [flash_attention, plain_attention])
@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5, float("nan")])
def test_rate_out_of_range(getkey, fn, rate):
    q, k, v = qkv(getkey(), (2, 8, 16), (2, 8, 16))
    with pytest.raises(ValueError, match="dropout_rate"):
        fn(q, k, v, dropout_rate=rate, key=jax.random.key(0))


@pytest.mark.parametrize("fn", [flash_attention, plain_attention])
def test_rate_without_key(getkey, fn):
    q, k, v = qkv(getkey(), (2, 8, 16), (2, 8, 16))
    with pytest.raises(ValueError, match="key"):
        fn(q, k, v, dropout_rate=0.1)


@pytest.mark.parametrize("fn", [flash_attention, plain_attention])
def test_bad_key(getkey, fn):
    q, k, v = qkv(getkey(), (2, 8, 16), (2, 8, 16))
    with pytest.raises(TypeError, match="key"):
        fn(q, k, v, dropout_rate=0.1, key=3)
    # A batch of keys: rejected by the annotation (TypeError) or, unchecked, by validation.
    with pytest.raises((ValueError, TypeError), match="key"):
        fn(q, k, v, dropout_rate=0.1, key=jax.random.split(jax.random.key(0), 2))


def test_traced_rate_rejected(getkey):
    q, k, v = qkv(getkey(), (2, 8, 16), (2, 8, 16))
    with pytest.raises(TypeError, match="dropout_rate"):
        jax.jit(lambda r: flash_attention(q, k, v, dropout_rate=r, key=jax.random.key(0)))(0.1)
