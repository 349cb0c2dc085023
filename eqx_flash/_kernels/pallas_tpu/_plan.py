"""The flat plans the Pallas kernels prefetch: per outer block, the inner blocks to visit.

From the static block plan (`_kernels.schedule.static_flags`: causal, the window and key
padding, the one statement of which block pairs are empty, partial or whole), a table
per outer block of its non-empty inner blocks in order, each with its flag (splash
attention's encoding): 0 no block at this step, 1 partial (the positional mask applies),
2 whole. Rows shorter than the widest repeat their last block with flag 0: the grid step
does nothing and, the block index unchanged, costs no DMA.
"""

from typing import NamedTuple

import numpy as np

from ..._core.config import KernelConfig
from ..._mods.block_mask import EMPTY, FULL, PARTIAL
from ..schedule import static_flags


class Plan(NamedTuple):
    """`int32[num_outer, steps]` tables: the inner block of each step, and its flag."""

    kv_block: np.ndarray
    flag: np.ndarray

    @property
    def any_partial(self) -> bool:
        return bool(np.any(self.flag == PARTIAL))


def _plan(nonempty: np.ndarray, whole: np.ndarray) -> Plan:
    n_outer = nonempty.shape[0]
    steps = max(int(nonempty.sum(axis=1).max(initial=0)), 1)
    kv_block = np.zeros((n_outer, steps), np.int32)
    flag = np.zeros((n_outer, steps), np.int32)
    for o in range(n_outer):
        visit = np.flatnonzero(nonempty[o])
        kv_block[o, : len(visit)] = visit
        flag[o, : len(visit)] = np.where(whole[o, visit], FULL, PARTIAL)
        if len(visit):
            kv_block[o, len(visit):] = visit[-1]
    return Plan(kv_block, flag)


def _flags(cfg: KernelConfig) -> tuple[np.ndarray, np.ndarray]:
    """`(nonempty, whole)` per block pair."""
    flags = static_flags(cfg.seq_q, cfg.seq_k, cfg.block_q, cfg.block_k, cfg.band_window,
                         cfg.offset)
    return flags != EMPTY, flags == FULL


def forward_plan(cfg: KernelConfig) -> Plan:
    """Per query block, its key blocks."""
    return _plan(*_flags(cfg))


def backward_plan(cfg: KernelConfig) -> Plan:
    """Per key block, its query blocks."""
    nonempty, whole = _flags(cfg)
    return _plan(nonempty.T, whole.T)
