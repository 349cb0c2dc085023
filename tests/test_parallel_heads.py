"""The accelerator path of `per_head` (heads mapped with `vmap`, as on a GPU or TPU or
with several devices) gives the CPU loop's results: values, gradients, tangents,
flash-decoding and score terms, forced here on one CPU device."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import seeded_normal, seeded_qkv

import eqx_flash
from eqx_flash._kernels.xla import policy


def _results(q, k, v, **kw):
    """Values, gradients and a tangent, as one compiled program (traced afresh on each
    call, so under the policy in force then)."""
    fn = functools.partial(eqx_flash.flash_attention, **kw)

    def results(q, k, v):
        value = fn(q, k, v)
        grads = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)[0] ** 2), argnums=(0, 1, 2))(
            q, k, v)
        tangent = jax.jvp(lambda q: fn(q, k, v), (q,), (jnp.ones_like(q),))[1]
        return value, grads, tangent

    return jax.jit(results)(q, k, v)


@pytest.mark.parametrize("kind", ["causal_gqa", "decode", "bias_segment_ids"])
def test_vmapped_heads_equal_the_loop(monkeypatch, kind):
    if kind == "decode":  # one query against many keys: split-K reads the cache whole
        q, k, v = seeded_qkv((2, 4, 1, 16), (2, 2, 2048, 16))
        kw = dict(kv_lengths=np.array([2000, 70]))
    elif kind == "causal_gqa":
        q, k, v = seeded_qkv((2, 4, 40, 16), (2, 2, 40, 16))
        kw = dict(causal=True, block_q=16, block_k=16)
    else:
        q, k, v = seeded_qkv((2, 4, 40, 16), (2, 4, 40, 16))
        ids = (np.arange(40) // 13)[None].repeat(2, 0)
        kw = dict(bias=seeded_normal(3, (4, 40, 40)), q_segment_ids=ids,
                  kv_segment_ids=ids, block_q=16, block_k=16)
    looped = _results(q, k, v, **kw)
    monkeypatch.setattr(policy, "heads_in_parallel", lambda machine: True)
    jax.clear_caches()
    parallel = _results(q, k, v, **kw)
    jax.clear_caches()
    for a, b in zip(jax.tree.leaves(looped), jax.tree.leaves(parallel), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)
