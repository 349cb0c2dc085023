"""Which block pairs a kernel visits, and the loop that visits them.

Causal and window masks are known at trace time, so the pairs they empty are never
computed (forward or backward), and pairs they leave whole need no positional mask.
The non-empty key blocks of a query block form one contiguous range (the mask is a band),
and the whole ones a contiguous sub-range of it; `band_ranges` gives both per block.
Segment ids, positions and lengths narrow each band at run time (`run_limits`);
`over_band` folds a step over what remains.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._core.compat import varying_axes
from .._core.config import KernelConfig
from .._core.operands import Operands
from .._core.options import Window
from .._mods.block_mask import EMPTY, FULL
from .._semantics.masking import length_window, lengths_or, shifted


class Schedule(NamedTuple):
    """(query block, key block) index pairs, `int32[n, 2]` each."""

    partial: np.ndarray  # some pairs in the block are masked by position or key padding
    full: np.ndarray  # every pair in the block attends positionally


def _pair_flags(
    seq_q: int, seq_k: int, block_q: int, block_k: int, window: Window, offset: int
) -> tuple[np.ndarray, np.ndarray]:
    """`(nonempty, full)`, bool `[num_q_blocks, num_k_blocks]`."""
    num_q = -(-seq_q // block_q)
    num_k = -(-seq_k // block_k)
    qb, kb = np.meshgrid(np.arange(num_q), np.arange(num_k), indexing="ij")
    # Aligned positions p of the first and last real query row of each block.
    p_first = qb * block_q + offset
    p_last = np.minimum(qb * block_q + block_q, seq_q) - 1 + offset
    k_first = kb * block_k
    k_last = np.minimum(kb * block_k + block_k, seq_k) - 1
    nonempty = np.ones_like(qb, dtype=bool)
    full = kb * block_k + block_k <= seq_k  # no key padding in the block
    if window.left is not None:
        nonempty &= k_last >= p_first - window.left
        full &= k_first >= p_last - window.left
    if window.right is not None:
        nonempty &= k_first <= p_last + window.right
        full &= k_last <= p_first + window.right
    return nonempty, full & nonempty


def block_schedule(
    seq_q: int, seq_k: int, block_q: int, block_k: int, window: Window, offset: int
) -> Schedule:
    """Pairs for query rows at aligned positions `i + offset` (see `KernelConfig`)."""
    nonempty, full = _pair_flags(seq_q, seq_k, block_q, block_k, window, offset)
    qb, kb = np.nonzero(nonempty)
    pairs = np.stack([qb, kb], axis=1).astype(np.int32)
    is_full = full[qb, kb]
    return Schedule(partial=pairs[~is_full], full=pairs[is_full])


class Bands(NamedTuple):
    """Per outer block `o`: inner blocks `[lo, hi)` are non-empty, `[full_lo, full_hi)`
    of them need no positional mask (`lo <= full_lo <= full_hi <= hi`). `int32[n_outer]`."""

    lo: np.ndarray
    full_lo: np.ndarray
    full_hi: np.ndarray
    hi: np.ndarray
    inner: int  # how many inner blocks there are

    @property
    def runs(self) -> tuple[np.ndarray, ...]:
        return self.lo, self.full_lo, self.full_hi, self.hi

    @property
    def max_partial(self) -> int:
        return int(np.max(self.full_lo - self.lo + self.hi - self.full_hi, initial=0))


def _bands(nonempty: np.ndarray, full: np.ndarray) -> Bands:
    n_outer, n_inner = nonempty.shape
    idx = np.arange(n_inner)
    lo = np.where(nonempty.any(1), np.argmax(nonempty, 1), 0)
    hi = np.where(nonempty.any(1), n_inner - np.argmax(nonempty[:, ::-1], 1), 0)
    full_lo = np.where(full.any(1), np.argmax(full, 1), hi)
    full_hi = np.where(full.any(1), n_inner - np.argmax(full[:, ::-1], 1), hi)
    # A band mask makes both sets intervals; check, since the kernels rely on it.
    assert np.array_equal(nonempty, (idx >= lo[:, None]) & (idx < hi[:, None]))
    assert np.array_equal(full, (idx >= full_lo[:, None]) & (idx < full_hi[:, None]))
    return Bands(*(x.astype(np.int32) for x in (lo, full_lo, full_hi, hi)), inner=n_inner)


def band_ranges(cfg: KernelConfig, by: str) -> Bands:
    """Key-block ranges per query block (`by="q"`) or query-block ranges per key block
    (`by="k"`) of the static band of `cfg`."""
    nonempty, full = _pair_flags(cfg.seq_q, cfg.seq_k, cfg.block_q, cfg.block_k,
                                 cfg.band_window, cfg.offset)
    if by == "k":
        nonempty, full = nonempty.T, full.T
    return _bands(nonempty, full)


def _block_ranges(ids: Array, seq: int, block: int) -> tuple[Array, Array, Array]:
    """`(min, max, real)` of one head's per-position integers `ids` (segment ids or
    positions, `(groups|1, seq_pad, 1)` or `(groups|1, 1, seq_pad)`) over each block,
    `(num_blocks,)`, ignoring padded positions; `real`: the block has a real position."""
    ids = jnp.moveaxis(ids.reshape(ids.shape[0], -1), 1, 0)  # (seq_pad, groups|1)
    real = (jnp.arange(ids.shape[0]) < seq)[:, None]
    info = jnp.iinfo(ids.dtype)
    lo = jnp.where(real, ids, info.max).reshape(-1, block * ids.shape[1]).min(axis=1)
    hi = jnp.where(real, ids, info.min).reshape(-1, block * ids.shape[1]).max(axis=1)
    return lo, hi, real.reshape(-1, block).any(axis=1)


def segment_limits(cfg: KernelConfig, ops: Operands, by: str) -> tuple[Array, Array] | None:
    """Per outer block, the inner blocks `[lo, hi)` that segment ids can let attend
    (None without segment ids): a run-time refinement of the static band.

    A query block can only share an id with a key block if their id ranges overlap, so
    with sorted ids (packed documents) each block visits just the blocks of its own
    documents, and work grows with document sizes rather than with seq². The test is
    necessary, not sufficient (unsorted ids give a superset); the mask decides exactly.
    """
    qs, ks = ops.q_segment_ids, ops.kv_segment_ids
    if qs is None or ks is None or qs.shape[-2] == 1 or ks.shape[-1] == 1:
        return None
    q_lo, q_hi, _ = _block_ranges(qs, cfg.seq_q, cfg.block_q)
    k_lo, k_hi, _ = _block_ranges(ks, cfg.seq_k, cfg.block_k)
    overlap = (k_lo[None, :] <= q_hi[:, None]) & (k_hi[None, :] >= q_lo[:, None])
    return _interval(overlap.T if by == "k" else overlap)


def position_limits(cfg: KernelConfig, ops: Operands, by: str
                    ) -> tuple[Array, Array, Array, Array] | None:
    """Per outer block, the inner blocks `[lo, hi)` whose positions the window (causal:
    `right=0`) can let attend, and the run `[full_lo, full_hi)` of them it lets attend
    whole (None without positions or a window). A key block whose positions all lie
    outside `[min q - left, max q + right]` of a query block is never visited, and one
    inside `[max q - left, min q + right]` skips the mask, so causal attention on
    positions does the work of `causal=True`. As for segment ids, the visiting test is
    necessary and the mask (`position_mask`) decides exactly; the whole run is exact."""
    window = cfg.window
    if not ops.has_positions or window.is_unbounded:
        return None
    q_lo, q_hi, q_real = _block_ranges(ops.q_positions, cfg.seq_q, cfg.block_q)
    k_lo, k_hi, k_real = _block_ranges(ops.kv_positions, cfg.seq_k, cfg.block_k)
    pairs = q_real[:, None] & k_real[None, :]
    full = pairs
    # (`shifted`: the reach saturates at the int32 ends instead of wrapping round.)
    if window.left is not None:  # some key at or after the first query's reach
        pairs &= k_hi[None, :] >= shifted(q_lo, -window.left)[:, None]
        full &= k_lo[None, :] >= shifted(q_hi, -window.left)[:, None]
    if window.right is not None:
        pairs &= k_lo[None, :] <= shifted(q_hi, window.right)[:, None]
        full &= k_hi[None, :] <= shifted(q_lo, window.right)[:, None]
    if by == "k":
        pairs, full = pairs.T, full.T
    lo, hi = _interval(pairs)
    full_lo, full_hi = _interval(full)
    # Only a run of whole blocks can skip the mask (unsorted positions may leave gaps).
    run = jnp.sum(full, axis=1, dtype=jnp.int32) == full_hi - full_lo
    return lo, hi, jnp.where(run, full_lo, lo), jnp.where(run, full_hi, lo)


def _interval(pairs: Array) -> tuple[Array, Array]:
    """Per row of `pairs` (bool `[n_outer, n_inner]`), the smallest `[lo, hi)` holding all
    its True entries (`[0, 0)` for none)."""
    n_inner = pairs.shape[1]
    any_ = pairs.any(axis=1)
    lo = jnp.where(any_, jnp.argmax(pairs, axis=1), 0).astype(jnp.int32)
    hi = jnp.where(any_, n_inner - jnp.argmax(pairs[:, ::-1], axis=1), 0).astype(jnp.int32)
    return lo, hi


def oriented_flags(ops: Operands, by: str) -> Array | None:
    """One head's `block_mask` flags (`ops.block_flags`, `(1, num_q, num_k)`) as
    `[n_outer, n_inner]` for a loop `by` query (`"q"`) or key (`"k"`) blocks; None
    without one."""
    flags = ops.block_flags
    if flags is None:
        return None
    flags = flags.reshape(flags.shape[-2:])
    return flags.T if by == "k" else flags


def length_limits(cfg: KernelConfig, ops: Operands, by: str) -> tuple[Array, Array] | None:
    """Per outer block, the inner blocks `[lo, hi)` that the valid lengths (and the window
    aligned on them, `_semantics.masking.length_mask`) let attend; None without lengths. Exact at
    block granularity: key blocks wholly past `kv_len` and query blocks wholly past `q_len`
    are never visited, so a padded batch costs its real lengths. `ops` are one head's
    (`heads.Head`), lengths `(1, 1, 1)`."""
    if not ops.has_lengths:
        return None
    q_len, kv_len = (jnp.asarray(x, jnp.int32).reshape(())
                     for x in lengths_or(ops, cfg.seq_q, cfg.seq_k))
    window = length_window(ops, cfg.window)
    left, right = window.left, window.right
    offset = kv_len - q_len
    bq, bk = cfg.block_q, cfg.block_k
    if by == "q":
        n_outer, outer_block, outer_len, inner_block = -(-cfg.seq_q // bq), bq, q_len, bk
    else:
        n_outer, outer_block, outer_len, inner_block = -(-cfg.seq_k // bk), bk, kv_len, bq
    first = jnp.arange(n_outer, dtype=jnp.int32) * outer_block
    last = jnp.minimum(first + outer_block, outer_len) - 1
    # (`shifted`: a window side past int32 saturates instead of wrapping round.)
    if by == "q":  # keys j with p - left <= j <= p + right, p = i + offset, j < kv_len
        start = (jnp.zeros_like(first) if left is None
                 else jnp.maximum(shifted(first + offset, -left), 0))
        stop = (kv_len if right is None
                else jnp.minimum(kv_len, shifted(last + offset + 1, right)))
    else:  # queries i with j - right <= i + offset <= j + left, i < q_len
        start = (jnp.zeros_like(first) if right is None
                 else jnp.maximum(shifted(first - offset, -right), 0))
        stop = q_len if left is None else jnp.minimum(q_len, shifted(last - offset + 1, left))
    stop = jnp.broadcast_to(stop, first.shape)
    empty = (first >= outer_len) | (stop <= start)
    lo = jnp.where(empty, 0, start // inner_block)
    hi = jnp.where(empty, 0, -(-stop // inner_block))
    return lo.astype(jnp.int32), hi.astype(jnp.int32)


class Limits(NamedTuple):
    """The run-time narrowing of the static band (`run_limits`)."""

    lo: Array  # per outer block, the inner blocks [lo, hi) that may attend
    hi: Array
    # A `block_mask`'s flags, `[n_outer, n_inner]` int8 (`oriented_flags`), or None.
    flags: Array | None = None
    # With positions and a window (`position_limits`): per outer block, the run
    # [full_lo, full_hi) that attends whole by position (the rest needs the mask).
    full_lo: Array | None = None
    full_hi: Array | None = None


def run_limits(cfg: KernelConfig, ops: Operands, by: str) -> Limits | None:
    """`segment_limits`, `position_limits` and `length_limits` intersected, with the
    `block_mask`'s flags and the run that is whole by position (None when none
    applies)."""
    by_position = position_limits(cfg, ops, by)
    found = [x for x in (segment_limits(cfg, ops, by),
                         None if by_position is None else by_position[:2],
                         length_limits(cfg, ops, by)) if x is not None]
    flags = oriented_flags(ops, by)
    if not found:
        if flags is None:
            return None
        n_outer, n_inner = flags.shape
        found = [(jnp.zeros(n_outer, jnp.int32), jnp.full(n_outer, n_inner, jnp.int32))]
    lo, hi = found[0]
    for other_lo, other_hi in found[1:]:
        lo, hi = jnp.maximum(lo, other_lo), jnp.minimum(hi, other_hi)
    full = (None, None) if by_position is None else by_position[2:]
    return Limits(lo, jnp.maximum(hi, lo), flags, *full)


def _whole_run(full_lo: Array, full_hi: Array, limits: Limits | None, outer: Array
               ) -> tuple[Array, Array]:
    """The static whole run `[full_lo, full_hi)` of one outer block intersected with the
    run that is whole by position (`Limits.full_lo`), if any."""
    if limits is None or limits.full_lo is None or limits.full_hi is None:
        return full_lo, full_hi
    new_lo = jnp.clip(limits.full_lo[outer], full_lo, full_hi)
    return new_lo, jnp.clip(limits.full_hi[outer], new_lo, full_hi)


def over_band(
    bands: Bands, outer: Array, step: Callable[[Any, Array, bool], Any], carry: Any,
    limits: Limits | None = None,
) -> Any:
    """Fold `step(carry, inner_block, masked)` over the inner blocks of one outer block:
    first the whole ones (`masked=False`: no positional mask, no `mask_mod`), then those
    that need their masks; all clipped to `limits` (`run_limits`) if given. Trip counts
    are dynamic, so every outer block shares one compiled loop. A single inner block is
    visited through a switch instead (`_only_block`)."""
    if limits is not None and limits.flags is not None:
        return _over_listed(bands, outer, step, carry, limits, limits.flags)
    # The band's three runs: partial [lo, full_lo), whole [full_lo, full_hi), partial
    # [full_hi, hi). Clipping every end into [seg_lo, seg_hi] intersects each run with it.
    ends = [jnp.asarray(x)[outer] for x in bands.runs]
    if limits is not None:
        ends = [jnp.clip(x, limits.lo[outer], limits.hi[outer]) for x in ends]
    lo, full_lo, full_hi, hi = ends
    full_lo, full_hi = _whole_run(full_lo, full_hi, limits, outer)
    by_position = limits is not None and limits.full_lo is not None
    if bands.inner == 1:
        return _only_block(step, carry, full_hi > full_lo, hi > lo)
    if int(np.max(bands.full_hi - bands.full_lo, initial=0)) > 0:
        carry = jax.lax.fori_loop(full_lo, full_hi, lambda j, c: step(c, j, False), carry)
    if bands.max_partial > 0 or by_position:
        n_left = full_lo - lo

        def partial(t, c):
            return step(c, jnp.where(t < n_left, lo + t, full_hi + t - n_left), True)

        carry = jax.lax.fori_loop(0, n_left + hi - full_hi, partial, carry)
    return carry


def _over_listed(
    bands: Bands, outer: Array, step: Callable[[Any, Array, bool], Any], carry: Any,
    limits: Limits, flags: Array,
) -> Any:
    """`over_band` with a `block_mask`: its blocks need not form runs, so the outer
    block's inner blocks are listed, whole ones (full by position and by the flags)
    first, then the rest of the non-empty ones, as FlexAttention's `full_kv_indices`
    and `kv_indices`. Two branch-free loops over the list: a per-block `lax.cond` on
    the flag would move the accumulators in and out of a separate computation."""
    lo, full_lo, full_hi, hi = (jnp.asarray(x)[outer] for x in bands.runs)
    full_lo, full_hi = _whole_run(full_lo, full_hi, limits, outer)
    lo, hi = jnp.maximum(lo, limits.lo[outer]), jnp.minimum(hi, limits.hi[outer])
    inner = jnp.arange(flags.shape[1], dtype=jnp.int32)
    flag = flags[outer]
    inside = (inner >= lo) & (inner < hi) & (flag != EMPTY)
    whole = inside & (inner >= full_lo) & (inner < full_hi) & (flag == FULL)
    if bands.inner == 1:
        return _only_block(step, carry, whole[0], inside[0])
    rank = jnp.where(whole, 0, jnp.where(inside, 1, 2)).astype(jnp.int32)
    order = jnp.argsort(rank, stable=True).astype(jnp.int32)
    n_whole = jnp.sum(whole, dtype=jnp.int32)
    n_inside = jnp.sum(inside, dtype=jnp.int32)
    carry = jax.lax.fori_loop(0, n_whole, lambda t, c: step(c, order[t], False), carry)
    return jax.lax.fori_loop(n_whole, n_inside, lambda t, c: step(c, order[t], True), carry)


def _only_block(step: Callable[[Any, Array, bool], Any], carry: Any, whole: Array,
                inside: Array) -> Any:
    """The one inner block (0) of an outer block when there is only one: `step` once,
    unmasked if `whole`, masked if only `inside`, else not at all, as a switch. In a loop
    the block's slices do not depend on the (then folded) index, and XLA's loop-invariant
    code motion hoists the whole tile out of the loop, computing it even where the loop
    runs no step, once per loop: a backward with one query block against 8 key blocks, 2
    of them within a causal window on positions, took 29.6 ms in loops, 6.5 ms so.

    Under `shard_map(check_vma=True)` the flags vary over the mesh when run-time
    operands (segment ids, positions) give them, and batching a switch on a varying
    index (the heads' `vmap`) evaluates its branches on operands cast to vary, against
    a jaxpr traced with them invariant ("mul requires varying manual axes to match").
    A batched switch computes its branches and selects anyway: there the block is
    visited masked (exact on a whole block too) and kept where it is inside."""
    zero = jnp.zeros((), jnp.int32)
    if varying_axes(inside) | varying_axes(whole):
        new = step(carry, zero, True)
        return jax.tree.map(lambda n, c: jnp.where(inside, n, c), new, carry)
    which = jnp.where(whole, 1, jnp.where(inside, 2, 0))
    return jax.lax.switch(which, [lambda c: c, lambda c: step(c, zero, False),
                                  lambda c: step(c, zero, True)], carry)
