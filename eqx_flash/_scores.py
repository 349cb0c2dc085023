"""Score modifications: additive terms on the logits (a bias, ALiBi), and their gradients.

The one definition of what is added to `scale * q.k` before the soft cap: the kernels
evaluate it block by block (and accumulate its cotangent there), the reference on the
whole grid. Like masks, each term keeps size-1 axes wherever it broadcasts.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array

from ._masking import block_of


class ScoreMods(NamedTuple):
    """Differentiable score terms in the internal layout (see `_shapes`), or None."""

    bias: Array | None = None  # (batch|1, kv_heads|1, groups|1, seq_q|1, seq_k|1)
    slopes: Array | None = None  # ALiBi slopes, (batch|1, kv_heads|1, groups|1, 1, 1)

    @property
    def is_empty(self) -> bool:
        return self.bias is None and self.slopes is None


def alibi_distance(q_pos: Array, k_pos: Array, offset: int) -> Array:
    """`|i + offset - j|`: the distance ALiBi penalises (bottom-right aligned, as causal),
    broadcast over the positions' shapes."""
    return jnp.abs(q_pos + offset - k_pos)


def additive(
    mods: ScoreMods, q_start: Array | int, k_start: Array | int, q_pos: Array,
    k_pos: Array, offset: int, block_q: int, block_k: int, dtype: jnp.dtype,
) -> Array | None:
    """The term added to one block of logits (None without modifications)."""
    total = None
    if mods.bias is not None:
        total = block_of(mods.bias, q_start, k_start, block_q, block_k).astype(dtype)
    if mods.slopes is not None:
        dist = alibi_distance(q_pos, k_pos, offset).astype(dtype)
        term = -mods.slopes.astype(dtype) * dist
        total = term if total is None else total + term
    return total


def accumulate(
    grads: ScoreMods, mods: ScoreMods, d_scores_t: Array, q_start: Array, k_start: Array,
    q_pos: Array, k_pos: Array, offset: int,
) -> ScoreMods:
    """Add one block's cotangent of the pre-cap logits into the running cotangents
    `grads` (shaped as one head's `mods`, in float32/64). `d_scores_t` is in the backward
    kernel's transposed layout, `(bk, g, bq)`, and is reduced before anything is
    transposed: a slope's cotangent never moves the block, a bias's only as much of it as
    the bias has (all of it for a full bias). Positions as `_block.positions` gives them."""
    d_bias, d_slopes = grads
    if mods.bias is not None and d_bias is not None:
        # bias axes (g, q, k) are d_scores_t's axes (1, 2, 0)
        axes = tuple(t for a, t in ((0, 1), (1, 2), (2, 0))
                     if mods.bias.shape[a] == 1 and d_scores_t.shape[t] != 1)
        part = d_scores_t.sum(axis=axes, keepdims=True).transpose(1, 2, 0)
        part = part.astype(d_bias.dtype)
        starts = (0, q_start if d_bias.shape[1] != 1 else 0, k_start if d_bias.shape[2] != 1 else 0)
        old = jax.lax.dynamic_slice(d_bias, starts, part.shape)
        d_bias = jax.lax.dynamic_update_slice(d_bias, old + part, starts)
    if mods.slopes is not None and d_slopes is not None:
        dist = alibi_distance(q_pos.reshape(1, 1, -1), k_pos.reshape(-1, 1, 1), offset)
        part = -(d_scores_t * dist.astype(d_scores_t.dtype)).sum(axis=(0, 2))  # (g,)
        part = part.reshape(-1, 1, 1)
        if d_slopes.shape[0] == 1:
            part = part.sum(axis=0, keepdims=True)
        d_slopes = d_slopes + part.astype(d_slopes.dtype)
    return ScoreMods(d_bias, d_slopes)
