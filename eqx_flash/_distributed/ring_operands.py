"""Operands on the ring (`ring`): the role each one plays, its pieces, and the operands of
one chunk pair.

A device keeps its query rows while key chunks visit it, one ring step at a time. By its
shape, each per-head operand of the call (`GRID` in `_core.operands`) takes one role
(`role_of`):

- `"rows"`: per query (query segment ids): cut into the device's query pieces; stays.
- `"travelling"`: per key and not differentiable (a key mask, key segment ids): cut into
  key pieces, it travels round the ring with k and v.
- `"columns"`: per (query, key), or per key and differentiable (a bias): the device's
  query rows against *every* key, the key columns in ring order (`to_ring_layout`). It
  stays, and each ring step slices the columns of the visiting key chunk
  (`column_block`), so nothing extra travels and each device holds `seq_q * seq_k /
  devices` entries (rotating columns with the keys would need the same memory and a
  transfer per step). Its cotangent accumulates in the same place.
- `"common"`: per neither (ALiBi slopes), and every `SHARED` operand (a score_mod's
  arrays): the same for every pair.

ALiBi and `score_mod`/`mask_mod` see global indices, which depend on the pair of devices
meeting at a ring step, a run-time value, while the kernels' diagonal offset is static
(and reset for unmasked pairs). So the pair's global indices reach the kernels as
operands (`Operands.q_index`/`kv_index`), which also covers the striped layout, where
they are not a shifted range.
"""

from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._core.operands import (
    GRID,
    Operands,
    combine,
    constant_part,
    differentiable_part,
    is_differentiable,
    layout_of,
    map_fields,
    pad_axis,
    select,
)
from .sequence_order import chunk_index

Role = Literal["rows", "travelling", "columns", "common"]


def role_of(name: str, x: Any) -> Role:
    """The role of operand `name` (value `x`) on the ring (module docstring)."""
    if layout_of(name) != GRID:
        return "common"
    per_query, per_key = x.shape[-2] != 1, x.shape[-1] != 1
    if per_key and not per_query and not is_differentiable(name):
        return "travelling"
    if per_key:
        return "columns"
    return "rows" if per_query else "common"


def with_roles(ops: Operands, *roles: Role) -> Operands:
    """`ops`' operands of the given roles."""
    return select(ops, lambda n: getattr(ops, n) is not None
                  and role_of(n, getattr(ops, n)) in roles)


class RingOperands(NamedTuple):
    """A device's operands cut for the ring."""

    home: tuple[Operands, ...]  # per query piece: the "rows" and "columns" operands
    travelling: tuple[Operands, ...]  # per key piece
    common: Operands


def _pieces(x: Array, axis: int, count: int, padded: int) -> tuple[Array, ...]:
    """`x` cut into `count` equal pieces along `axis`, each zero-padded to `padded`
    (an axis of size 1 broadcasts and stays whole)."""
    if x.shape[axis] == 1:
        return (x,) * count
    return tuple(pad_axis(p, axis, padded) for p in jnp.split(x, count, axis=axis))


def bias_columns(x: Array, chunks: int, padded: int) -> Array:
    """Cut the key axis of a `"columns"` operand into `chunks` equal chunks, each
    zero-padded to `padded` columns (as the key pieces are), so that chunk `c` is one
    slice."""
    chunk = x.shape[-1] // chunks
    x = x.reshape(*x.shape[:-1], chunks, chunk)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded - chunk)])
    return x.reshape(*x.shape[:-2], chunks * padded)


def cut_for_ring(ops: Operands, pieces: int, chunks: int, pad_q: int, pad_k: int
                 ) -> RingOperands:
    """A device's operands (the internal layout, unpadded; `"columns"` ones against every
    key of the `chunks` chunks of the ring) cut into its `pieces` query and key pieces,
    each padded to `pad_q` / `pad_k`."""

    def piece(i: int):
        def cut(name: str, x: Any) -> Any:
            role = role_of(name, x)
            if role == "columns":
                x = bias_columns(x, chunks, pad_k)
            if role in ("rows", "columns"):
                return _pieces(x, -2, pieces, pad_q)[i]
            return _pieces(x, -1, pieces, pad_k)[i] if role == "travelling" else x
        return cut

    home = tuple(map_fields(piece(i), with_roles(ops, "rows", "columns"))
                 for i in range(pieces))
    travelling = tuple(map_fields(piece(i), with_roles(ops, "travelling"))
                       for i in range(pieces))
    return RingOperands(home, travelling, with_roles(ops, "common"))


def column_block(x: Array, chunk: Array, padded: int) -> Array:
    """Key chunk `chunk`'s columns of a `bias_columns` array."""
    return jax.lax.dynamic_slice_in_dim(x, chunk * padded, padded, axis=-1)


def put_column_block(x: Array, block: Array, chunk: Array, padded: int) -> Array:
    """`x` with chunk `chunk`'s columns replaced by `block` (the inverse of `column_block`)."""
    return jax.lax.dynamic_update_slice_in_dim(x, block, chunk * padded, axis=-1)


def at_chunk(home: Operands, chunk: Array, padded: int) -> Operands:
    """`home`'s operands for the key chunk `chunk`: the `"columns"` ones sliced."""
    return map_fields(lambda n, x: column_block(x, chunk, padded)
                      if role_of(n, x) == "columns" else x, home)


def put_at_chunk(home: Operands, part: Operands, chunk: Array, padded: int) -> Operands:
    """The inverse of `at_chunk`: `part`'s `"columns"` operands written back into `home`."""
    return map_fields(lambda n, x, p: put_column_block(x, p, chunk, padded)
                      if role_of(n, x) == "columns" else p, home, part)


def global_index(
    layout: str, num_devices: int, device: Array, piece: int, length: int, padded: int
) -> Array:
    """Global indices of the `length` tokens of `piece` on `device` (a run-time index),
    padded on with more to `padded` entries (padding is masked, its values unused)."""
    local = jnp.arange(padded, dtype=jnp.int32)
    if layout == "striped":  # device i holds tokens i, i + n, i + 2n, ...
        return device + num_devices * local
    chunks = jnp.asarray([chunk_index(layout, num_devices, d, piece) for d in range(num_devices)])
    return chunks[device] * length + local


def pair_operands(
    home: Operands, travelling: Operands, common: Operands, chunk: Array, padded_k: int,
    q_index: Array | None, kv_index: Array | None,
) -> Operands:
    """The operands of a query piece (`home`) against the key piece of global ring chunk
    `chunk` (`travelling`), at global indices `q_index` and `kv_index` (None: not
    needed)."""
    indices = Operands(
        q_index=None if q_index is None else q_index.reshape(1, 1, 1, -1, 1),
        kv_index=None if kv_index is None else kv_index.reshape(1, 1, 1, 1, -1),
    )
    return combine(at_chunk(home, chunk, padded_k), travelling, common, indices)


def split_differentiable(ring_ops: RingOperands
                         ) -> tuple[tuple[tuple[Operands, ...], Operands], RingOperands]:
    """`((home parts, common part), constants)`: the differentiable operands (none of
    them travels) and the rest."""
    diff = (tuple(differentiable_part(h) for h in ring_ops.home),
            differentiable_part(ring_ops.common))
    const = RingOperands(tuple(constant_part(h) for h in ring_ops.home), ring_ops.travelling,
                         constant_part(ring_ops.common))
    return diff, const


def join_differentiable(const: RingOperands, home: tuple[Operands, ...], common: Operands
                        ) -> RingOperands:
    """The inverse of `split_differentiable`."""
    return RingOperands(tuple(combine(d, c) for d, c in zip(home, const.home, strict=True)),
                        const.travelling, combine(common, const.common))
