"""Score modifications: additive terms on the logits (a bias, ALiBi), and their gradients.

The one definition of what is added to `scale * q.k` before the soft cap: the kernels
evaluate it block by block (and accumulate its cotangent there), the reference on the
whole grid. Like masks, each term keeps size-1 axes wherever it broadcasts.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._semantics.masking import block_of


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
    grads: ScoreMods, mods: ScoreMods, d_scores_t: Array, q_start: Array, k_start: Array,
    q_pos: Array, k_pos: Array, offset: int,
) -> ScoreMods:
    """Add one block's cotangent of the pre-cap logits into the running cotangents
    `grads` (shaped as one head's `mods`, in float32/64). `d_scores_t` is in the backward
    kernel's transposed layout, `(bk, g, bq)`, and is reduced before anything is
    transposed: a slope's cotangent never moves the block, a bias's only as much of it as
    the bias has (all of it for a full bias). Positions as `_block.positions` gives them."""
    d_bias, d_slopes = grads.bias, grads.slopes
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
        block_k, _, block_q = d_scores_t.shape
        dist = _distance(mods, q_start, k_start, q_pos, k_pos, offset, block_q, block_k)
        dist_t = jnp.moveaxis(dist, -1, 0).astype(d_scores_t.dtype)  # (bk, 1, bq)
        part = -(d_scores_t * dist_t).sum(axis=(0, 2)).reshape(-1, 1, 1)  # (g, 1, 1)
        if d_slopes.shape[0] == 1:
            part = part.sum(axis=0, keepdims=True)
        d_slopes = d_slopes + part.astype(d_slopes.dtype)
    return grads._replace(bias=d_bias, slopes=d_slopes)
