"""Score terms: what is added to `scale * q.k` before the `score_mod` and the soft cap
(a bias, ALiBi), and their cotangents.

The one definition of these terms: the kernels evaluate them block by block (and
accumulate their cotangents there), the reference on the whole grid. Like masks, each
term keeps size-1 axes wherever it broadcasts. The terms are linear in their operands,
so a term's tangent is the same term of the operands' tangents.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._core.operands import Operands, replace
from .masking import block_of


def alibi_distance(q_pos: Array, k_pos: Array, offset: int | None) -> Array:
    """`|i + offset - j|`: the distance ALiBi penalises (bottom-right aligned, as causal),
    broadcast over the positions' shapes. `offset=None`: absolute positions, any int32
    (their difference may pass int32: taken exactly, as unsigned)."""
    if offset is not None:  # indices: small
        return jnp.abs(q_pos + offset - k_pos)
    # Whichever order is non-negative; wrapped past int32, its bits are the unsigned value.
    d = jnp.where(q_pos >= k_pos, q_pos - k_pos, k_pos - q_pos)
    return jax.lax.bitcast_convert_type(d, jnp.dtype(f"uint{jnp.iinfo(d.dtype).bits}"))


def block_indices(
    ops: Operands, q_start: Array | int, k_start: Array | int, q_pos: Array, k_pos: Array,
    block_q: int, block_k: int,
) -> tuple[Array, Array]:
    """One block's query and key indices: the block's own positions `q_pos`, `k_pos`, or
    where the rows and columns sit in a longer sequence (`ops.q_index`, `ops.kv_index`,
    sliced to the block)."""
    if ops.q_index is None or ops.kv_index is None:
        return q_pos, k_pos
    return (block_of(ops.q_index, q_start, k_start, block_q, block_k),
            block_of(ops.kv_index, q_start, k_start, block_q, block_k))


def alibi_positions(
    ops: Operands, q_start: Array | int, k_start: Array | int, q_pos: Array, k_pos: Array,
    offset: int, block_q: int, block_k: int,
) -> tuple[Array, Array, int | None]:
    """`(i, j, offset)` for `alibi_distance` on one block: the given positions
    (`ops.q_positions`, absolute: offset None), else the block's indices
    (`block_indices`) with the call's alignment `offset`."""
    if ops.has_positions:
        return (block_of(ops.q_positions, q_start, k_start, block_q, block_k),
                block_of(ops.kv_positions, q_start, k_start, block_q, block_k), None)
    i, j = block_indices(ops, q_start, k_start, q_pos, k_pos, block_q, block_k)
    return i, j, offset


def additive(
    ops: Operands, q_start: Array | int, k_start: Array | int, q_pos: Array,
    k_pos: Array, offset: int, block_q: int, block_k: int, dtype: jnp.dtype,
) -> Array | None:
    """The term added to one block of logits (None without any)."""
    total = None
    if ops.bias is not None:
        total = block_of(ops.bias, q_start, k_start, block_q, block_k).astype(dtype)
    if ops.alibi_slopes is not None:
        i, j, at = alibi_positions(ops, q_start, k_start, q_pos, k_pos, offset, block_q,
                                   block_k)
        term = -ops.alibi_slopes.astype(dtype) * alibi_distance(i, j, at).astype(dtype)
        total = term if total is None else total + term
    return total


def accumulate(
    grads: Operands, ops: Operands, d_scores_t: Array, q_start: Array, k_start: Array,
    q_pos: Array, k_pos: Array, offset: int,
) -> Operands:
    """Add one block's cotangent of the pre-cap logits into the running cotangents
    `grads` (one head's, in float32/64; a field is None where no cotangent is wanted).
    `d_scores_t` is in the backward kernel's transposed layout, `(bk, g, bq)`, and is
    reduced before anything is transposed: a slope's cotangent never moves the block, a
    bias's only as much of it as the bias has (all of it for a full bias)."""
    d_bias, d_slopes = grads.bias, grads.alibi_slopes
    if ops.bias is not None and d_bias is not None:
        # bias axes (g, q, k) are d_scores_t's axes (1, 2, 0)
        axes = tuple(t for a, t in ((0, 1), (1, 2), (2, 0))
                     if ops.bias.shape[a] == 1 and d_scores_t.shape[t] != 1)
        part = d_scores_t.sum(axis=axes, keepdims=True).transpose(1, 2, 0)
        part = part.astype(d_bias.dtype)
        # One index dtype (under jax_enable_x64 a Python int is int64).
        starts = tuple(jnp.asarray(x, jnp.int32) for x in (
            0, q_start if d_bias.shape[1] != 1 else 0, k_start if d_bias.shape[2] != 1 else 0))
        old = jax.lax.dynamic_slice(d_bias, starts, part.shape)
        d_bias = jax.lax.dynamic_update_slice(d_bias, old + part, starts)
    if ops.alibi_slopes is not None and d_slopes is not None:
        block_k, _, block_q = d_scores_t.shape
        i, j, at = alibi_positions(ops, q_start, k_start, q_pos, k_pos, offset, block_q,
                                   block_k)
        dist_t = jnp.moveaxis(alibi_distance(i, j, at), -1, 0).astype(d_scores_t.dtype)
        part = -(d_scores_t * dist_t).sum(axis=(0, 2)).reshape(-1, 1, 1)  # (g, 1, 1)
        if d_slopes.shape[0] == 1:
            part = part.sum(axis=0, keepdims=True)
        d_slopes = d_slopes + part.astype(d_slopes.dtype)
    return replace(grads, bias=d_bias, alibi_slopes=d_slopes)
