"""cosine_sim_flash_attention: zero vectors (rows, padding) and the meaning of `scale`."""

import jax
import jax.numpy as jnp
import numpy as np
from helpers import assert_close

import eqx_flash

B, H, S, D = 2, 2, 8, 16


def _qkv():
    kq, kk, kv = jax.random.split(jax.random.key(3), 3)
    return (jax.random.normal(kq, (B, H, S, D)), jax.random.normal(kk, (B, H, S, D)),
            jax.random.normal(kv, (B, H, S, D)))


def _normalised(x):
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def _loss(q, k, v, **kwargs):
    out, _ = eqx_flash.cosine_sim_flash_attention(q, k, v, **kwargs)
    return jnp.sum(out * jnp.cos(jnp.arange(out.size, dtype=out.dtype).reshape(out.shape)))


def test_zero_rows_give_finite_zero_gradients():
    q, k, v = _qkv()
    q = q.at[0, 1, 3].set(0.0)
    k = k.at[1, 0, 5].set(0.0)
    gq, gk, gv = jax.grad(_loss, argnums=(0, 1, 2))(q, k, v)
    for g in (gq, gk, gv):
        assert bool(jnp.all(jnp.isfinite(g)))
    np.testing.assert_array_equal(np.asarray(gq[0, 1, 3]), 0.0)
    np.testing.assert_array_equal(np.asarray(gk[1, 0, 5]), 0.0)


def test_zero_padding_past_lengths_gives_finite_gradients():
    q, k, v = _qkv()
    q_lengths, kv_lengths = jnp.array([5, 8]), jnp.array([8, 3])
    rows = jnp.arange(S)[None, :]
    q = jnp.where((rows < q_lengths[:, None])[:, None, :, None], q, 0.0)
    k = jnp.where((rows < kv_lengths[:, None])[:, None, :, None], k, 0.0)
    grads = jax.grad(_loss, argnums=(0, 1, 2))(q, k, v, q_lengths=q_lengths,
                                               kv_lengths=kv_lengths)
    for g in grads:
        assert bool(jnp.all(jnp.isfinite(g)))


def test_values_unchanged_on_nonzero_rows():
    q, k, v = _qkv()
    out, lse = eqx_flash.cosine_sim_flash_attention(q, k, v)
    ref_out, ref_lse = eqx_flash.plain_attention(_normalised(q), _normalised(k), v, scale=10.0)
    assert_close(out, ref_out)
    assert_close(lse, ref_lse, kind="lse")


def test_zero_query_row_attends_uniformly():
    q, k, v = _qkv()
    q = q.at[0, 0, 2].set(0.0)
    out, _ = eqx_flash.cosine_sim_flash_attention(q, k, v)
    assert_close(out[0, 0, 2], jnp.mean(v[0, 0], axis=0))


def test_scale_default_is_ten_and_none_is_flash_attentions_default():
    q, k, v = _qkv()
    default, _ = eqx_flash.cosine_sim_flash_attention(q, k, v)
    ten, _ = eqx_flash.cosine_sim_flash_attention(q, k, v, scale=10.0)
    np.testing.assert_array_equal(np.asarray(default), np.asarray(ten))
    assert "default 10" in (eqx_flash.cosine_sim_flash_attention.__doc__ or "")
    none, _ = eqx_flash.cosine_sim_flash_attention(q, k, v, scale=None)
    ref, _ = eqx_flash.plain_attention(_normalised(q), _normalised(k), v, scale=1 / np.sqrt(D))
    assert_close(none, ref)
    assert not np.allclose(np.asarray(none), np.asarray(default))
