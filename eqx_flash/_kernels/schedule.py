"""The block plan: which block pairs a kernel visits, in which order, and which of them
need their masks — static from the band, narrowed at run time. Shared by the kernel
families: the xla loops walk it (`xla.loops.over_band`), a grid kernel would prefetch
its tables (`BlockPlan.visits`).

Causal and window masks are known at trace time, so the pairs they empty are never
computed (forward or backward), and pairs they leave whole need no positional mask:
`block_plan` flags every block pair `EMPTY`, `PARTIAL` (needs its mask) or `FULL` (the
encoding of `make_block_mask` and of splash attention's `block_mask`), by the one
statement of the window (`_semantics.masking.window_overlap`). The non-empty key blocks
of a query block form one contiguous range (the mask is a band), and the whole ones a
contiguous sub-range of it: `Bands` are those runs, the loops' form of the plan. Segment
ids, positions and lengths narrow each band at run time (`run_limits`).
"""

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._core.config import KernelConfig
from .._core.operands import Operands
from .._core.options import Window
from .._core.shapes import ceil_div
from .._mods.block_mask import EMPTY, FULL, PARTIAL
from .._semantics.masking import length_window, lengths_or, window_overlap


def static_flags(
    seq_q: int, seq_k: int, block_q: int, block_k: int, window: Window, offset: int
) -> np.ndarray:
    """`int8[num_q_blocks, num_k_blocks]`: `EMPTY`, `PARTIAL` or `FULL` per block pair,
    for query rows at aligned positions `i + offset` (see `KernelConfig`) against
    `seq_k` keys (a block holding key padding is never whole)."""
    num_q, num_k = ceil_div(seq_q, block_q), ceil_div(seq_k, block_k)
    qb, kb = np.meshgrid(np.arange(num_q), np.arange(num_k), indexing="ij")
    # Aligned positions p of the first and last real query row of each block.
    p_first = qb * block_q + offset
    p_last = np.minimum(qb * block_q + block_q, seq_q) - 1 + offset
    k_first = kb * block_k
    k_last = np.minimum(kb * block_k + block_k, seq_k) - 1
    no_padding = kb * block_k + block_k <= seq_k
    some, every = window_overlap(p_first, p_last, k_first, k_last, window,
                                 np.ones_like(no_padding), no_padding)
    return np.where(some & every, FULL, np.where(some, PARTIAL, EMPTY)).astype(np.int8)


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


class Visits(NamedTuple):
    """Per outer block, the inner blocks to visit in order — the whole ones, then those
    that need their masks, as the loops visit them — as tables a grid can prefetch.
    `int32[n_outer, width]`/`int8[n_outer, width]`; past `lengths`, `order` repeats the
    last visited block (or 0) and `flags` is `EMPTY`."""

    order: np.ndarray
    flags: np.ndarray
    lengths: np.ndarray  # int32[n_outer]: how many inner blocks each visits


class BlockPlan(NamedTuple):
    """The static plan of one kernel call: `flags[query block, key block]`
    (`static_flags`)."""

    flags: np.ndarray

    def oriented(self, by: str) -> np.ndarray:
        """The flags as `[n_outer, n_inner]` for a loop over query (`by="q"`) or key
        (`by="k"`) blocks."""
        return self.flags.T if by == "k" else self.flags

    def bands(self, by: str) -> Bands:
        """The plan as runs per outer block (`Bands`), checked to be runs."""
        flags = self.oriented(by)
        nonempty, full = flags != EMPTY, flags == FULL
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

    def visits(self, by: str) -> Visits:
        """The plan as visit tables (`Visits`), in the order of `bands`' loops: the
        whole run, then the partial blocks before it, then those after it."""
        bands = self.bands(by)
        rows = []
        for lo, full_lo, full_hi, hi in zip(*bands.runs, strict=True):
            rows.append([*range(full_lo, full_hi), *range(lo, full_lo), *range(full_hi, hi)])
        lengths = np.array([len(r) for r in rows], np.int32)
        width = max(int(lengths.max(initial=0)), 1)
        order = np.zeros((len(rows), width), np.int32)
        flags = np.full((len(rows), width), EMPTY, np.int8)
        oriented = self.oriented(by)
        for o, row in enumerate(rows):
            order[o, : len(row)] = row
            order[o, len(row):] = row[-1] if row else 0
            flags[o, : len(row)] = oriented[o, row]
        return Visits(order, flags, lengths)


def block_plan(cfg: KernelConfig) -> BlockPlan:
    """The static plan of `cfg`: its band (`band_window`, aligned at `offset`) and key
    padding, blocked as `cfg` is."""
    return BlockPlan(static_flags(cfg.seq_q, cfg.seq_k, cfg.block_q, cfg.block_k,
                                  cfg.band_window, cfg.offset))


def band_ranges(cfg: KernelConfig, by: str) -> Bands:
    """Key-block ranges per query block (`by="q"`) or query-block ranges per key block
    (`by="k"`) of the static plan of `cfg` (`block_plan`)."""
    return block_plan(cfg).bands(by)


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
    real = q_real[:, None] & k_real[None, :]
    pairs, full = window_overlap(q_lo[:, None], q_hi[:, None], k_lo[None, :], k_hi[None, :],
                                 window, real, real)
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
    aligned on them, `_semantics.masking.length_mask`) let attend; None without lengths.
    Exact at block granularity: key blocks wholly past `kv_len` and query blocks wholly
    past `q_len` are never visited, so a padded batch costs its real lengths. `ops` are
    one head's (`xla.heads.Head`), lengths `(1, 1, 1)`."""
    if not ops.has_lengths:
        return None
    q_len, kv_len = (jnp.asarray(x, jnp.int32).reshape(())
                     for x in lengths_or(ops, cfg.seq_q, cfg.seq_k))
    offset = kv_len - q_len  # query i sits at p = i + offset
    q_first = jnp.arange(ceil_div(cfg.seq_q, cfg.block_q), dtype=jnp.int32) * cfg.block_q
    k_first = jnp.arange(ceil_div(cfg.seq_k, cfg.block_k), dtype=jnp.int32) * cfg.block_k
    q_last = jnp.minimum(q_first + cfg.block_q, q_len) - 1
    k_last = jnp.minimum(k_first + cfg.block_k, kv_len) - 1
    real = (q_first < q_len)[:, None] & (k_first < kv_len)[None, :]
    pairs, _ = window_overlap((q_first + offset)[:, None], (q_last + offset)[:, None],
                              k_first[None, :], k_last[None, :],
                              length_window(ops, cfg.window), real, real)
    return _interval(pairs.T if by == "k" else pairs)


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
