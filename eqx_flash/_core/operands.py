"""`Operands`: every per-call array of one attention call, as one PyTree.

Masks, segment ids, lengths, the score terms, the arrays a `score_mod`/`mask_mod` reads,
a `mask_mod`'s block summary and the dropout seed travel together from the binder
(`_api.binder`) through layout, padding, the derivative rules, the kernels and the ring.
Each field says in its metadata how it is laid out and whether it is differentiable, so
the code that moves operands around (padding, slicing per head, sharding, the ring, the
derivative wiring) reads the metadata and never names a field; only the code where an
operand acts (`_semantics`, the kernels' per-block math, the reference) reads it by name.

Layouts (`OperandLayout`):

- `GRID`: `(batch|1, kv_heads|1, groups|1, seq_q|1, seq_k|1)`, the internal layout of
  `_core.shapes`, size 1 wherever it broadcasts: padded to whole blocks along the
  sequence axes and sliced per (batch, kv head), after which it is `(groups|1, seq_q|1,
  seq_k|1)`.
- `BLOCKS`: `(batch|1, kv_heads|1, 1, num_q_blocks, num_k_blocks)`: per block pair,
  sliced per (batch, kv head), never padded.
- `SHARED`: any PyTree, handed whole to every head.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array

OperandLayout = Literal["grid", "blocks", "shared"]
GRID: OperandLayout = "grid"
BLOCKS: OperandLayout = "blocks"
SHARED: OperandLayout = "shared"

# How the binder checks a public array argument and brings it into the field's layout
# (`_api.binder.bind_array`):
#   "keys", "pairs": a boolean (or integer, non-zero attends) mask over keys `(*batch,
#       [heads,] seq_k)` or over pairs, broadcastable to `(*batch, heads, seq_q, seq_k)`;
#   "query_ids", "key_ids": integer ids `(*batch, [heads,] seq_q|seq_k)`;
#   "query_lengths", "key_lengths": integer lengths `(*batch,)` in `[0, seq_q|seq_k]`;
#   "float_pairs": a float array broadcastable to `(*batch, heads, seq_q, seq_k)`;
#   "per_head": a float array `(heads,)` or `(*batch, heads)`;
#   "broadcast_per_head": a float array broadcastable to `(*batch, heads)`.
# Fields without a kind are filled by the library (tracing, summaries, the ring).
Kind = Literal["keys", "pairs", "query_ids", "key_ids", "query_lengths", "key_lengths",
               "float_pairs", "per_head", "broadcast_per_head"]


def _operand(layout: OperandLayout, *, argument: str | None = None, kind: Kind | None = None,
             differentiable: bool = False) -> Any:
    return eqx.field(default=None, metadata=dict(
        layout=layout, argument=argument, kind=kind, differentiable=differentiable))


class Operands(eqx.Module):
    """The per-call arrays of one attention call (None: not given). Internal layout.

    The fields are annotated `Any` because the same tree also carries what is derived
    from the arrays field by field: flags (which are wanted), tangents, cotangents and
    `PartitionSpec`s.
    """

    # What attends (`_semantics.masking`).
    key_mask: Any = _operand(GRID, argument="mask", kind="keys")
    pair_mask: Any = _operand(GRID, argument="attn_mask", kind="pairs")
    q_segment_ids: Any = _operand(GRID, argument="q_segment_ids", kind="query_ids")
    kv_segment_ids: Any = _operand(GRID, argument="kv_segment_ids", kind="key_ids")
    # Absolute positions of the rows and columns (packed sequences, chunked prefill):
    # causal, the window and ALiBi are measured on them instead of on indices
    # (`_semantics.masking.position_mask`), int32 `(.., seq_q, 1)` / `(.., 1, seq_k)`.
    q_positions: Any = _operand(GRID, argument="q_positions", kind="query_ids")
    kv_positions: Any = _operand(GRID, argument="kv_positions", kind="key_ids")
    # Terms added to the logits (`_semantics.score_terms`).
    bias: Any = _operand(GRID, argument="bias", kind="float_pairs",
                                  differentiable=True)
    alibi_slopes: Any = _operand(GRID, argument="alibi_slopes", kind="per_head",
                                          differentiable=True)
    # Attention sinks: a per-head logit in every row's softmax denominator. It acts on the
    # kernels' normalised `(out, lse)` (`_semantics.softmax.with_sink`), so the kernels
    # never see it and its derivatives are those of that elementwise step.
    sinks: Any = _operand(GRID, argument="sinks", kind="broadcast_per_head",
                          differentiable=True)
    # Valid lengths (right padding), `(batch|1, 1, 1, 1, 1)` int32.
    q_lengths: Any = _operand(GRID, argument="q_lengths", kind="query_lengths")
    kv_lengths: Any = _operand(GRID, argument="kv_lengths", kind="key_lengths")
    # Where the rows and columns sit in a longer sequence (the ring: a shard's global
    # indices), int32 `(1, 1, 1, seq_q, 1)` and `(1, 1, 1, 1, seq_k)`: the indices ALiBi
    # and `score_mod`/`mask_mod` see. None: the call's own indices.
    q_index: Any = _operand(GRID)
    kv_index: Any = _operand(GRID)
    # A `mask_mod`'s summary per block pair (`_mods.block_mask`), int8.
    block_flags: Any = _operand(BLOCKS, argument="block_mask")
    # The arrays a `score_mod` reads (its PyTree leaves and closed-over tracers,
    # `_mods.tracing`): the floating ones are differentiable, the rest constants.
    score_mod_arrays: Any = _operand(SHARED, argument="score_mod", differentiable=True)
    score_mod_consts: Any = _operand(SHARED)
    mask_mod_arrays: Any = _operand(SHARED, argument="mask_mod")
    # Dropout's 32-bit seed (`_semantics.dropout`).
    dropout_seed: Any = _operand(SHARED)

    @property
    def has_lengths(self) -> bool:
        return self.q_lengths is not None or self.kv_lengths is not None

    @property
    def has_positions(self) -> bool:
        return self.q_positions is not None

    @property
    def has_data_mask(self) -> bool:
        """Whether a mask known only at run time may empty a block (`tile.skip_if_empty`).
        Positions are not counted: their run-time limits (`schedule.position_limits`)
        already skip the blocks they empty, and a check per partial block would cost
        more than the rare empty one it saves (measured 1.12x on a causal window)."""
        return any(x is not None for x in (
            self.key_mask, self.pair_mask, self.q_segment_ids, self.kv_segment_ids,
            self.q_lengths, self.kv_lengths))

    @property
    def has_score_terms(self) -> bool:
        return self.bias is not None or self.alibi_slopes is not None


FIELDS = tuple(f.name for f in dataclasses.fields(Operands))
_METADATA = {f.name: f.metadata for f in dataclasses.fields(Operands)}


def layout_of(name: str) -> OperandLayout:
    return _metadata(name)["layout"]


def _metadata(name: str) -> Mapping[str, Any]:
    return _METADATA[name]


def public_arguments() -> dict[str, str]:
    """`{argument name: field name}` of the operands a caller passes by name."""
    return {_metadata(n)["argument"]: n for n in FIELDS if _metadata(n)["argument"]}


def differentiable_arguments() -> tuple[str, ...]:
    """The public arguments whose floating arrays get gradients (and tangents)."""
    return tuple(_metadata(n)["argument"] for n in FIELDS
                 if _metadata(n)["differentiable"] and _metadata(n)["argument"])


def kind_of(name: str) -> Kind | None:
    return _metadata(name)["kind"]


def replace(ops: Operands, **fields: Any) -> Operands:
    return dataclasses.replace(ops, **fields)


def select(ops: Operands, keep: Callable[[str], bool]) -> Operands:
    """`ops` with the fields `keep` rejects set to None."""
    return dataclasses.replace(ops, **{n: None for n in FIELDS if not keep(n)})


def differentiable_part(ops: Operands) -> Operands:
    return select(ops, is_differentiable)


def constant_part(ops: Operands) -> Operands:
    return select(ops, lambda n: not is_differentiable(n))


def combine(*parts: Operands) -> Operands:
    """The fields of `parts` together (each field set in at most one part)."""
    return dataclasses.replace(parts[0], **{
        n: next((getattr(p, n) for p in parts if getattr(p, n) is not None), None)
        for n in FIELDS})


def map_fields(fn: Callable[..., Any], ops: Operands, *rest: Any) -> Operands:
    """`fn(name, value, *values of rest)` for every field set in `ops` (each of `rest`
    an Operands-shaped tree, e.g. of tangents or flags); unset fields stay None."""
    return dataclasses.replace(ops, **{
        n: None if getattr(ops, n) is None else fn(n, getattr(ops, n),
                                                     *(getattr(r, n) for r in rest))
        for n in FIELDS})


def partition_specs(
    ops: Operands, mesh_axes: Mapping[int, Any] | Callable[[str, Any], Mapping[int, Any]],
) -> Operands:
    """Each operand's `PartitionSpec` for `jax.shard_map`: a `GRID` or `BLOCKS` operand's
    axis `a` over `mesh_axes[a]` (a mesh axis name, or a tuple of them) where it is not
    broadcast (size 1) there; `SHARED` operands replicated. `mesh_axes` may depend on the
    operand: a function of its name and value."""

    def spec(name: str, x: Any) -> Any:
        if layout_of(name) == SHARED:
            return jax.tree.map(lambda _: PartitionSpec(), x)
        by_axis = mesh_axes(name, x) if callable(mesh_axes) else mesh_axes
        axes = [by_axis.get(a) if x.shape[a] != 1 else None for a in range(x.ndim)]
        return PartitionSpec(*axes)

    return map_fields(spec, ops)


def pad_axis(x: Array, axis: int, size: int) -> Array:
    """`x` zero-padded along `axis` to `size` (an axis of size 1 broadcasts: kept)."""
    return x if x.shape[axis] == 1 else pad_sequence(x, axis, size)


def pad_sequence(x: Array, axis: int, size: int) -> Array:
    """q, k or v zero-padded along its sequence `axis` to `size`: unlike `pad_axis`, a
    sequence of one position is padded too (it is a length, not a broadcast)."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def padded(ops: Operands, seq_q: int | None, seq_k: int | None) -> Operands:
    """The `GRID` operands padded along their sequence axes (-2, -1) to `seq_q`, `seq_k`
    (None: that axis as it is). Padding is never attended: the kernels mask it by
    position, so the values it gets do not matter."""

    def pad(name: str, x: Any) -> Any:
        if layout_of(name) != GRID:
            return x
        if seq_q is not None:
            x = pad_axis(x, -2, seq_q)
        return x if seq_k is None else pad_axis(x, -1, seq_k)

    return map_fields(pad, ops)


def block(ops: Operands, q_start: Array | int, k_start: Array | int, block_q: int,
          block_k: int) -> Operands:
    """The values of one block of `ops`: each `GRID` field sliced to rows `[q_start,
    q_start + block_q)` and columns `[k_start, k_start + block_k)` of its sequence axes
    (-2, -1), except where it broadcasts (size 1); the `BLOCKS` and `SHARED` fields as
    they are. What `_semantics` evaluates: a kernel that loads its blocks itself (from
    refs) builds the same values, and a whole grid is one block."""

    def cut(name: str, x: Any) -> Any:
        if layout_of(name) != GRID:
            return x
        if x.shape[-2] != 1:
            x = jax.lax.dynamic_slice_in_dim(x, q_start, block_q, axis=-2)
        if x.shape[-1] != 1:
            x = jax.lax.dynamic_slice_in_dim(x, k_start, block_k, axis=-1)
        return x

    return map_fields(cut, ops)


def add_block(acc: Operands, part: Operands, q_start: Array | int, k_start: Array | int
              ) -> Operands:
    """`acc` with one block's cotangents `part` added where the block sits (`block`'s
    inverse, for the fields `acc` accumulates; `part` cast to their dtypes). `GRID`
    fields only: the others are accumulated by the kernels themselves."""

    def add(name: str, a: Any, p: Any) -> Any:
        if p is None:
            return a
        assert layout_of(name) == GRID, name
        p = p.astype(a.dtype)
        if p.shape == a.shape:
            return a + p
        # One index dtype (under jax_enable_x64 a Python int is int64).
        starts = tuple(jnp.asarray(x, jnp.int32) for x in (
            *(0,) * (a.ndim - 2), q_start if a.shape[-2] != 1 else 0,
            k_start if a.shape[-1] != 1 else 0))
        old = jax.lax.dynamic_slice(a, starts, p.shape)
        return jax.lax.dynamic_update_slice(a, old + p, starts)

    return map_fields(add, acc, part)


def per_head_part(ops: Operands) -> tuple[Operands, Operands]:
    """`(sliced, shared)`: the fields with leading (batch, kv head) axes, and the rest."""
    shared = select(ops, lambda n: layout_of(n) == SHARED)
    return select(ops, lambda n: layout_of(n) != SHARED), shared


def reduce_to(name: str, grad: Any, like: Any) -> Any:
    """A cotangent computed per (batch, kv head) — stacked on two leading axes — summed
    where operand `name` (`like`) broadcasts over them, in `like`'s dtype."""
    if layout_of(name) == SHARED:
        return jax.tree.map(lambda g, x: g.sum(axis=(0, 1)).astype(x.dtype), grad, like)
    axes = tuple(a for a in (0, 1) if like.shape[a] == 1)
    return grad.sum(axis=axes, keepdims=True).astype(like.dtype)


def is_differentiable(name: str) -> bool:
    return _metadata(name)["differentiable"]


def zeros_for(diff: Operands, wanted: Operands, dtype: Any) -> Operands:
    """Accumulators for the wanted cotangents of the differentiable operands `diff`:
    zeros in `dtype` where the flags `wanted` (shaped as `diff`) say, None elsewhere."""
    return map_fields(lambda _, x, want: jax.tree.map(
        lambda a, w: None if a is None or not w else jnp.zeros_like(a, dtype), x, want,
        is_leaf=lambda a: a is None), diff, wanted)


def add_cotangents(acc: Operands, part: Operands) -> Operands:
    """`acc + part` for every cotangent `acc` accumulates, in `acc`'s dtypes."""
    return map_fields(lambda _, a, p: jax.tree.map(
        lambda x, y: x + y.astype(x.dtype), a, p), acc, part)
