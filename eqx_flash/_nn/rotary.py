"""`rotary`: rotary position embeddings at absolute positions (what a cached decoder
needs, where a new token's position is not its index in the call)."""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def rotary(
    x: Float[Array, "*batch seq dim"], positions: Int[Array, "*#batch seq"] | Int[Array, " seq"],
    theta: float = 10_000.0,
) -> Float[Array, "*batch seq dim"]:
    """Rotary position embedding of `x` at absolute `positions`: with
    `positions = arange(seq)` it equals `eqx.nn.RotaryPositionalEmbedding(dim, theta)(x)`
    (the same half-split rotation), so a cached decoder rotates each new token at its
    true position.

    **Arguments:**

    - `x`: `(*batch, seq, dim)`, `dim` even.
    - `positions`: integer positions `(seq,)` (or broadcasting against `x`'s leading axes).
    - `theta`: the base frequency.

    **Returns:**

    The rotated `x`, in its dtype (computed in float32, float64 for float64).
    """
    dim = x.shape[-1]
    if dim % 2:
        raise ValueError(f"x must have an even last axis for rotary; got x.shape={x.shape}")
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise TypeError(f"positions must be integer; got positions.dtype={positions.dtype}")
    dtype = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    freqs = 1.0 / (theta ** (jnp.arange(0.0, dim, 2, dtype=dtype) / dim))
    freqs = freqs.reshape((1,) * positions.ndim + freqs.shape)
    angle = positions.astype(dtype)[..., None] * freqs  # (..., seq, dim / 2)
    cos = jnp.concatenate([jnp.cos(angle)] * 2, axis=-1)
    sin = jnp.concatenate([jnp.sin(angle)] * 2, axis=-1)
    while cos.ndim < x.ndim:
        cos, sin = cos[None], sin[None]
    half = dim // 2
    xf = x.astype(dtype)
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)
