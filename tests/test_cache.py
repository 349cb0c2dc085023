"""`KVCache`, `FlashMultiheadAttention.decode` and `rotary`: decoding token by token with
a cache gives exactly the rows of attention over the whole sequence."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close

from eqx_flash import ALiBi, FlashMultiheadAttention, KVCache, RelativePositionBias, rotary


def _rope(q, k, v, positions):
    rot = jax.vmap(lambda x: rotary(x, positions), in_axes=1, out_axes=1)
    return rot(q), rot(k), v


def _full(mha, x, window_model=False):
    """Reference: the whole sequence at once, rotary at positions 0.. (Equinox style)."""
    def heads(q, k, v):
        return _rope(q, k, v, jnp.arange(x.shape[0], dtype=jnp.int32))

    return mha(x, x, x, process_heads=heads)


@pytest.mark.parametrize("window", [None, 4])
def test_prefill_then_steps_equal_full_attention(getkey, window):
    layer_window = None if window is None else (window - 1, 0)
    mha = FlashMultiheadAttention(4, 16, num_kv_heads=2, causal=True, window=layer_window,
                                  key=getkey())
    # On the host: each step's slice of a device array compiled a program of its own.
    x = np.asarray(jax.random.normal(getkey(), (11, 16)))
    expected = eqx.filter_jit(_full)(mha, x)  # one program, not one per op
    cache = mha.init_cache(16, window=window)
    decode = eqx.filter_jit(lambda m, x, c: m.decode(x, c, process_heads=_rope))
    out, cache = decode(mha, x[:5], cache)  # prefill (longer than a rolling buffer)
    outs = [out]
    for t in range(5, 11):
        out, cache = decode(mha, x[t : t + 1], cache)
        outs.append(out)
    assert int(cache.length) == 11
    assert_close(np.concatenate(outs), expected)


@pytest.mark.parametrize("window", [None, 4])
def test_decode_with_score_and_mask_mods(getkey, window):
    """A layer's score_mod and mask_mod see absolute positions in `decode`, so prefill and
    steps give the rows of the full-sequence call (which ALiBi and a relative-position
    bias need, and a prefix-LM mask: the prompt's tokens see each other both ways)."""
    layer_window = None if window is None else (window - 1, 0)
    prefix = 3

    def prefix_lm(b, h, q_idx, kv_idx):  # the prompt sees itself both ways
        return (kv_idx <= q_idx) | (kv_idx < prefix)

    mha = FlashMultiheadAttention(
        4, 16, num_kv_heads=2, window=layer_window, key=getkey(),
        score_mod=RelativePositionBias(4, key=getkey()) if window else ALiBi(4),
        mask_mod=prefix_lm,
    )
    x = np.asarray(jax.random.normal(getkey(), (10, 16)))  # (see above)
    expected = eqx.filter_jit(lambda m, x: m(x, x, x))(mha, x)
    cache = mha.init_cache(12, window=window)
    decode = eqx.filter_jit(lambda m, x, c: m.decode(x, c))
    out, cache = decode(mha, x[:prefix], cache)
    outs = [out]
    for t in range(prefix, 10):
        out, cache = decode(mha, x[t : t + 1], cache)
        outs.append(out)
    assert_close(np.concatenate(outs), expected)


def test_decode_scan_and_vmap(getkey):
    """The cache is a scan carry and a vmap argument: a batch of prompts of different
    lengths, stepped inside one `lax.scan`."""
    mha = FlashMultiheadAttention(4, 16, causal=True, key=getkey())
    x = jax.random.normal(getkey(), (2, 9, 16))
    caches = eqx.filter_vmap(lambda _: mha.init_cache(12), axis_size=2)(jnp.arange(2))

    def run(cache, xs):
        def step(c, x_t):
            out, c = mha.decode(x_t[None], c, process_heads=_rope)
            return c, out[0]

        return jax.lax.scan(step, cache, xs)

    caches, outs = jax.jit(jax.vmap(run))(caches, x)
    full = eqx.filter_jit(_full)  # one program, not one per op
    for b in range(2):
        assert_close(outs[b], full(mha, x[b]))
    np.testing.assert_array_equal(np.asarray(caches.length), [9, 9])


def test_cache_append_and_positions():
    cache = KVCache.empty(2, 6, 3, 5)
    assert cache.v.shape == (2, 6, 5) and int(cache.length) == 0
    k = jnp.arange(2 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 3)
    v = jnp.ones((2, 4, 5))
    cache = cache.append(k, v)
    np.testing.assert_array_equal(np.asarray(cache.k[:, :4]), np.asarray(k))
    np.testing.assert_array_equal(np.asarray(cache.positions()), [0, 1, 2, 3, -1, -1])
    rolling = KVCache.empty(2, 100, 3, 5, window=3).append(k, v)
    assert rolling.size == 3
    # positions 1, 2, 3 survive in slots 1, 2, 0
    np.testing.assert_array_equal(np.asarray(rolling.positions()), [3, 1, 2])
    np.testing.assert_array_equal(np.asarray(rolling.k[:, 0]), np.asarray(k[:, 3]))
    with pytest.raises(Exception, match="cache is full"):
        jax.block_until_ready(jax.jit(lambda c: c.append(k, v))(cache).length)
    with pytest.raises(ValueError, match=r"cache is full.*length=4, n=4, max_len=6"):
        cache.append(k, v)  # a concrete length: raised eagerly, with the numbers
    with pytest.raises(ValueError, match="k_new, v_new must have shapes"):
        cache.append(k[:1], v[:1])
    with pytest.raises(ValueError, match="max_len must be a positive int"):
        KVCache.empty(2, 0, 3)


def test_decode_errors(getkey):
    mha = FlashMultiheadAttention(4, 16, num_kv_heads=2, causal=True, key=getkey())
    with pytest.raises(ValueError, match="cache must have"):
        mha.decode(jnp.ones((1, 16)), KVCache.empty(4, 8, 4))
    with pytest.raises(ValueError, match="rolling cache of 4 entries"):
        mha.decode(jnp.ones((1, 16)), mha.init_cache(8, window=4))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rotary_matches_equinox_at_offset_zero(dtype):
    x = jax.random.normal(jax.random.key(0), (7, 8)).astype(dtype)
    expected = eqx.nn.RotaryPositionalEmbedding(8)(x.astype(jnp.float32)).astype(dtype)
    got = rotary(x, jnp.arange(7, dtype=jnp.int32))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32),
                               rtol=1e-6, atol=1e-6)
    # absolute positions: rows 3.. of a longer sequence
    np.testing.assert_allclose(np.asarray(rotary(x[3:], jnp.arange(3, 7, dtype=jnp.int32)),
                                          np.float32),
                               np.asarray(got[3:], np.float32), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="even last axis"):
        rotary(jnp.ones((3, 5)), jnp.arange(3))


def _decode_all(mha, x, cache):
    decode = eqx.filter_jit(lambda m, x, c: m.decode(x, c, process_heads=_rope))
    out, cache = decode(mha, x[:5], cache)
    outs = [out]
    for t in range(5, x.shape[0]):
        out, cache = decode(mha, x[t : t + 1], cache)
        outs.append(out)
    return np.concatenate(outs), cache


@pytest.mark.parametrize("window", [None, 4])
def test_bfloat16_cache_matches_float32_cache(getkey, window):
    """init_cache(dtype=bfloat16) under a float32 layer: the new keys and values are
    written in bfloat16 and attention runs in it; the result is the float32 cache's within
    bfloat16 tolerance, in the layer's dtype."""
    layer_window = None if window is None else (window - 1, 0)
    mha = FlashMultiheadAttention(4, 16, num_kv_heads=2, causal=True, window=layer_window,
                                  key=getkey())
    x = np.asarray(jax.random.normal(getkey(), (9, 16)))  # (sliced on the host)
    expected, _ = _decode_all(mha, x, mha.init_cache(16, window=window))
    out, cache = _decode_all(mha, x, mha.init_cache(16, window=window, dtype=jnp.bfloat16))
    assert cache.k.dtype == cache.v.dtype == jnp.bfloat16
    assert out.dtype == jnp.float32
    assert int(cache.length) == 9
    assert_close(out, expected, dtype=jnp.bfloat16)


@pytest.mark.parametrize("window", [None, 4])
def test_never_written_slots_reach_nothing(getkey, window):
    """Buffers full of NaN before any write (an uninitialised or donated buffer): decode
    gives the clean cache's finite outputs, in rolling mode too (its empty slots are
    masked by position, and their values zeroed before attending)."""
    layer_window = None if window is None else (window - 1, 0)
    mha = FlashMultiheadAttention(4, 16, num_kv_heads=2, causal=True, window=layer_window,
                                  key=getkey())
    x = np.asarray(jax.random.normal(getkey(), (7, 16)))  # (sliced on the host)
    clean = mha.init_cache(16, window=window)
    dirty = eqx.tree_at(lambda c: (c.k, c.v), clean,
                        (jnp.full_like(clean.k, jnp.nan), jnp.full_like(clean.v, jnp.nan)))
    decode = eqx.filter_jit(lambda m, x, c: m.decode(x, c, process_heads=_rope))
    for n in (1, 2):  # a first step with fewer tokens than the buffer holds, then prefill
        expected, _ = decode(mha, x[:n], clean)
        out, _ = decode(mha, x[:n], dirty)
        assert np.all(np.isfinite(np.asarray(out)))
        assert_close(out, expected)
    expected, _ = _decode_all(mha, x, clean)
    out, _ = _decode_all(mha, x, dirty)
    assert np.all(np.isfinite(out))
    assert_close(out, expected)
