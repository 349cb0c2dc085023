"""Score terms: what is added to `scale * q.k` before the `score_mod` and the soft cap
(a bias, ALiBi), and their cotangents.

The one definition of these terms: the kernels evaluate them on the values of one block
(`_core.operands.block`; and reduce their cotangents there), the reference on the whole
grid. Like masks, each term keeps size-1 axes wherever it broadcasts. The terms are
linear in their operands, so a term's tangent is the same term of the operands'
tangents.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._core.operands import Operands


def alibi_distance(q_pos: Array, k_pos: Array, offset: int | None) -> Array:
    """`|i + offset - j|`: the distance ALiBi penalises (bottom-right aligned, as causal),
    broadcast over the positions' shapes. `offset=None`: absolute positions, any int32
    (their difference may pass int32: taken exactly, as unsigned)."""
    if offset is not None:  # indices: small
        return jnp.abs(q_pos + offset - k_pos)
    # Whichever order is non-negative; wrapped past int32, its bits are the unsigned value.
    d = jnp.where(q_pos >= k_pos, q_pos - k_pos, k_pos - q_pos)
    return jax.lax.bitcast_convert_type(d, jnp.dtype(f"uint{jnp.iinfo(d.dtype).bits}"))


def block_indices(blk: Operands, q_pos: Array, k_pos: Array) -> tuple[Array, Array]:
    """One block's query and key indices: the block's own positions `q_pos`, `k_pos`, or
    where the rows and columns sit in a longer sequence (`blk.q_index`, `blk.kv_index`,
    the block's values)."""
    if blk.q_index is None or blk.kv_index is None:
        return q_pos, k_pos
    return blk.q_index, blk.kv_index


def alibi_positions(blk: Operands, q_pos: Array, k_pos: Array, offset: int
                    ) -> tuple[Array, Array, int | None]:
    """`(i, j, offset)` for `alibi_distance` on one block: the given positions
    (`blk.q_positions`, absolute: offset None), else the block's indices
    (`block_indices`) with the call's alignment `offset`."""
    if blk.has_positions:
        return blk.q_positions, blk.kv_positions, None
    i, j = block_indices(blk, q_pos, k_pos)
    return i, j, offset


def additive(blk: Operands, q_pos: Array, k_pos: Array, offset: int, dtype: jnp.dtype
             ) -> Array | None:
    """The term added to one block of logits (None without any), from the block's
    operand values `blk` and its indices `q_pos`, `k_pos` (`offset`: ALiBi's
    alignment)."""
    total = None
    if blk.bias is not None:
        total = blk.bias.astype(dtype)
    if blk.alibi_slopes is not None:
        i, j, at = alibi_positions(blk, q_pos, k_pos, offset)
        term = -blk.alibi_slopes.astype(dtype) * alibi_distance(i, j, at).astype(dtype)
        total = term if total is None else total + term
    return total


def cotangents(blk: Operands, wanted: Operands, d_scores_t: Array, q_pos: Array,
               k_pos: Array, offset: int) -> Operands:
    """One block's share of the score terms' cotangents, from the cotangent `d_scores_t`
    of its pre-cap logits in the backward kernel's transposed layout `(bk, g, bq)`: the
    bias's, shaped as its block of `blk.bias` (summed where the bias broadcasts), and the
    slopes', `(g|1, 1, 1)`; for the fields set in `wanted`, None elsewhere (add them up
    with `_core.operands.add_block`). Each is reduced before anything is transposed: a
    slope's cotangent never moves the block, a bias's only as much of it as the bias has
    (all of it for a full bias)."""
    d_bias = d_slopes = None
    if blk.bias is not None and wanted.bias is not None:
        # bias axes (g, q, k) are d_scores_t's axes (1, 2, 0)
        axes = tuple(t for a, t in ((0, 1), (1, 2), (2, 0))
                     if blk.bias.shape[a] == 1 and d_scores_t.shape[t] != 1)
        d_bias = d_scores_t.sum(axis=axes, keepdims=True).transpose(1, 2, 0)
    if blk.alibi_slopes is not None and wanted.alibi_slopes is not None:
        i, j, at = alibi_positions(blk, q_pos, k_pos, offset)
        dist_t = jnp.moveaxis(alibi_distance(i, j, at), -1, 0).astype(d_scores_t.dtype)
        d_slopes = -(d_scores_t * dist_t).sum(axis=(0, 2)).reshape(-1, 1, 1)  # (g, 1, 1)
        if blk.alibi_slopes.shape[0] == 1:
            d_slopes = d_slopes.sum(axis=0, keepdims=True)
    return Operands(bias=d_bias, alibi_slopes=d_slopes)
