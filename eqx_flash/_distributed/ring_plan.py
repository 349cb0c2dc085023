"""The static plan of one ring call, and the moves between its steps.

Where a chunk pair sits relative to the causal diagonal or a window depends on which
devices meet at a ring step, a run-time value, while the kernels take the alignment
statically (`KernelConfig.diagonal_offset`). So every (device, step) pair is classified
at trace time into skip / fully visible / one of a few masked variants (`plan`), and
`lax.switch` picks the variant at run time (`dispatch`).
"""

import dataclasses
import functools
from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._core.compat import pcast_varying, varying_axes
from .._core.config import KernelConfig
from .._core.options import Window
from .._kernels.schedule import static_flags
from .._mods.block_mask import EMPTY, FULL
from .sequence_order import Layout, chunk_index, subchunks


@dataclasses.dataclass(frozen=True)
class Ring:
    """Static description of one ring call. `base.seq_q`/`seq_k` are the lengths of one
    piece (the local shard divided by `subchunks(layout)`); `base.window` is global."""

    axis_name: Hashable
    num_devices: int
    layout: Layout
    base: KernelConfig

    @property
    def pieces(self) -> int:
        return subchunks(self.layout)


def pair_config(ring: Ring, a: int, qp: int, b: int, kp: int) -> KernelConfig | None:
    """Kernel config for query piece `qp` of device `a` against key piece `kp` of device `b`:
    None if no pair attends, an unmasked config if all do, else a positioned one."""
    n, base = ring.num_devices, ring.base
    if base.positions:  # the window is measured on the positions, at run time
        return base
    cq, ck, win = base.seq_q, base.seq_k, base.window
    if ring.layout == "striped":
        # Device a holds global tokens a + n*r. In local indices the global window
        # becomes another window around the same diagonal (floor division is exact here).
        left = None if win.left is None else (win.left - (a - b)) // n
        right = None if win.right is None else (a - b + win.right) // n
        window, offset = Window(left, right), ck - cq
    else:
        total = n * ring.pieces
        gq = chunk_index(ring.layout, n, a, qp)
        gk = chunk_index(ring.layout, n, b, kp)
        window, offset = win, gq * cq - gk * ck + total * (ck - cq)
    one_block = static_flags(cq, ck, cq, ck, window, offset)[0, 0]
    if one_block == FULL:
        return dataclasses.replace(base, window=Window(), diagonal_offset=None)
    if one_block != EMPTY:
        return dataclasses.replace(base, window=window, diagonal_offset=offset)
    return None


@functools.lru_cache(maxsize=256)
def plan(ring: Ring) -> dict[tuple[int, int], tuple[tuple[KernelConfig | None, ...], np.ndarray]]:
    """Per (query piece, key piece): the distinct variants and a `[device, source]` table
    of which variant applies."""
    n = ring.num_devices
    variants_of = {}
    for qp in range(ring.pieces):
        for kp in range(ring.pieces):
            variants: list[KernelConfig | None] = []
            table = np.zeros((n, n), np.int32)
            for a in range(n):
                for b in range(n):
                    cfg = pair_config(ring, a, qp, b, kp)
                    if cfg not in variants:
                        variants.append(cfg)
                    table[a, b] = variants.index(cfg)
            variants_of[(qp, kp)] = (tuple(variants), table)
    return variants_of


def dispatch(branches, table: np.ndarray, me: Array, src: Array, *operands):
    if len(branches) == 1:
        return branches[0](*operands)
    return jax.lax.switch(jnp.asarray(table)[me, src], branches, *operands)


def shift(tree, ring: Ring):
    """Send everything one step along the ring (device j to j + 1)."""
    n = ring.num_devices
    perm = [(j, (j + 1) % n) for j in range(n)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, ring.axis_name, perm), tree)


def varying_axes_of(tree) -> tuple:
    """Manual mesh axes any leaf varies over (inside `shard_map` with `check_vma=True`)."""
    axes = set()
    for x in jax.tree.leaves(tree):
        axes |= varying_axes(x)
    return tuple(sorted(axes, key=str))


def vary(tree, like):
    """Give fresh accumulators (or replicated inputs) the varying manual axes of the
    inputs `like` that they lack, so that scan carries and switch branches type-check
    under shard_map's `check_vma=True`."""
    axes = varying_axes_of(like)
    if not axes:
        return tree

    def cast(x):
        missing = tuple(a for a in axes if a not in varying_axes(x))
        return pcast_varying(x, missing) if missing else x

    return jax.tree.map(cast, tree)
