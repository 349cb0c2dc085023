"""What every Pallas kernel computes on one tile: its products and its logits' units.

The softmax runs in base 2 by default (`Tuning.base2`): `exp2(s - m)` with the scale and
log2(e) folded into one multiply, so the exponential needs no extra multiply by log2(e)
on every logit; the statistics are converted back to natural logarithms once per row
(the family contract's lse is natural). float32 queries carry the scale (and log2(e))
folded in before the kernel (`tile.folds_scale`: one pass over q instead of one per
logit); low-precision ones are scaled in the kernel, on the float32 logits, unless
`Tuning.prescale` asks to fold it into them too (a second rounding of every query).
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array

from ..._core.config import KernelConfig
from ..xla.tile import folds_scale

LANES = 128
LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)

NT = (((1,), (1,)), ((), ()))  # a @ b^T
NN = (((1,), (0,)), ((), ()))  # a @ b
TN = (((0,), (0,)), ((), ()))  # a^T @ b


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The kernels' implementation choices (measured on a TPU v5e:
    `benchmarks/tune_pallas.py`)."""

    base2: bool = True
    prescale: bool = False
    # Key (forward) or query (dk/dv) rows per product inside a block: the DMA block stays
    # large while each product and its softmax work on a slice (None: the whole block).
    # At seq 4096 without a band, 2048 x 1024 blocks in slices of 256 ran the forward
    # 1.2x faster than whole 1024 x 1024 blocks, forward+backward 1.07x.
    chunk: int | None = 256
    # The forward's key slices with a causal/window band: 1024 x 1024 blocks in slices of
    # 512 ran the causal forward at seq 4096 1.11x faster than in slices of 256 (80.3
    # against 72.2 TFLOP/s; 1.04x at 16384), 1.05x splash attention at its best blocks.
    chunk_banded: int | None = 512
    # The dk/dv slices with a causal/window band: whole blocks measured faster there.
    chunk_banded_backward: bool = False
    # One backward kernel (dq accumulated in VMEM across the key blocks) where the
    # queries' dq fits; else a dq kernel and a dk/dv kernel (1.27x slower at seq 4096).
    fused_backward: bool = True
    # Query rows per tile of a block the band crosses (forward): the tiles it leaves
    # empty are skipped and those it leaves whole computed without the mask (None: the
    # block's rows in one tile; a causal diagonal block then computes its masked half).
    partial_rows: int | None = 512

    def forward_chunk(self, cfg: KernelConfig) -> int:
        banded = not cfg.band_window.is_unbounded
        return _slice(self.chunk_banded if banded else self.chunk, cfg.block_k)

    def backward_chunk(self, cfg: KernelConfig) -> int:
        banded = not cfg.band_window.is_unbounded
        chunk = None if banded and not self.chunk_banded_backward else self.chunk
        return _slice(chunk, cfg.block_q)

    def partial_split(self, block_q: int) -> int | None:
        """The rows per tile of a partial block (None: the block is one tile)."""
        rows = _slice(self.partial_rows, block_q)
        return None if rows == block_q else rows


def _slice(chunk: int | None, block: int) -> int:
    """The slice a block is computed in: the whole block unless `chunk` divides it."""
    return block if chunk is None or chunk >= block or block % chunk else chunk


DEFAULT_TUNING = Tuning()


class Units(NamedTuple):
    """How raw products `q . k` become the logits the kernels exponentiate."""

    fold: float  # multiplied into q before the kernel (1: none)
    in_kernel: float  # multiplied into the products in the kernel (1: none)
    after_cap: float  # multiplied into the capped logits (log2(e) in base 2, else 1)
    base2: bool
    # The units of the logits before the cap, in which a score term is added to them
    # (log2(e) in base 2 without a cap; natural, 1, under a cap).
    before_cap: float

    def exp(self, x: Array) -> Array:
        return jnp.exp2(x) if self.base2 else jnp.exp(x)

    def to_natural(self, x: Array) -> Array:
        """A statistic in the kernel's units (max, lse) in natural ones."""
        return x * LN2 if self.base2 else x

    def from_natural(self, x: Array) -> Array:
        return x * LOG2E if self.base2 else x

    def log(self, x: Array) -> Array:
        return jnp.log2(x) if self.base2 else jnp.log(x)


def units(cfg: KernelConfig, dtype, tuning: Tuning) -> Units:
    base = LOG2E if tuning.base2 else 1.0
    # With a soft cap, the cap acts on natural logits: base 2 applies after it.
    capped = cfg.softcap is not None
    total, after = (cfg.scale, base) if capped else (cfg.scale * base, 1.0)
    before = 1.0 if capped else base
    if folds_scale(dtype) or tuning.prescale:
        return Units(total, 1.0, after, tuning.base2, before)
    return Units(1.0, total, after, tuning.base2, before)


def prepared_queries(q: Array, u: Units) -> Array:
    return q if u.fold == 1.0 else (q * jnp.asarray(u.fold, q.dtype))


def dot(a: Array, b: Array, dims, stat) -> Array:
    """A block product accumulating in `stat`. Low-precision operands ask for the MXU's
    own precision explicitly: under `jax.default_matmul_precision("highest")` Mosaic
    would be asked for float32 passes it does not have for bfloat16."""
    low = a.dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    precision = jax.lax.Precision.DEFAULT if low else None
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=stat)


# A `score_mod` on a tile of logits (in the kernel's units before the cap): its value
# and, where asked for, its derivative (`_tile_mods.apply_score_mod`: an array, or its
# `ModDerivatives` for a split one's values).
ScoreMod = Callable[[Array], tuple[Array, Any]]


def logits(cfg: KernelConfig, u: Units, a: Array, b: Array, stat, term: Array | None = None,
           mod: ScoreMod | None = None) -> tuple[Array, Array | None, Any]:
    """`a @ b^T` in the kernel's units plus a score `term` (in `u.before_cap` units),
    through a `score_mod`, soft-capped; the cap's tanh (None without) and the score_mod's
    derivative (None without, or not asked for; as the score_mod gives it)."""
    s = dot(a, b, NT, stat)
    if u.in_kernel != 1.0:
        s = s * jnp.asarray(u.in_kernel, stat)
    if term is not None:
        s = s + term
    slope = None
    if mod is not None:
        s, slope = mod(s)
    if cfg.softcap is None:
        return s, None, slope
    t = jnp.tanh(s * jnp.asarray(1.0 / cfg.softcap, stat))
    s = t * jnp.asarray(cfg.softcap * u.after_cap, stat)
    return s, t, slope


def add_terms(a: Array | None, b: Array | None) -> Array | None:
    """The sum of two score terms, either of which may be absent (None)."""
    return b if a is None else a if b is None else a + b


def and_masks(a: Array | None, b: Array | None) -> Array | None:
    """Both masks, either of which may be absent (None: keeps every pair). The mask
    broadcast along fewer dimensions goes first: Mosaic lays out an elementwise op on
    masks after its first operand and relays the others out to that layout where their
    bit widths differ, which a mask replicated along rows or columns cannot take."""
    if a is None or b is None:
        return b if a is None else a
    return a & b if a.size >= b.size else b & a


def fold_heads(parts: list[Array]) -> Array:
    """One `(rows, cols)` tile per query head as the tile of the heads folded into its
    rows, `(g * rows, cols)` (the layout of the forward's and the dq kernel's logits)."""
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)


def per_head_term(coefficients: list[Array], distance: Array) -> Array:
    """`coefficient * distance` for each query head folded into a tile's rows, as the
    tile `(g * rows, cols)`: `distance` `(1|g, rows, cols)`, one scalar per head."""
    return fold_heads([c * distance[min(n, distance.shape[0] - 1)]
                       for n, c in enumerate(coefficients)])


def lanes(x: Array, width: int) -> Array:
    """A lane-replicated `(rows, LANES)` statistic as `(rows, width)`."""
    if width % LANES == 0:
        return jnp.tile(x, (1, width // LANES))
    if width < LANES:
        return x[:, :width]
    return jnp.tile(x, (1, math.ceil(width / LANES)))[:, :width]
