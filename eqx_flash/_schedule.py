"""Which block pairs a kernel visits, and the loop that visits them.

Causal and window masks are known at trace time, so the pairs they empty are never
computed (forward or backward), and pairs they leave whole need no positional mask.
The non-empty key blocks of a query block form one contiguous range (the mask is a band),
and the whole ones a contiguous sub-range of it; `band_ranges` gives both per block.
Segment ids narrow each band at run time (`segment_limits`); `over_band` folds a step
over what remains.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ._config import KernelConfig
from ._masking import Masks, lengths_or
from ._options import Window


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
    return Bands(*(x.astype(np.int32) for x in (lo, full_lo, full_hi, hi)))


def band_ranges(
    seq_q: int, seq_k: int, block_q: int, block_k: int, window: Window, offset: int,
    by: str,
) -> Bands:
    """Key-block ranges per query block (`by="q"`) or query-block ranges per key block
    (`by="k"`)."""
    nonempty, full = _pair_flags(seq_q, seq_k, block_q, block_k, window, offset)
    if by == "k":
        nonempty, full = nonempty.T, full.T
    return _bands(nonempty, full)


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
    return _interval(overlap.T if by == "k" else overlap)


def _interval(pairs: Array) -> tuple[Array, Array]:
    """Per row of `pairs` (bool `[n_outer, n_inner]`), the smallest `[lo, hi)` holding all
    its True entries (`[0, 0)` for none)."""
    n_inner = pairs.shape[1]
    any_ = pairs.any(axis=1)
    lo = jnp.where(any_, jnp.argmax(pairs, axis=1), 0).astype(jnp.int32)
    hi = jnp.where(any_, n_inner - jnp.argmax(pairs[:, ::-1], axis=1), 0).astype(jnp.int32)
    return lo, hi


def block_mask_limits(masks: Masks, by: str) -> tuple[Array, Array] | None:
    """Per outer block, the inner blocks `[lo, hi)` between the first and the last that a
    `block_mask` (`masks.block_flags`, one head's `(1, num_q, num_k)`) leaves non-empty;
    None without one. A causal or banded `mask_mod` then runs the loop of its band only;
    empty blocks inside the range are skipped by `_block.visit`."""
    flags = masks.block_flags
    if flags is None:
        return None
    nonempty = flags.reshape(flags.shape[-2:]) != 0
    return _interval(nonempty.T if by == "k" else nonempty)


def length_limits(cfg: KernelConfig, masks: Masks, by: str) -> tuple[Array, Array] | None:
    """Per outer block, the inner blocks `[lo, hi)` that the valid lengths (and the window
    aligned on them, `_masking.length_mask`) let attend; None without lengths. Exact at
    block granularity: key blocks wholly past `kv_len` and query blocks wholly past `q_len`
    are never visited, so a padded batch costs its real lengths. `masks` are one head's
    (`_heads.Head`), lengths `(1, 1, 1)`."""
    if not masks.has_lengths:
        return None
    q_len, kv_len = (jnp.asarray(x, jnp.int32).reshape(())
                     for x in lengths_or(masks, cfg.seq_q, cfg.seq_k))
    left, right = cfg.window.left, cfg.window.right
    offset = kv_len - q_len
    bq, bk = cfg.block_q, cfg.block_k
    if by == "q":
        n_outer, outer_block, outer_len, inner_block = -(-cfg.seq_q // bq), bq, q_len, bk
    else:
        n_outer, outer_block, outer_len, inner_block = -(-cfg.seq_k // bk), bk, kv_len, bq
    first = jnp.arange(n_outer, dtype=jnp.int32) * outer_block
    last = jnp.minimum(first + outer_block, outer_len) - 1
    if by == "q":  # keys j with p - left <= j <= p + right, p = i + offset, j < kv_len
        start = jnp.zeros_like(first) if left is None else jnp.maximum(first + offset - left, 0)
        stop = kv_len if right is None else jnp.minimum(kv_len, last + offset + right + 1)
    else:  # queries i with j - right <= i + offset <= j + left, i < q_len
        start = jnp.zeros_like(first) if right is None else jnp.maximum(first - right - offset, 0)
        stop = q_len if left is None else jnp.minimum(q_len, last + left - offset + 1)
    stop = jnp.broadcast_to(stop, first.shape)
    empty = (first >= outer_len) | (stop <= start)
    lo = jnp.where(empty, 0, start // inner_block)
    hi = jnp.where(empty, 0, -(-stop // inner_block))
    return lo.astype(jnp.int32), hi.astype(jnp.int32)


def run_limits(cfg: KernelConfig, masks: Masks, by: str) -> tuple[Array, Array] | None:
    """The run-time narrowing of the static band: `segment_limits`, `length_limits` and
    `block_mask_limits` intersected (None when none applies)."""
    found = [x for x in (segment_limits(cfg, masks, by), length_limits(cfg, masks, by),
                         block_mask_limits(masks, by))
             if x is not None]
    if not found:
        return None
    lo, hi = found[0]
    for other_lo, other_hi in found[1:]:
        lo, hi = jnp.maximum(lo, other_lo), jnp.minimum(hi, other_hi)
    return lo, jnp.maximum(hi, lo)


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
