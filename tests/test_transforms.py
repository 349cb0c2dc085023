"""flash_attention composes with JAX's and Equinox's transformations."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from helpers import assert_close, qkv

from eqx_flash import flash_attention, plain_attention

KW = dict(causal=True, block_q=8, block_k=8)


def _loss(q, k, v, mask):
    out, lse = flash_attention(q, k, v, mask, **KW)
    return jnp.sum(out**2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))


def test_jit_equals_eager(getkey):
    q, k, v = qkv(getkey(), (2, 20, 8), (2, 20, 8))
    mask = jax.random.bernoulli(getkey(), 0.8, (20,))
    eager = flash_attention(q, k, v, mask, **KW)
    jitted = jax.jit(lambda q, k, v, m: flash_attention(q, k, v, m, **KW))(q, k, v, mask)
    for a, b in zip(eager, jitted, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_vmap_equals_separate_calls(getkey):
    q, k, v = qkv(getkey(), (3, 2, 20, 8), (3, 2, 24, 8))
    mask = jax.random.bernoulli(getkey(), 0.8, (3, 24)).at[:, 0].set(True)
    # Compiled once each (what is checked is vmap's batching, not eager dispatch).
    batched = jax.jit(jax.vmap(lambda q, k, v, m: flash_attention(q, k, v, m, **KW)))(q, k, v, mask)
    single_call = jax.jit(lambda q, k, v, m: flash_attention(q, k, v, m, **KW))
    for i in range(3):
        single = single_call(q[i], k[i], v[i], mask[i])
        for a, b in zip(batched, single, strict=True):
            np.testing.assert_allclose(a[i], b, rtol=1e-5, atol=1e-6)
    # vmap of grad agrees too.
    g = jax.jit(jax.vmap(jax.grad(_loss, argnums=(0, 1, 2))))(q, k, v, mask)
    g0 = jax.jit(jax.grad(_loss, argnums=(0, 1, 2)))(q[0], k[0], v[0], mask[0])
    for a, b in zip(g, g0, strict=True):
        np.testing.assert_allclose(a[0], b, rtol=1e-5, atol=1e-5)


def test_checkpoint_and_scan(getkey):
    q, k, v = qkv(getkey(), (2, 16, 8), (2, 16, 8))
    mask = jnp.ones((16,), bool)
    direct = jax.jit(jax.grad(_loss, argnums=(0, 1, 2)))(q, k, v, mask)
    remat = jax.jit(jax.grad(jax.checkpoint(_loss), argnums=(0, 1, 2)))(q, k, v, mask)
    for a, b in zip(direct, remat, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)

    # Two attention "layers" inside lax.scan, differentiated end to end.
    def layers(q):
        def body(x, _):
            out, _ = flash_attention(x, k, v, mask, **KW)
            return out, None

        return jnp.sum(jax.lax.scan(body, q, None, length=2)[0])

    def layers_ref(q):
        x = q
        for _ in range(2):
            x, _ = plain_attention(x, k, v, mask, causal=True)
        return jnp.sum(x)

    assert_close(jax.jit(jax.grad(layers))(q), jax.jit(jax.grad(layers_ref))(q), kind="grad",
                 scale=2.0,
                 rtol_scale=0.5)


def test_equinox_filter_jit_and_grad(getkey):
    q, k, v = qkv(getkey(), (2, 16, 8), (2, 16, 8))
    params = {"q": q, "k": k, "v": v, "note": "not an array"}

    @eqx.filter_jit
    @eqx.filter_grad
    def grads(params):
        out, _ = flash_attention(params["q"], params["k"], params["v"], **KW)
        return jnp.sum(out)

    g = grads(params)
    ref = jax.jit(jax.grad(lambda q, k, v: jnp.sum(plain_attention(q, k, v, causal=True)[0]),
                           argnums=(0, 1, 2)))(q, k, v)  # (compiled whole, not op by op)
    for name, r in zip("qkv", ref, strict=True):
        assert_close(g[name], r, kind="grad", scale=2.0, rtol_scale=0.5)


def test_masks_get_no_gradient_and_accept_tracers(getkey):
    """Masks and ids may be traced (jit arguments) and are not differentiated."""
    q, k, v = qkv(getkey(), (2, 16, 8), (2, 16, 8))
    ids = jnp.arange(16) // 5

    @jax.jit
    def f(q, ids):
        return jnp.sum(flash_attention(q, k, v, q_segment_ids=ids, kv_segment_ids=ids, **KW)[0])

    g = jax.grad(f)(q, ids)
    r = jax.jit(jax.grad(lambda q: jnp.sum(plain_attention(  # (compiled whole)
        q, k, v, q_segment_ids=ids, kv_segment_ids=ids, causal=True)[0])))(q)
    assert_close(g, r, kind="grad", scale=2.0, rtol_scale=0.5)
