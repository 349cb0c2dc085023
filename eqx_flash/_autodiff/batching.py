"""A batching rule for the package's primitives: bind once per batch element."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive


def batch_by_map(primitive: Primitive) -> Callable[..., Any]:
    """A batching rule that binds `primitive` once per batch element (`lax.map`), so it
    (and its transpose into the hand-written kernels) survives `vmap`: without one, a
    gradient of a `vmap` (`jax.grad` of a loss over `jax.vmap(model)`) fails to batch."""

    def rule(args, dims, **params):
        mapped = [d is not None for d in dims]
        xs = [jnp.moveaxis(x, d, 0) for x, d in zip(args, dims, strict=True) if d is not None]

        def one(xs_i):
            it = iter(xs_i)
            full = [next(it) if m else x for x, m in zip(args, mapped, strict=True)]
            return primitive.bind(*full, **params)

        outs = jax.lax.map(one, xs)
        return outs, [0] * len(outs)

    return rule
