"""Static schedule of the block pairs a kernel must visit.

Causal and window masks are known at trace time, so the pairs they empty are never
computed (forward or backward), and pairs they leave whole need no positional mask.
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


def block_schedule(
    seq_q: int, seq_k: int, block_q: int, block_k: int, window: Window, offset: int
) -> Schedule:
    """Pairs for query rows at aligned positions `i + offset` (see `KernelConfig`)."""
    num_q = -(-seq_q // block_q)
    num_k = -(-seq_k // block_k)
    qb, kb = np.meshgrid(np.arange(num_q), np.arange(num_k), indexing="ij")
    qb, kb = qb.reshape(-1), kb.reshape(-1)
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
    pairs = np.stack([qb, kb], axis=1).astype(np.int32)
    return Schedule(partial=pairs[nonempty & ~full], full=pairs[nonempty & full])
