"""Per-block pieces shared by the forward and backward kernels: the loop over heads,
slicing, logits, masks, and the loop over one band of blocks.

The kernels run one kv head at a time (`per_head`): q `(groups, seq_q, dim)` against k, v
`(seq_k, dim)`. Every block product is then a plain 2-d matmul, the form XLA's CPU GEMM
runs fastest (batched products of the same size measured 2-3x slower per FLOP).
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ._config import KernelConfig, stat_dtype
from ._masking import Masks, data_mask, dropout_keep, positional_mask
from ._schedule import Bands


class Head(NamedTuple):
    """What one kv head's kernel sees besides its q, k, v slices."""

    masks: Masks  # each `(groups|1, seq_q|1, seq_k|1)`
    heads: Array  # flat q-head index of each group, `(groups, 1, 1)` (for dropout)


def per_head(
    fn: Callable[[Head, tuple[Array, ...]], Any],
    masks: Masks,
    arrays: tuple[Array, ...],
) -> Any:
    """Map `fn(head, per_head_arrays)` over the `(batch, kv_heads)` axes of `arrays`
    (all have them first); results are stacked back on those axes.

    On one device, a `lax.map` loop: 2-d block matmuls, the fastest form on CPU. With
    several devices the batch or heads axis may be sharded, and a loop over a sharded axis
    would make XLA gather it onto every device; there `vmap` keeps the axes parallel so
    the SPMD partitioner can split them.
    """
    if jax.device_count() > 1:
        return _vmapped_per_head(fn, masks, arrays)
    batch, kv_heads = arrays[0].shape[:2]
    groups = arrays[0].shape[2] if arrays[0].ndim == 5 else 1
    flat = tuple(x.reshape(batch * kv_heads, *x.shape[2:]) for x in arrays)

    def one(args):
        n, xs = args
        b, h = n // kv_heads, n % kv_heads

        def take(m):
            if m is None:
                return None
            m = m[b] if m.shape[0] != 1 else m[0]
            return m[h] if m.shape[0] != 1 else m[0]

        head = Head(
            Masks(*(take(m) for m in masks)),
            (n * groups + jnp.arange(groups, dtype=jnp.int32)).reshape(groups, 1, 1),
        )
        return fn(head, xs)

    out = jax.lax.map(one, (jnp.arange(batch * kv_heads, dtype=jnp.int32), flat))
    return jax.tree.map(lambda y: y.reshape(batch, kv_heads, *y.shape[1:]), out)


def _vmapped_per_head(
    fn: Callable[[Head, tuple[Array, ...]], Any], masks: Masks, arrays: tuple[Array, ...]
) -> Any:
    batch, kv_heads = arrays[0].shape[:2]
    groups = arrays[0].shape[2] if arrays[0].ndim == 5 else 1

    def split(masks: Masks) -> tuple[Masks, Masks]:
        """Masks with a size-1 leading axis are shared: squeeze it, don't map over it."""
        mapped = Masks(*(None if m is None or m.shape[0] == 1 else m for m in masks))
        shared = Masks(*(m[0] if m is not None and m.shape[0] == 1 else None for m in masks))
        return mapped, shared

    def merge(mapped: Masks, shared: Masks) -> Masks:
        return Masks(*(a if a is not None else b for a, b in zip(mapped, shared, strict=True)))

    def one_head(b, h, xs, masks_h):
        n = b * kv_heads + h
        heads = (n * groups + jnp.arange(groups, dtype=jnp.int32)).reshape(groups, 1, 1)
        return fn(Head(masks_h, heads), xs)

    def one_batch(b, xs, masks_b):
        mapped, shared = split(masks_b)
        return jax.vmap(
            lambda h, xs, m: one_head(b, h, xs, merge(m, shared)), in_axes=(0, 0, 0)
        )(jnp.arange(kv_heads, dtype=jnp.int32), xs, mapped)

    mapped, shared = split(masks)
    return jax.vmap(lambda b, xs, m: one_batch(b, xs, merge(m, shared)), in_axes=(0, 0, 0))(
        jnp.arange(batch, dtype=jnp.int32), arrays, mapped
    )


def rows(x: Array, start: Array, size: int, axis: int) -> Array:
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def logits(cfg: KernelConfig, q_blk: Array, k_blk: Array) -> tuple[Array, Array | None]:
    """Logits `(groups, block_q, block_k)` in the statistics dtype, from queries passed
    through `scaled` (so the scale is applied once, wherever `scaled` put it).

    Returns `(s, tanh)`: the capped logits and, with a softcap, the tanh the backward
    pass needs for the cap's derivative.
    """
    stat = stat_dtype(q_blk.dtype)
    return _scale_and_cap(cfg, matmul(q_blk, k_blk, "qd,kd->qk", stat), q_blk.dtype)


def logits_t(cfg: KernelConfig, k_blk: Array, q_cols: Array) -> tuple[Array, Array | None]:
    """`logits` transposed, `(block_k, groups * block_q)`, from a key block `(block_k, d)`
    and the transposed query block `(d, groups * block_q)`."""
    stat = stat_dtype(q_cols.dtype)
    s = jnp.matmul(k_blk, q_cols, preferred_element_type=stat)
    return _scale_and_cap(cfg, s, q_cols.dtype)


def _scale_and_cap(cfg: KernelConfig, s: Array, dtype: jnp.dtype) -> tuple[Array, Array | None]:
    stat = s.dtype
    if not folds_scale(dtype):
        s = s * jnp.asarray(cfg.scale, stat)
    if cfg.softcap is None:
        return s, None
    cap = jnp.asarray(cfg.softcap, stat)
    t = jnp.tanh(s * (1.0 / cap))
    return cap * t, t


def matmul(a: Array, b: Array, spec: str, dtype: jnp.dtype) -> Array:
    """One block product with the query groups folded into the rows: `a` is
    `(groups, block_q, x)` and `b` 2-d. A dot contracting over both groups and queries
    (`"qk,qd->kd"`) would make XLA copy a transposed block; one 2-d dot does not."""
    groups, rows_ = a.shape[:2]
    out = jnp.einsum(spec, a.reshape(groups * rows_, a.shape[2]), b,
                     preferred_element_type=dtype)
    if spec.endswith("->kd"):
        return out
    return out.reshape(groups, rows_, out.shape[-1])


def folds_scale(dtype: jnp.dtype) -> bool:
    """Whether the scale is folded into q (one pass over q instead of one per logit).

    Only for float32/float64: in bfloat16/float16, `q * scale` would round every query
    and shift the lse by up to one low-precision step, so those scale the float32 logits.
    """
    return jnp.dtype(dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64))


def scaled(cfg: KernelConfig, q: Array) -> Array:
    """q ready for `logits`: multiplied by the scale where `folds_scale` says so."""
    return q * jnp.asarray(cfg.scale, q.dtype) if folds_scale(q.dtype) else q


def positions(cfg: KernelConfig, q_start: Array, k_start: Array) -> tuple[Array, Array]:
    """Query and key positions of one block, shaped to broadcast against `(g, q, k)`."""
    q_pos = q_start + jnp.arange(cfg.block_q, dtype=jnp.int32).reshape(1, -1, 1)
    k_pos = k_start + jnp.arange(cfg.block_k, dtype=jnp.int32).reshape(1, 1, -1)
    return q_pos, k_pos


def allowed(
    cfg: KernelConfig, masks: Masks, q_start: Array, k_start: Array, positional: bool
) -> Array | None:
    """Which pairs of the block attend, `(groups|1, block_q|1, block_k)` (None: all)."""
    mask = data_mask(masks, q_start, k_start, cfg.block_q, cfg.block_k)
    if positional:
        q_pos, k_pos = positions(cfg, q_start, k_start)
        pos = positional_mask(q_pos, k_pos, cfg.offset, cfg.seq_k, cfg.window)
        mask = pos if mask is None else mask & pos
    return mask


def allowed_t(
    cfg: KernelConfig, masks: Masks, q_start: Array, k_start: Array, positional: bool,
    groups: int,
) -> Array | None:
    """`allowed` for the transposed logits: `(block_k|1, groups * block_q|1)`."""
    mask = allowed(cfg, masks, q_start, k_start, positional)
    return None if mask is None else _transpose_block(mask, groups, cfg.block_q)


def _transpose_block(x: Array, groups: int, block_q: int) -> Array:
    """`(groups|1, block_q|1, block_k|1)` -> `(block_k|1, groups * block_q|1)`: the
    layout of the transposed logits, broadcasting where the block did."""
    x = jnp.moveaxis(x, -1, 0)  # (block_k|1, groups|1, block_q|1)
    if x.shape[1:] == (1, 1):
        return x.reshape(x.shape[0], 1)
    x = jnp.broadcast_to(x, (x.shape[0], groups, block_q))
    return x.reshape(x.shape[0], groups * block_q)


def dropout_multiplier(
    cfg: KernelConfig, seed: Array | None, head: Head, q_start: Array, k_start: Array,
    dtype: jnp.dtype,
) -> Array | None:
    """`keep / (1 - rate)` for one block (None without dropout)."""
    if seed is None or cfg.dropout_rate == 0.0:
        return None
    q_pos, k_pos = positions(cfg, q_start, k_start)
    keep = dropout_keep(seed, head.heads, q_pos, k_pos, cfg.dropout_rate)
    return jnp.where(keep, jnp.asarray(1.0 / (1.0 - cfg.dropout_rate), dtype),
                     jnp.asarray(0.0, dtype))


def dropout_multiplier_t(
    cfg: KernelConfig, seed: Array | None, head: Head, q_start: Array, k_start: Array,
    dtype: jnp.dtype,
) -> Array | None:
    """`dropout_multiplier` for the transposed logits, `(block_k, groups * block_q)`."""
    drop = dropout_multiplier(cfg, seed, head, q_start, k_start, dtype)
    groups = head.heads.shape[0]
    return None if drop is None else _transpose_block(drop, groups, cfg.block_q)


def skip_if_empty(mask: Array | None, has_data_mask: bool, compute, keep, operands):
    """Run `compute` unless the data masks empty the block (then `keep`).

    Causal and window emptiness is handled statically by the schedule; this catches
    blocks emptied by padding masks and segment ids at run time.
    """
    if mask is None or not has_data_mask:
        return compute(operands)
    return jax.lax.cond(jnp.any(mask), compute, keep, operands)


def segment_limits(cfg: KernelConfig, masks: Masks, by: str) -> tuple[Array, Array] | None:
    """Per outer block, the inner blocks `[lo, hi)` that segment ids can let attend
    (None without segment ids): a run-time refinement of the static band.

    A query block can only share an id with a key block if their id ranges overlap, so
    with sorted ids (packed documents) each block visits just the blocks of its own
    documents, and work grows with document sizes rather than with seq². The test is
    necessary, not sufficient (unsorted ids give a superset); the mask decides exactly.
    """
    qs, ks = masks.q_segment_ids, masks.kv_segment_ids
    if qs is None or ks is None or qs.shape[-2] == 1 or ks.shape[-1] == 1:
        return None

    def block_ranges(ids: Array, seq: int, block: int) -> tuple[Array, Array]:
        """(min, max) id of each block, `(num_blocks,)`, ignoring padded positions."""
        ids = jnp.moveaxis(ids.reshape(ids.shape[0], -1), 1, 0)  # (seq_pad, groups|1)
        real = (jnp.arange(ids.shape[0]) < seq)[:, None]
        info = jnp.iinfo(ids.dtype)
        lo = jnp.where(real, ids, info.max).reshape(-1, block * ids.shape[1]).min(axis=1)
        hi = jnp.where(real, ids, info.min).reshape(-1, block * ids.shape[1]).max(axis=1)
        return lo, hi

    q_lo, q_hi = block_ranges(qs, cfg.seq_q, cfg.block_q)
    k_lo, k_hi = block_ranges(ks, cfg.seq_k, cfg.block_k)
    overlap = (k_lo[None, :] <= q_hi[:, None]) & (k_hi[None, :] >= q_lo[:, None])
    if by == "k":
        overlap = overlap.T
    n_inner = overlap.shape[1]
    any_ = overlap.any(axis=1)
    lo = jnp.where(any_, jnp.argmax(overlap, axis=1), 0).astype(jnp.int32)
    hi = jnp.where(any_, n_inner - jnp.argmax(overlap[:, ::-1], axis=1), 0).astype(jnp.int32)
    return lo, hi


def over_band(
    bands: Bands, outer: Array, step: Callable[[Any, Array, bool], Any], carry: Any,
    limits: tuple[Array, Array] | None = None,
) -> Any:
    """Fold `step(carry, inner_block, positional)` over the inner blocks of one outer
    block: first the whole ones (no positional mask), then the partial ones at either end
    of the band; all clipped to `limits` (`segment_limits`) if given. Trip counts are
    dynamic, so every outer block shares one compiled loop."""
    # The band's three runs: partial [lo, full_lo), whole [full_lo, full_hi), partial
    # [full_hi, hi). Clipping every end into [seg_lo, seg_hi] intersects each run with it.
    ends = [jnp.asarray(x)[outer] for x in bands]
    if limits is not None:
        ends = [jnp.clip(x, limits[0][outer], limits[1][outer]) for x in ends]
    lo, full_lo, full_hi, hi = ends
    if int(np.max(bands.full_hi - bands.full_lo, initial=0)) > 0:
        carry = jax.lax.fori_loop(full_lo, full_hi, lambda j, c: step(c, j, False), carry)
    if bands.max_partial > 0:
        n_left = full_lo - lo

        def partial(t, c):
            return step(c, jnp.where(t < n_left, lo + t, full_hi + t - n_left), True)

        carry = jax.lax.fori_loop(0, n_left + hi - full_hi, partial, carry)
    return carry
