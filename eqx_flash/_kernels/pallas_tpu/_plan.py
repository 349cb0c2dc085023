"""The flat plans the Pallas kernels prefetch: per outer block, the inner blocks to visit.

From the static block plan (`_kernels.schedule.static_flags`: causal, the window and key
padding, the one statement of which block pairs are empty, partial or whole), a table
per outer block of its non-empty inner blocks in order, each with its flag (splash
attention's encoding): 0 no block at this step, 1 partial (the positional mask and the
`mask_mod` apply), 2 whole. Rows shorter than the widest repeat their last block with
flag 0: the grid step does nothing and, the block index unchanged, costs no DMA.

A `mask_mod`'s block summary narrows the static plan (`_listed`), one table per batch
element and kv head where the summary varies over them: a block it empties is never
visited; one it fills, whole by position too, skips both masks. Known when traced (a
mask_mod of indices alone: `KernelConfig.block_summary`), the tables are NumPy and as
wide as the widest row needs, so the grid shrinks with the sparsity; known only at run
time (`ops.block_flags`, a `block_mask` passed into `jit`), they are built in the program,
as wide as the static plan (the steps past a row's blocks do nothing and move nothing).
The kernels read the tables flat (`Plan.at`), as SMEM holds them.
"""

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ..._core.config import KernelConfig
from ..._mods.block_mask import EMPTY, FULL, PARTIAL
from ..schedule import static_flags


class Layout(NamedTuple):
    """The tables' static shape: `[lead_b, lead_h, num_outer, steps]`, `lead_b`/`lead_h`
    1 where the plan is the same for every batch element / kv head; `num_inner` inner
    blocks in all."""

    lead_b: int
    lead_h: int
    num_outer: int
    steps: int
    num_inner: int

    def at(self, bi, hi, o, s):
        """The flat index of step `s` of outer block `o` for batch element `bi`, kv head
        `hi` (scalars of the grid)."""
        b = bi if self.lead_b > 1 else 0
        h = hi if self.lead_h > 1 else 0
        return ((b * self.lead_h + h) * self.num_outer + o) * self.steps + s


class Plan(NamedTuple):
    """`int32` tables of `layout`'s shape: the inner block of each step, and its flag
    (NumPy when static, traced arrays when a block summary narrows them)."""

    kv_block: np.ndarray | Array
    flag: np.ndarray | Array
    layout: Layout
    # Whether a block summary narrowed the plan (then a whole block's `mask_mod` is not
    # evaluated).
    listed: bool = False

    @property
    def static(self) -> bool:
        return isinstance(self.flag, np.ndarray)

    @property
    def any_partial(self) -> bool:
        return not self.static or bool(np.any(self.flag == PARTIAL))

    @property
    def visits_every_pair(self) -> bool:
        """Whether every block pair is visited (statically known)."""
        if not self.static:
            return False
        return int(np.sum(self.flag != 0)) == (self.layout.lead_b * self.layout.lead_h
                                               * self.layout.num_outer * self.layout.num_inner)

    def tables(self) -> tuple[Array, Array]:
        """The tables as the kernels' scalar prefetch takes them: flat."""
        return jnp.asarray(self.kv_block).reshape(-1), jnp.asarray(self.flag).reshape(-1)


def _static(nonempty: np.ndarray, whole: np.ndarray) -> Plan:
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
    return Plan(kv_block, flag, Layout(1, 1, n_outer, steps, nonempty.shape[1]))


def _listed(nonempty: np.ndarray, whole: np.ndarray, summary: Array | np.ndarray) -> Plan:
    """The static plan narrowed by `summary` (`int8[lead_b, lead_h, n_outer, n_inner]`,
    `make_block_mask`'s flags): per row, the non-empty blocks in order, then the last one
    repeated with flag 0. A NumPy summary (known when traced) gives NumPy tables as wide
    as its widest row; a traced one, tables built in the program, as wide as the static
    plan."""
    xp: Any = np if isinstance(summary, np.ndarray) else jnp
    lead_b, lead_h, n_outer, n_inner = summary.shape
    assert nonempty.shape == (n_outer, n_inner), (nonempty.shape, summary.shape)
    visit = xp.asarray(nonempty)[None, None] & (summary != EMPTY)
    full = xp.asarray(whole)[None, None] & (summary == FULL)
    count = xp.sum(visit, axis=-1, dtype=np.int32)[..., None]
    wide = nonempty if xp is jnp else visit
    steps = max(int(np.max(np.sum(wide, axis=-1), initial=0)), 1)
    # A stable sort of "not visited" puts a row's visited blocks first, in order.
    order = xp.argsort(xp.logical_not(visit).astype(np.int8), axis=-1,
                       stable=True)[..., :steps].astype(np.int32)
    step = xp.arange(steps, dtype=np.int32).reshape(1, 1, 1, steps)
    last = xp.take_along_axis(order, xp.maximum(count - 1, 0), axis=-1)
    kv_block = xp.where(step < count, order, xp.where(count > 0, last, 0))
    flag = xp.where(step < count,
                    xp.where(xp.take_along_axis(full, order, axis=-1), FULL, PARTIAL), 0)
    return Plan(kv_block.astype(np.int32), flag.astype(np.int32),
                Layout(lead_b, lead_h, n_outer, steps, n_inner), listed=True)


def _flags(cfg: KernelConfig) -> tuple[np.ndarray, np.ndarray]:
    """`(nonempty, whole)` per block pair."""
    flags = static_flags(cfg.seq_q, cfg.seq_k, cfg.block_q, cfg.block_k, cfg.band_window,
                         cfg.offset)
    return flags != EMPTY, flags == FULL


def _summary(block_flags: Array | np.ndarray) -> Array | np.ndarray:
    """`ops.block_flags` (`(batch|1, kv_heads|1, 1, num_q, num_k)`) as
    `[lead_b, lead_h, num_q, num_k]`."""
    lead_b, lead_h, _, num_q, num_k = block_flags.shape
    return block_flags.reshape(lead_b, lead_h, num_q, num_k)


def _known(cfg: KernelConfig, block_flags: Array | None) -> Array | np.ndarray | None:
    """The summary the plan follows: the one known when traced (`cfg.block_summary`),
    else `ops.block_flags` (None: no summary)."""
    if cfg.block_summary is not None:
        return _summary(cfg.block_summary.flags)
    return None if block_flags is None else _summary(block_flags)


def forward_plan(cfg: KernelConfig, block_flags: Array | None = None) -> Plan:
    """Per query block, its key blocks."""
    nonempty, whole = _flags(cfg)
    summary = _known(cfg, block_flags)
    if summary is None:
        return _static(nonempty, whole)
    return _listed(nonempty, whole, summary)


def backward_plan(cfg: KernelConfig, block_flags: Array | None = None) -> Plan:
    """Per key block, its query blocks."""
    nonempty, whole = _flags(cfg)
    summary = _known(cfg, block_flags)
    if summary is None:
        return _static(nonempty.T, whole.T)
    return _listed(nonempty.T, whole.T, summary.swapaxes(-1, -2))
