"""Cosine-similarity attention, as in the seed package, normalising each vector."""

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._api.flash import flash_attention
from .._core.checking import checked
from .._core.config import stat_dtype
from .._core.shapes import LAYOUT
from .._core.types import Attended, Key, KeyMask, OptionalReal, Query, Value

# The seed's fixed logit scale for unit-norm queries and keys.
COSINE_SIM_SCALE = 10.0


def _l2norm(x: Array) -> Array:
    """Normalise each vector along the head dim (the seed divided by the whole tensor's norm).

    An all-zero vector (a zero row, zero padding past `q_lengths`/`kv_lengths`) stays zero,
    with a zero gradient: the square root is taken of a guarded sum, so neither branch of
    the `where` differentiates `sqrt` at 0 (`jnp.linalg.norm` gave NaN gradients there).
    """
    stat = stat_dtype(x.dtype)
    xs = x.astype(stat)
    sumsq = jnp.sum(xs * xs, axis=-1, keepdims=True)
    nonzero = sumsq > 0
    inv_norm = jnp.where(nonzero, jax.lax.rsqrt(jnp.where(nonzero, sumsq, 1)), 0)
    return (xs * inv_norm).astype(x.dtype)


@checked(layout=LAYOUT)
def cosine_sim_flash_attention(
    q: Query,
    k: Key,
    v: Value,
    mask: KeyMask | None = None,
    *,
    scale: OptionalReal = COSINE_SIM_SCALE,
    **kwargs: Any,
) -> Attended:
    """`flash_attention` on l2-normalised q and k with a fixed logit `scale`.

    - `scale`: the logit scale applied to the cosine similarities, default 10 (the seed's;
      unit vectors need a scale well above `flash_attention`'s `1/sqrt(dim)` for the
      softmax to be anything but flat). `scale=None` means what it means in
      `flash_attention`: its default, `1/sqrt(dim)`.

    An all-zero query or key vector (zero padding included) normalises to zero, with zero
    gradient. Takes every keyword of `flash_attention`; returns `(out, lse)` (and the max
    scores with `return_max_scores=True`).
    """
    q, k = jnp.asarray(q), jnp.asarray(k)
    return flash_attention(_l2norm(q), _l2norm(k), v, mask, scale=scale, **kwargs)
