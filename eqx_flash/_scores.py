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
    # Where the rows and columns sit in a longer sequence (ring attention: a shard's global
    # positions), int32 `(1, 1, 1, seq_q, 1)` and `(1, 1, 1, 1, seq_k)`, for ALiBi (aligned
    # by `KernelConfig.alibi_offset`) and the `score_mod`/`mask_mod` indices. Not
    # differentiable. None: the block's own indices.
    q_positions: Array | None = None
    k_positions: Array | None = None

    @property
    def is_empty(self) -> bool:
        return self.bias is None and self.slopes is None


def alibi_distance(q_pos: Array, k_pos: Array, offset: int) -> Array:
    """`|i + offset - j|`: the distance ALiBi penalises (bottom-right aligned, as causal),
    broadcast over the positions' shapes."""
    return jnp.abs(q_pos + offset - k_pos)


def global_positions(
    mods: ScoreMods, q_start: Array | int, k_start: Array | int, block_q: int, block_k: int
) -> tuple[Array, Array]:
    """One block's slices of `mods`' positions, `(1, block_q, 1)` and `(1, 1, block_k)`."""
    assert mods.q_positions is not None and mods.k_positions is not None
    return (block_of(mods.q_positions, q_start, k_start, block_q, block_k),
            block_of(mods.k_positions, q_start, k_start, block_q, block_k))


def _distance(
    mods: ScoreMods, q_start: Array | int, k_start: Array | int, q_pos: Array, k_pos: Array,
    offset: int, block_q: int, block_k: int,
) -> Array:
    """ALiBi's distance over one block, from `mods`' positions where it has them."""
    if mods.q_positions is None or mods.k_positions is None:
        return alibi_distance(q_pos, k_pos, offset)
    q_pos, k_pos = global_positions(mods, q_start, k_start, block_q, block_k)
    return alibi_distance(q_pos, k_pos, offset)


def additive(
    mods: ScoreMods, q_start: Array | int, k_start: Array | int, q_pos: Array,
    k_pos: Array, offset: int, block_q: int, block_k: int, dtype: jnp.dtype,
) -> Array | None:
    """The term added to one block of logits (None without modifications)."""
    total = None
    if mods.bias is not None:
        total = block_of(mods.bias, q_start, k_start, block_q, block_k).astype(dtype)
    if mods.slopes is not None:
        dist = _distance(mods, q_start, k_start, q_pos, k_pos, offset, block_q,
                         block_k).astype(dtype)
        term = -mods.slopes.astype(dtype) * dist
        total = term if total is None else total + term
    return total


def accumulate(
    grads: ScoreMods, mods: ScoreMods, d_scores: Array, q_start: Array, k_start: Array,
    q_pos: Array, k_pos: Array, offset: int,
) -> ScoreMods:
    """Add one block's cotangent of the pre-cap logits, `d_scores` `(g, bq, bk)`, into
    the running cotangents `grads` (shaped as one head's `mods`, in float32/64)."""
    d_bias, d_slopes = grads.bias, grads.slopes
    if mods.bias is not None and d_bias is not None:
        axes = tuple(a for a in range(3) if mods.bias.shape[a] == 1 and d_scores.shape[a] != 1)
        part = d_scores.sum(axis=axes, keepdims=True).astype(d_bias.dtype)
        starts = (0, q_start if d_bias.shape[1] != 1 else 0, k_start if d_bias.shape[2] != 1 else 0)
        old = jax.lax.dynamic_slice(d_bias, starts, part.shape)
        d_bias = jax.lax.dynamic_update_slice(d_bias, old + part, starts)
    if mods.slopes is not None and d_slopes is not None:
        block_q, block_k = d_scores.shape[1:]
        dist = _distance(mods, q_start, k_start, q_pos, k_pos, offset, block_q, block_k)
        part = -(d_scores * dist.astype(d_scores.dtype)).sum(axis=(1, 2), keepdims=True)
        if d_slopes.shape[0] == 1:
            part = part.sum(axis=0, keepdims=True)
        d_slopes = d_slopes + part.astype(d_slopes.dtype)
    return grads._replace(bias=d_bias, slopes=d_slopes)
