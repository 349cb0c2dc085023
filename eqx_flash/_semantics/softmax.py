"""Softmax statistics: the online update over key blocks, the finish, and merging partial
results.

The one definition of "a row that attended nothing gets out = 0 and lse = -inf", shared by
the kernels, the reference and the ring.
"""

from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array

from .._core.config import stat_dtype


class Running(NamedTuple):
    """Online-softmax state of a block of query rows: `acc = sum_j exp(s_j - row_max) v_j`
    and `row_sum = sum_j exp(s_j - row_max)` over the keys seen so far."""

    acc: Array  # (..., rows, dim_v)
    row_max: Array  # (..., rows)
    row_sum: Array  # (..., rows)


def start(like: Array, acc_shape: tuple[int, ...], dtype: jnp.dtype) -> Running:
    """The state before any key. `*_like(like)`: under shard_map the state must vary
    across devices as the inputs do.

    The running max starts at a finite floor: a row that sees no key keeps it, and
    `exp(-inf - floor) = 0`, `exp(floor - floor) = 1`, so no -inf guard is needed.
    """
    floor = jnp.asarray(jnp.finfo(dtype).min, dtype)
    return Running(
        jnp.zeros_like(like, dtype, shape=acc_shape),
        jnp.full_like(like, floor, dtype, shape=acc_shape[:-1]),
        jnp.zeros_like(like, dtype, shape=acc_shape[:-1]),
    )


def rescale(state: Running, s: Array) -> tuple[Array, Array, Array, Array]:
    """Take in logits `s` `(..., rows, keys)` (masked entries -inf): returns `p`
    (the block's weights against the new max), the factor `alpha` that rescales the
    old accumulators, and the new `row_max` and `row_sum`."""
    new_max = jnp.maximum(state.row_max, s.max(axis=-1))
    p = jnp.exp(s - new_max[..., None])
    alpha = jnp.exp(state.row_max - new_max)
    return p, alpha, new_max, alpha * state.row_sum + p.sum(axis=-1)


def finish(acc: Array, row_max: Array, row_sum: Array) -> tuple[Array, Array]:
    """`(out, lse)` from unnormalised accumulators: `out = acc / row_sum`,
    `lse = row_max + log(row_sum)`; a row with `row_sum == 0` gets 0 and -inf.

    A non-finite value that a row attends propagates: a NaN or infinite score makes
    `row_sum` NaN (so lse and out are NaN), and a non-finite value makes the whole output
    row NaN (`acc` non-finite in any column), whatever the block sizes. Rows that attend
    nothing are never NaN (`row_sum` is exactly 0 there)."""
    attended = row_sum != 0  # NaN compares unequal: a NaN row is "attended" and stays NaN
    safe_sum = jnp.where(attended, row_sum, 1.0)
    out = jnp.where(attended[..., None], acc / safe_sum[..., None], 0.0)
    reached_nonfinite = ~jnp.all(jnp.isfinite(out), axis=-1, keepdims=True)
    out = jnp.where(reached_nonfinite, jnp.asarray(jnp.nan, out.dtype), out)
    lse = jnp.where(attended, row_max + jnp.log(safe_sum), -jnp.inf)
    return out, lse


def max_score(row_max: Array, row_sum: Array) -> Array:
    """The largest final score a row attended (QK-clip's statistic): the online max,
    -inf for a row that attended nothing (whose max stayed at `start`'s floor)."""
    return jnp.where(row_sum == 0, -jnp.inf, row_max)


def poison(acc: Array, reaches_nonfinite: Array | None) -> Array:
    """`acc` with the rows that attend a non-finite value (`tile.attended_values`) set to
    NaN, which `finish` keeps."""
    if reaches_nonfinite is None:
        return acc
    return jnp.where(reaches_nonfinite[..., None], jnp.asarray(jnp.nan, acc.dtype), acc)


def _shifted(lse: Array, other: Array) -> tuple[Array, Array, Array]:
    """`(shift, exp(lse - shift), exp(other - shift))` with `shift` the larger lse, or 0
    where both are -inf (so no `-inf - -inf` is formed)."""
    top = jnp.maximum(lse, other)
    shift = jnp.where(top == -jnp.inf, 0.0, top)
    return shift, jnp.exp(lse - shift), jnp.exp(other - shift)


def merge(out: Array, lse: Array, part_out: Array, part_lse: Array) -> tuple[Array, Array]:
    """Combine two normalised partial results over disjoint key sets by their lse."""
    shift, w_old, w_new = _shifted(lse, part_lse)
    acc = out * w_old[..., None] + part_out.astype(out.dtype) * w_new[..., None]
    return finish(acc, shift, w_old + w_new)


def with_sink(out: Array, lse: Array, sink: Array | None) -> tuple[Array, Array]:
    """`(out, lse)` of attention whose softmax denominator also holds `exp(sink)`: the
    result merged with a part `(out = 0, lse = sink)`, so `out * exp(lse - lse')` and
    `lse' = log(exp(lse) + exp(sink))`. A row that attended nothing gets 0 and `sink`.
    `sink` broadcasts against `lse`; `None`: no sink."""
    if sink is None:
        return out, lse
    # `merge` with a part whose out is 0, spelt out: one product on `out` instead of
    # `merge`'s accumulate-and-finish (about 6% of a fwd+bwd at seq 4096 saved).
    shift, w_out, w_sink = _shifted(lse, sink.astype(lse.dtype))
    total = w_out + w_sink
    empty = total == 0  # nothing attended and a -inf sink: 0 and -inf, finite gradients
    safe = jnp.where(empty, 1.0, total)
    weight = jnp.where(empty, 0.0, w_out / safe)
    merged_lse = jnp.where(empty, -jnp.inf, shift + jnp.log(safe))
    return (out.astype(weight.dtype) * weight[..., None]).astype(out.dtype), merged_lse


def finite_lse(lse: Array) -> Array:
    """lse with -inf (rows that attended nothing) replaced by 0: any finite shift gives
    `exp(masked logit - lse) = 0` there, where -inf would give NaN."""
    return jnp.where(lse == -jnp.inf, 0.0, lse)


def backward_statistics(out: Array, lse: Array, d_out: Array, d_lse: Array
                        ) -> tuple[Array, Array]:
    """`(lse, delta)` for a backward kernel (`_kernels.contract`): lse with -inf made
    finite (`finite_lse`), and `delta = rowsum(dO * O) - d_lse` in the statistics dtype.
    (d lse / d s is the softmax, so an lse cotangent just shifts the softmax-backward
    delta.)"""
    stat = stat_dtype(out.dtype)
    delta = jnp.sum(d_out.astype(stat) * out.astype(stat), axis=-1) - d_lse.astype(stat)
    return finite_lse(lse), delta


def merge_all(out: Array, lse: Array, axis: int = 0) -> tuple[Array, Array]:
    """`merge` of any number of partial results over disjoint key sets, stacked on `axis`
    of `out` `(..., rows, dim_v)` and `lse` `(..., rows)` (flash-decoding's reduction)."""
    top = jnp.max(lse, axis=axis)
    shift = jnp.where(top == -jnp.inf, 0.0, top)
    w = jnp.exp(lse - jnp.expand_dims(shift, axis))
    acc = jnp.sum(out * w[..., None], axis=axis)
    return finish(acc, shift, jnp.sum(w, axis=axis))
