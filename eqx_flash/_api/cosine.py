"""Cosine-similarity attention, as in the seed package, normalising each vector."""

from typing import Any

import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, jaxtyped

from .._api.flash import flash_attention
from .._core.config import stat_dtype
from .._core.types import LSE, Key, KeyMask, Output, Query, RealNumber, Value

# The seed's fixed logit scale for unit-norm queries and keys.
COSINE_SIM_SCALE = 10.0


def _l2norm(x: Array, eps: float = 1e-10) -> Array:
    """Normalise each vector along the head dim (the seed divided by the whole tensor's norm)."""
    stat = stat_dtype(x.dtype)
    norm = jnp.linalg.norm(x.astype(stat), axis=-1, keepdims=True)
    return (x.astype(stat) / (norm + eps)).astype(x.dtype)


@jaxtyped(typechecker=beartype)
def cosine_sim_flash_attention(
    q: Query,
    k: Key,
    v: Value,
    mask: KeyMask | None = None,
    *,
    scale: RealNumber = COSINE_SIM_SCALE,
    **kwargs: Any,
) -> tuple[Output, LSE]:
    """`flash_attention` on l2-normalised q and k with a fixed `scale` (default 10).

    Takes every keyword of `flash_attention`; returns `(out, lse)`.
    """
    q, k = jnp.asarray(q), jnp.asarray(k)
    return flash_attention(_l2norm(q), _l2norm(k), v, mask, scale=scale, **kwargs)
