"""Static schedules of the block pairs a kernel must visit.

Causal and window masks are known at trace time, so the pairs they empty are never
computed (forward or backward), and pairs they leave whole need no positional mask.
The non-empty key blocks of a query block form one contiguous range (the mask is a band),
and the whole ones a contiguous sub-range of it; `band_ranges` gives both per block.
"""

from typing import NamedTuple

import numpy as np

from ._config import Window


class Schedule(NamedTuple):
    """(query block, key block) index pairs, `int32[n, 2]` each."""

    partial: np.ndarray  # some pairs in the block are masked by position or key padding
    full: np.ndarray  # every pair in the block attends positionally

    @property
    def num_pairs(self) -> int:
        return len(self.partial) + len(self.full)


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
    def num_pairs(self) -> int:
        return int(np.sum(self.hi - self.lo))

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
