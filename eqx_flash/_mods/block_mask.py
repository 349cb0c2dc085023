"""`make_block_mask`: which blocks of a `mask_mod` are empty, partial or full.

Built once (outside `jit` if you like) and passed to the attention calls with the same
`mask_mod`: blocks it proves empty are never computed, and blocks it proves full skip
evaluating the `mask_mod`. Like FlexAttention's `create_block_mask`.
"""

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int8

from .._core.config import choose_block, default_blocks
from .._core.options import Window, make_options
from .._core.shapes import Shapes, ceil_div
from .._core.types import Documented
from .._mods.tracing import check_mask_mod

EMPTY, PARTIAL, FULL = 0, 1, 2

# Checked by hand (`make_block_mask`): beartype would check a `tuple[int, ...]` by sampling
# with the global `random` module, which Hypothesis strategies must not touch.
if TYPE_CHECKING:
    BatchShape = tuple[int, ...]
else:
    BatchShape = Annotated[Any, Documented(tuple[int, ...])]


class BlockMask(eqx.Module):
    """Block-sparsity summary of a `mask_mod` (build it with `make_block_mask`).

    `flags[*batch, head, i, j]` is 0 when no pair of query block `i` and key block `j`
    attends, 2 when every pair does, 1 otherwise (`batch`/`head` of size 1 when the mask
    was built as shared). Memory: one byte per block pair and head.
    """

    flags: Int8[Array, "*batch heads num_q num_k"]
    batch_shape: BatchShape = eqx.field(static=True)
    heads: int = eqx.field(static=True)
    seq_q: int = eqx.field(static=True)
    seq_k: int = eqx.field(static=True)
    block_q: int = eqx.field(static=True)
    block_k: int = eqx.field(static=True)

    @property
    def sparsity(self) -> Array:
        """The fraction of block pairs that are empty (never computed)."""
        return jnp.mean(self.flags == EMPTY)


def make_block_mask(
    mask_mod: Callable[..., Any],
    batch_shape: BatchShape | int,
    heads: int,
    seq_q: int,
    seq_k: int,
    block_q: int | None = None,
    block_k: int | None = None,
    *,
    kv_heads: int | None = None,
) -> BlockMask:
    """Summarise `mask_mod(batch, head, q_idx, kv_idx) -> bool` per block pair.

    **Arguments:**

    - `mask_mod`: as passed to `flash_attention`, elementwise with broadcasting index
        arrays; `batch` is the flat row-major index over the leading batch axes.
    - `batch_shape`: q's leading axes before the heads axis, e.g. `(batch,)`; `()` (or
        `1`) for a mask that does not depend on `batch` (shared by every batch element).
    - `heads`: q's number of heads; 1 for a mask that does not depend on `head`.
        A call whose `mask_mod` reads `batch` (`head`) with a block mask built shared over
        it, for more than one batch element (head), raises a `ValueError` naming
        `block_mask`.
    - `seq_q`, `seq_k`: the sequence lengths of the calls it will be used with.
    - `block_q`, `block_k`: the calls' block sizes. `None` means the kernels' default for
        a call with neither `causal` nor `window` (`kv_heads`, if given, tells it the
        grouped-query layout, which changes the default `block_q`); a call with other
        block sizes raises a `ValueError` naming `block_mask`.

    **Returns:**

    A `BlockMask` (an `eqx.Module`, so it can be built outside `jit` and passed in), with
    memory proportional to the number of blocks; built block by block, so it never holds
    the whole `seq_q x seq_k` mask.
    """
    if isinstance(batch_shape, int):
        batch_shape = () if batch_shape == 1 else (batch_shape,)
    if not all(isinstance(n, int) and n > 0 for n in batch_shape):
        raise ValueError(f"batch_shape must be a tuple of positive ints; got {batch_shape!r}")
    batch_shape = tuple(int(n) for n in batch_shape)
    for name, n in (("heads", heads), ("seq_q", seq_q), ("seq_k", seq_k)):
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"{name} must be a positive int; got {name}={n!r}")
    groups = 1 if kv_heads is None else max(heads // kv_heads, 1)
    options = make_options(block_q=block_q, block_k=block_k)
    tuned_q, tuned_k = default_blocks(Window(), groups, fine=True)
    bq = choose_block(options.block_q, tuned_q, seq_q)
    bk = choose_block(options.block_k, tuned_k, seq_k)
    batch = math.prod(batch_shape)
    flags = _flags(mask_mod, batch, heads, seq_q, seq_k, bq, bk)
    flags = flags.reshape(*batch_shape, heads, *flags.shape[-2:])
    return BlockMask(flags, batch_shape, heads, seq_q, seq_k, bq, bk)


def _flags(
    mask_mod: Callable[..., Any], batch: int, heads: int, seq_q: int, seq_k: int, bq: int,
    bk: int,
) -> Array:
    num_q, num_k = ceil_div(seq_q, bq), ceil_div(seq_k, bk)
    b = jnp.arange(batch, dtype=jnp.int32).reshape(-1, 1, 1, 1)
    h = jnp.arange(heads, dtype=jnp.int32).reshape(1, -1, 1, 1)
    probe_i = jax.ShapeDtypeStruct((1, 1, bq, 1), jnp.int32)
    probe_j = jax.ShapeDtypeStruct((1, 1, 1, bk), jnp.int32)
    check_mask_mod(mask_mod, (b, h, probe_i, probe_j), (batch, heads, bq, bk))

    def one(qi: Array, kj: Array) -> Array:
        i = qi * bq + jnp.arange(bq, dtype=jnp.int32).reshape(1, 1, -1, 1)
        j = kj * bk + jnp.arange(bk, dtype=jnp.int32).reshape(1, 1, 1, -1)
        m = jnp.broadcast_to(mask_mod(b, h, i, j), (batch, heads, bq, bk))
        valid = (i < seq_q) & (j < seq_k)  # padding of the last blocks never counts
        some = jnp.any(m & valid, axis=(2, 3))
        every = jnp.all(m | ~valid, axis=(2, 3))
        return jnp.where(some, jnp.where(every, FULL, PARTIAL), EMPTY).astype(jnp.int8)

    @jax.jit
    def build() -> Array:
        rows = jax.lax.map(
            lambda qi: jax.lax.map(lambda kj: one(qi, kj), jnp.arange(num_k, dtype=jnp.int32)),
            jnp.arange(num_q, dtype=jnp.int32),
        )  # (num_q, num_k, batch, heads)
        return jnp.transpose(rows, (2, 3, 0, 1))

    return build()


def block_flags_for(
    block_mask: Any, mask_mod: Any, shapes: Shapes, block_q: int, block_k: int
) -> Array:
    """`block_mask`'s flags for a call of `shapes` blocked `(block_q, block_k)`, in the
    internal layout `(batch|1, kv_heads|1, 1, num_q, num_k)`: a kv head's block is empty
    (full) when it is for every query head grouped on it. Raises naming `block_mask`
    (also when the call has no `mask_mod` for it to summarise, or when it was built
    shared over the batch or the heads while the `mask_mod` reads them)."""
    if mask_mod is None:
        raise ValueError(
            "block_mask summarises a mask_mod: pass the mask_mod it was built from as "
            "mask_mod too; got block_mask without mask_mod"
        )
    if not isinstance(block_mask, BlockMask):
        raise TypeError(
            "block_mask must be a BlockMask from eqx_flash.make_block_mask; got "
            f"{type(block_mask).__name__}"
        )
    built = (block_mask.seq_q, block_mask.seq_k, block_mask.block_q, block_mask.block_k)
    call = (shapes.seq_q, shapes.seq_k, block_q, block_k)
    if built != call:
        raise ValueError(
            "block_mask was built for (seq_q, seq_k, block_q, block_k) = "
            f"{built}, but this call has {call}: build it with make_block_mask(..., "
            f"seq_q={call[0]}, seq_k={call[1]}, block_q={call[2]}, block_k={call[3]})"
        )
    batch_ok = block_mask.batch_shape in ((), shapes.batch_shape) or all(
        n == 1 for n in block_mask.batch_shape)
    heads_ok = block_mask.heads in (1, shapes.heads)
    if not (batch_ok and heads_ok):
        raise ValueError(
            f"block_mask was built for batch_shape={block_mask.batch_shape}, "
            f"heads={block_mask.heads}, but this call has batch_shape={shapes.batch_shape}, "
            f"heads={shapes.heads} (a shared mask may use batch_shape=() and heads=1)"
        )
    reads_batch, reads_head = _dependence(mask_mod, shapes, block_q, block_k)
    built_batch = math.prod(block_mask.batch_shape)
    shared = [name for name, reads, built_n, call_n in (
        ("batch", reads_batch, built_batch, math.prod(shapes.batch_shape)),
        ("head", reads_head, block_mask.heads, shapes.heads),
    ) if reads and built_n == 1 and call_n != 1]
    if shared:
        raise ValueError(
            f"block_mask was built shared over {' and '.join(shared)} (batch_shape="
            f"{block_mask.batch_shape}, heads={block_mask.heads}), but the mask_mod reads "
            f"its {' and '.join(shared)} argument, so the summary would be wrong for this "
            f"call's batch_shape={shapes.batch_shape}, heads={shapes.heads}: build it with "
            f"make_block_mask(mask_mod, {shapes.batch_shape}, {shapes.heads}, ...)"
        )
    return _internal(block_mask.flags, built_batch, block_mask.heads, shapes)


def coarsened(flags: Array, shapes: Shapes, block_q: int, block_k: int, to_q: int,
              to_k: int) -> Array:
    """Flags in the internal layout (`block_flags_for`) for blocks `(block_q, block_k)`,
    summarised for blocks `(to_q, to_k)`, multiples of them: a block is empty where all of
    its smaller blocks are, full where all are (blocks past the sequence hold no pair)."""
    assert to_q % block_q == 0 and to_k % block_k == 0, (block_q, block_k, to_q, to_k)
    fq, fk = to_q // block_q, to_k // block_k
    nq, nk = ceil_div(shapes.seq_q, to_q), ceil_div(shapes.seq_k, to_k)
    *lead, nq_fine, nk_fine = flags.shape
    pad = [(0, 0)] * len(lead) + [(0, nq * fq - nq_fine), (0, nk * fk - nk_fine)]
    some = jnp.pad(flags != EMPTY, pad, constant_values=False)
    every = jnp.pad(flags == FULL, pad, constant_values=True)
    axes = (-3, -1)
    some = some.reshape(*lead, nq, fq, nk, fk).any(axis=axes)
    every = every.reshape(*lead, nq, fq, nk, fk).all(axis=axes)
    return jnp.where(some, jnp.where(every, FULL, PARTIAL), EMPTY).astype(jnp.int8)


class KnownSummary:
    """A block summary known when traced (NumPy flags, internal layout), hashable by
    value, for `KernelConfig.block_summary`."""

    def __init__(self, flags: np.ndarray):
        self.flags = np.asarray(flags, np.int8)
        self._key = (self.flags.shape, self.flags.tobytes())

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KnownSummary) and self._key == other._key

    @classmethod
    def of(cls, flags: Any) -> "KnownSummary | None":
        """`flags` as a known summary, or None where they are traced."""
        if flags is None:
            return None
        try:
            return cls(np.asarray(flags))
        except jax.errors.TracerArrayConversionError:
            return None


def _dependence(mask_mod: Any, shapes: Shapes, block_q: int, block_k: int
                ) -> tuple[bool, bool]:
    """Whether `mask_mod` depends on its `batch` and its `head` argument, read from the
    shape of its result on abstract index arrays (`jax.eval_shape`: nothing is computed)."""
    batch, heads = math.prod(shapes.batch_shape), shapes.heads
    b = jax.ShapeDtypeStruct((batch, 1, 1, 1), jnp.int32)
    h = jax.ShapeDtypeStruct((1, heads, 1, 1), jnp.int32)
    i = jax.ShapeDtypeStruct((1, 1, block_q, 1), jnp.int32)
    j = jax.ShapeDtypeStruct((1, 1, 1, block_k), jnp.int32)
    shape = (1, 1, 1, 1, *jax.eval_shape(mask_mod, b, h, i, j).shape)[-4:]
    return shape[0] != 1, shape[1] != 1


def derived_flags(mask_mod: Any, shapes: Shapes, block_q: int, block_k: int) -> Array:
    """`block_flags_for` a call given a `mask_mod` but no `block_mask`: the summary
    `make_block_mask` would build, evaluated block by block (O(number of blocks) memory),
    over the batch and head axes only where the `mask_mod` depends on them."""
    reads_batch, reads_head = _dependence(mask_mod, shapes, block_q, block_k)
    batch = math.prod(shapes.batch_shape) if reads_batch else 1
    heads = shapes.heads if reads_head else 1
    flags = _flags(mask_mod, batch, heads, shapes.seq_q, shapes.seq_k, block_q, block_k)
    return _internal(flags, batch, heads, shapes)


def _internal(flags: Array, lead_b: int, heads: int, shapes: Shapes) -> Array:
    """Flags `(..., heads, num_q, num_k)` in the internal layout (`block_flags_for`)."""
    num_q, num_k = flags.shape[-2:]
    if heads == 1:
        return flags.reshape(lead_b, 1, 1, num_q, num_k)
    return merged(flags.reshape(lead_b, shapes.kv_heads, shapes.groups, num_q, num_k), 2)


def merged(flags: Any, axis: int | tuple[int, ...]) -> Any:
    """One summary for the block pairs along `axis` (kept, of size 1): empty where all of
    them are, full where all are, partial otherwise. NumPy flags give NumPy flags."""
    xp: Any = np if isinstance(flags, np.ndarray) else jnp
    hi, lo = flags.max(axis=axis, keepdims=True), flags.min(axis=axis, keepdims=True)
    return xp.where(hi == EMPTY, EMPTY, xp.where(lo == FULL, FULL, PARTIAL)).astype(np.int8)
