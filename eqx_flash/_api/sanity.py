"""`value_and_grad_difference`: the seed's sanity check, comparing two attention functions."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, DTypeLike, Float

from .._core.checking import checked
from .._core.config import stat_dtype


def split_outputs(result: Any) -> tuple[Array, Array | None]:
    """Attention functions return `out` or `(out, lse, ...)`: `(out, lse or None)`."""
    if isinstance(result, tuple | list):
        return result[0], (result[1] if len(result) > 1 else None)
    return result, None


@checked()
def value_and_grad_difference(
    fn1: Callable[..., Any],
    fn2: Callable[..., Any],
    *,
    seed: int = 42,
    batch: int = 2,
    heads: int = 4,
    q_seq_len: int = 512,
    k_seq_len: int = 768,
    dim: int = 64,
    add_key_mask: bool = True,
    kv_heads: int | None = None,
    dtype: DTypeLike = jnp.float32,
    **attention_keywords: Any,
) -> tuple[Float[Array, ""], tuple[Float[Array, ""], Float[Array, ""], Float[Array, ""]]]:
    """Max absolute difference between two attention functions' outputs and gradients.

    Draws `q (batch, heads, q_seq_len, dim)`, `k`, `v (batch, heads, k_seq_len, dim)` and,
    with `add_key_mask`, a random key-padding mask `(batch, k_seq_len)`; `kv_heads` (default
    `heads`) gives k and v fewer heads, for grouped-query attention. Calls
    `fn(q, k, v, mask, **attention_keywords)` (mask omitted when not drawn) and compares
    the outputs and the gradients of `sum(out)` with respect to q, k and v.

    **Returns:** `(out_diff, (dq_diff, dk_diff, dv_diff))`, each a scalar array.
    """
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (batch, heads, q_seq_len, dim), dtype)
    kv_heads = heads if kv_heads is None else kv_heads
    k = jax.random.normal(keys[1], (batch, kv_heads, k_seq_len, dim), dtype)
    v = jax.random.normal(keys[2], (batch, kv_heads, k_seq_len, dim), dtype)
    mask = jax.random.bernoulli(keys[3], 0.5, (batch, k_seq_len)) if add_key_mask else None

    def call(fn, q, k, v):
        args = (q, k, v) if mask is None else (q, k, v, mask)
        return split_outputs(fn(*args, **attention_keywords))[0]

    def loss_and_out(fn):
        def loss(q, k, v):
            out = call(fn, q, k, v)
            return jnp.sum(out.astype(stat_dtype(out.dtype))), out

        return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)

    grads1, out1 = loss_and_out(fn1)(q, k, v)
    grads2, out2 = loss_and_out(fn2)(q, k, v)

    def diff(a: Array, b: Array) -> Array:
        return jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))

    dq, dk, dv = (diff(a, b) for a, b in zip(grads1, grads2, strict=True))
    return diff(out1, out2), (dq, dk, dv)
