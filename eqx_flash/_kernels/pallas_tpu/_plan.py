"""The flat plans the Pallas kernels prefetch: one grid step per block pair they visit.

From the static block plan (`_kernels.schedule.static_flags`: causal, the window and key
padding, the one statement of which block pairs are empty, partial or whole), the grid's
last axis walks every outer block's non-empty inner blocks in order, each step with its
outer block, its inner block and a code: the flag (splash attention's encoding: 0 no
block at this step, 1 partial, where the positional mask and the `mask_mod` apply, 2
whole) and whether the step is the first (`FIRST`: initialise the outer block's running
state) or the last (`LAST`: write it out) of its outer block. An outer block with no
inner block gets one step with flag 0, so its results are written (0 and -inf). Only
the non-empty pairs cost a grid step: a causal plan has about half the steps a padded
`(outer, inner)` grid would.

A `mask_mod`'s block summary narrows the plan (`_listed`), one table per batch element and
kv head where it varies over them: a block it empties is never visited; one it fills,
whole by position too, skips both masks. Known when traced (a mask_mod of indices alone:
`KernelConfig.block_summary`), the tables are NumPy with as many steps as the summary
leaves; known only at run time (`ops.block_flags`, a `block_mask` passed into `jit`),
they are built in the program with each outer block's steps of the static plan, those it
empties flag 0, repeating the last block visited (no DMA, no work). The kernels read the
tables flat (`Layout.at`), as SMEM holds them.
"""

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ..._core.config import KernelConfig
from ..._mods.block_mask import EMPTY, FULL, PARTIAL, merged
from ..schedule import static_flags

FLAG, FIRST, LAST = 3, 4, 8  # a step's code: `code & FLAG` its flag, then two bits
# The most block pairs a plan lists per batch element and kv head (three int32 tables of
# at most this many steps each, in SMEM); past it, a summary that varies over them is
# merged over them (`block_mask.merged`): still exact, the mask_mod evaluated where any needs it.
MAX_LISTED = 2**13


class Layout(NamedTuple):
    """The tables' static shape: `[lead_b, lead_h, steps]`, `lead_b`/`lead_h` 1 where the
    plan is the same for every batch element / kv head, over `num_outer` outer and
    `num_inner` inner blocks."""

    lead_b: int
    lead_h: int
    steps: int
    num_outer: int
    num_inner: int

    def at(self, bi, hi, t):
        """The flat index of step `t` for batch element `bi`, kv head `hi` (scalars of
        the grid)."""
        b = bi if self.lead_b > 1 else 0
        h = hi if self.lead_h > 1 else 0
        return (b * self.lead_h + h) * self.steps + t


class Plan(NamedTuple):
    """`int32` tables of `layout`'s shape: each step's outer block, inner block and code
    (NumPy when static, traced arrays when a summary known at run time narrows them)."""

    outer: np.ndarray | Array
    inner: np.ndarray | Array
    code: np.ndarray | Array
    layout: Layout
    # Whether a block summary narrowed the plan (then a whole block's `mask_mod` is not
    # evaluated).
    listed: bool = False

    @property
    def static(self) -> bool:
        return isinstance(self.code, np.ndarray)

    @property
    def any_partial(self) -> bool:
        return not self.static or bool(np.any(np.asarray(self.code) & FLAG == PARTIAL))

    @property
    def visits_every_pair(self) -> bool:
        """Whether every block pair is visited (statically known)."""
        if not self.static:
            return False
        visited = int(np.sum(np.asarray(self.code) & FLAG != 0))
        n = self.layout
        return visited == n.lead_b * n.lead_h * n.num_outer * n.num_inner

    def tables(self) -> tuple[Array, Array, Array]:
        """The tables as the kernels' scalar prefetch takes them: flat."""
        def flat(x: np.ndarray | Array) -> Array:
            return jnp.asarray(x).reshape(-1)

        return flat(self.outer), flat(self.inner), flat(self.code)


def applies_mask_mod(positional: bool | None | Array, listed: bool) -> bool:
    """Whether a step evaluates the `mask_mod`: everywhere but on a block a listed plan
    flags whole (`positional=False`), which its summary fills."""
    return positional is not False or not listed


def _listed(nonempty: np.ndarray, whole: np.ndarray, summary: Array | np.ndarray) -> Plan:
    """The plan of the static `(nonempty, whole)` flags narrowed by `summary`
    (`int8[lead_b, lead_h, n_outer, n_inner]`, `make_block_mask`'s flags; all `FULL` for
    none). NumPy in, NumPy out: each outer block gets as many steps as its most visited
    row needs; traced: as many as the static plan gives it."""
    xp: Any = np if isinstance(summary, np.ndarray) else jnp
    lead_b, lead_h, n_outer, n_inner = summary.shape
    assert nonempty.shape == (n_outer, n_inner), (nonempty.shape, summary.shape)
    visit = xp.asarray(nonempty)[None, None] & (summary != EMPTY)
    full = xp.asarray(whole)[None, None] & (summary == FULL)
    count = xp.sum(visit, axis=-1, dtype=np.int32)  # (lead_b, lead_h, n_outer)
    bound = np.sum(nonempty if xp is jnp else visit, axis=-1).reshape(-1, n_outer)
    widths = [max(int(w), 1) for w in bound.max(axis=0, initial=0)]
    # A stable sort of "not visited" puts a row's visited blocks first, in order.
    unvisited = xp.logical_not(visit).astype(np.int8)
    order = (np.argsort(unvisited, axis=-1, kind="stable") if xp is np
             else jnp.argsort(unvisited, axis=-1, stable=True)).astype(np.int32)
    outer, inner, code = [], [], []
    for o, width in enumerate(widths):
        n = count[..., o:o + 1]
        step = xp.arange(width, dtype=np.int32).reshape(1, 1, width)
        blocks = order[..., o, :width]
        last = xp.take_along_axis(blocks, xp.maximum(n - 1, 0), axis=-1)
        inner.append(xp.where(step < n, blocks, xp.where(n > 0, last, 0)))
        kind = xp.where(xp.take_along_axis(full[..., o, :], blocks, axis=-1), FULL, PARTIAL)
        ends = np.zeros(width, np.int32)
        ends[0] |= FIRST
        ends[-1] |= LAST
        code.append(xp.where(step < n, kind, 0) | xp.asarray(ends).reshape(1, 1, width))
        outer.append(xp.full((lead_b, lead_h, width), o, np.int32))
    steps = sum(widths)
    def joined(parts: list[Any]) -> Any:
        return xp.concatenate(parts, axis=-1).astype(np.int32)

    return Plan(joined(outer), joined(inner), joined(code),
                Layout(lead_b, lead_h, steps, n_outer, n_inner))


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


def _plan(cfg: KernelConfig, block_flags: Array | None, transposed: bool) -> Plan:
    nonempty, whole = _flags(cfg)
    if transposed:
        nonempty, whole = nonempty.T, whole.T
    if cfg.block_summary is not None:  # known when traced
        summary = _summary(cfg.block_summary.flags)
    elif block_flags is not None:
        summary = _summary(block_flags)
    else:
        return _listed(nonempty, whole, np.full((1, 1, *nonempty.shape), FULL, np.int8))
    if transposed:
        summary = summary.swapaxes(-1, -2)
    if summary.shape[0] * summary.shape[1] * nonempty.size > MAX_LISTED:
        summary = merged(summary, (0, 1))  # one for every batch element and kv head
    return _listed(nonempty, whole, summary)._replace(listed=True)


def forward_plan(cfg: KernelConfig, block_flags: Array | None = None) -> Plan:
    """Per query block, its key blocks (`block_flags`: a summary known at run time)."""
    return _plan(cfg, block_flags, transposed=False)


def backward_plan(cfg: KernelConfig, block_flags: Array | None = None) -> Plan:
    """Per key block, its query blocks."""
    return _plan(cfg, block_flags, transposed=True)
