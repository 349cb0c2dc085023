"""All-gather context parallelism (kvax, Llama-3 style): every device gets all the keys.

q stays sharded along the sequence; k and v are all-gathered along it inside
`jax.shard_map`, and each device attends its own queries to every key with the
single-device kernels (`_api.flash.attend`: forward mode and second-order derivatives
included). The backward pass is the transpose of the gather: a reduce-scatter of dk and
dv. k and v cost O(seq) per device (the queries, outputs and their gradients
O(seq / devices)). Batch and heads may be sharded over other mesh axes at the same time.

The operands are the bound call's (internal layout), so how each is sharded follows from
its shape alone: the query rows of a `GRID` operand go with the queries, its key columns
stay whole on every device (as k and v do once gathered), its batch and kv-head axes
follow `batch_axis` and `head_axis`.

A device's queries sit at a global offset known only at run time (its axis index), so
causal, the window and ALiBi are measured on positions (`q_positions`/`kv_positions`):
the caller's, else each query's global index aligned bottom-right (on the valid lengths
when given), built once for the whole sequence and sharded with the queries, so that each
device's kernels skip the key blocks out of reach at run time. Valid query lengths become
each piece's own; a user's `score_mod`/`mask_mod` are called with global batch, head and
query indices (and ALiBi with lengths, which `flash_attention` aligns on the sequences,
not the lengths, joins the `score_mod`). For causal or windowed attention the queries are
balanced with the zigzag layout (device `d` holds chunks `d` and `2n - 1 - d`), each
chunk attended on its own.
"""

import dataclasses
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array

from .._api.binder import Bound
from .._api.flash import attend
from .._core.operands import SHARED, Operands, layout_of, map_fields, partition_specs, replace
from .._core.shapes import Shapes
from .._mods.tracing import with_index_offsets
from .sequence_order import from_ring_layout, to_ring_layout

ROWS = 3  # the query axis of a GRID operand (`_core.operands`)


def check_all_gather(shapes: Shapes, n: int, head_devices: int) -> None:
    """ValueError unless the sequences split over `n` devices and the kv heads over
    `head_devices`."""
    for name, seq in (("seq_q", shapes.seq_q), ("seq_k", shapes.seq_k)):
        if seq % n:
            raise ValueError(f"strategy='all_gather' splits the sequence over {n} devices; "
                             f"{name}={seq} is not divisible by {n}")
    if shapes.kv_heads % head_devices:
        raise ValueError(f"strategy='all_gather' with head_axis splits the kv heads over "
                         f"{head_devices} devices; got heads={shapes.heads}, "
                         f"kv_heads={shapes.kv_heads}")


def _with_positions(bound: Bound) -> tuple[Bound, Array | None]:
    """The call with causal, the window and ALiBi on positions, where they need the
    queries' global offset: the caller's positions, else each query's global index
    aligned bottom-right as `flash_attention` aligns it (on the valid lengths when
    given). With lengths, ALiBi (which `flash_attention` aligns on the sequences) is
    taken out and returned, for `_alibi_score_mod`."""
    ops, shapes, window = bound.operands, bound.shapes, bound.options.window
    if ops.has_positions:
        return bound, None
    slopes = None
    if ops.alibi_slopes is not None and ops.has_lengths:
        slopes, ops = ops.alibi_slopes, replace(ops, alibi_slopes=None)
    if not window.is_unbounded or ops.alibi_slopes is not None:
        shift: Any = shapes.seq_k - shapes.seq_q
        if ops.has_lengths:
            q_len = shapes.seq_q if ops.q_lengths is None else ops.q_lengths
            kv_len = shapes.seq_k if ops.kv_lengths is None else ops.kv_lengths
            shift = jnp.asarray(kv_len - q_len, jnp.int32)  # (batch|1, 1, 1, 1, 1)
        ops = replace(
            ops, q_positions=shift + jnp.arange(shapes.seq_q, dtype=jnp.int32).reshape(
                1, 1, 1, -1, 1),
            kv_positions=jnp.arange(shapes.seq_k, dtype=jnp.int32).reshape(1, 1, 1, 1, -1))
    return dataclasses.replace(bound, operands=ops), slopes


def _alibi_score_mod(slopes: Array | None, shapes: Shapes, score_mod: Any) -> Any:
    """ALiBi on indices aligned on the sequences (`flash_attention`'s with lengths) as a
    `score_mod` in front of `score_mod`, called with global indices; `slopes` internal
    `(batch|1, kv_heads|1, groups|1, 1, 1)` (None: `score_mod` as it is)."""
    if slopes is None:
        return score_mod
    shift = shapes.seq_k - shapes.seq_q
    per_head = jnp.broadcast_to(slopes, (slopes.shape[0], shapes.kv_heads, shapes.groups, 1,
                                         1)).reshape(slopes.shape[0], shapes.heads)

    def score(s, b, h, i, j):
        row = b if per_head.shape[0] > 1 else 0
        s = s - per_head[row, h].astype(s.dtype) * jnp.abs(i + shift - j).astype(s.dtype)
        return s if score_mod is None else score_mod(s, b, h, i, j)

    return score


def _rows(ops: Operands, start: int, size: int, first: Any) -> Operands:
    """One piece of a device's queries: the operands' rows `[start, start + size)`, whose
    first global query is `first` (valid query lengths become the piece's own)."""

    def piece(name: str, x: Any) -> Any:
        if name == "q_lengths":
            return jnp.clip(x - first, 0, size)
        if layout_of(name) == SHARED or x.shape[ROWS] == 1:
            return x
        return jax.lax.slice_in_dim(x, start, start + size, axis=ROWS)

    return map_fields(piece, ops)


def all_gather_attention(bound: Bound, *, mesh: Mesh, seq_axis: Hashable,
                         batch_axis: Hashable | None, head_axis: Hashable | None
                         ) -> tuple[Array, ...]:
    """`attend(bound)` with the sequence of q, k, v sharded over `seq_axis` (and batch,
    heads over `batch_axis`, `head_axis`), k and v all-gathered; results as `attend`'s,
    sharded along the sequence like q."""
    shapes, window = bound.shapes, bound.options.window
    n = mesh.shape[seq_axis]
    head_devices = 1 if head_axis is None else mesh.shape[head_axis]
    check_all_gather(shapes, n, head_devices)
    batch_devices = 1 if batch_axis is None else mesh.shape[batch_axis]
    bound, alibi = _with_positions(bound)
    zigzag = not window.is_unbounded and shapes.seq_q % (2 * n) == 0
    pieces = 2 if zigzag else 1
    chunk = shapes.seq_q // (n * pieces)
    layout = "zigzag" if zigzag else "contiguous"

    def order(x: Array, axis: int, inverse: bool = False) -> Array:
        move = from_ring_layout if inverse else to_ring_layout
        return move(x, num_devices=n, layout=layout, axis=axis)

    # The query rows in the layout's order, so that contiguous shards are the devices'.
    q = order(bound.q, -2)
    ops = map_fields(lambda name, x: x if layout_of(name) == SHARED or x.shape[ROWS] == 1
                     else order(x, ROWS), bound.operands)
    # The first batch axis (if any) is split over `batch_axis`.
    local_batch = tuple(n // batch_devices if i == 0 else n
                        for i, n in enumerate(shapes.batch_shape))
    local = dataclasses.replace(
        shapes, batch_shape=local_batch, seq_q=chunk,
        heads=shapes.heads // head_devices, kv_heads=shapes.kv_heads // head_devices)

    def body(q, k, v, ops, alibi):
        score_mod = _alibi_score_mod(alibi, shapes, bound.score_mod)
        k, v = (jax.lax.all_gather(x, seq_axis, axis=x.ndim - 2, tiled=True) for x in (k, v))
        me = jax.lax.axis_index(seq_axis)
        batch = 0 if batch_axis is None else jax.lax.axis_index(batch_axis) * local.batch
        head = 0 if head_axis is None else jax.lax.axis_index(head_axis) * local.heads
        results = []
        for piece in range(pieces):
            start = piece * chunk
            first = (me if piece == 0 else 2 * n - 1 - me) * chunk  # its first global query
            mine = dataclasses.replace(
                bound, q=jax.lax.slice_in_dim(q, start, start + chunk, axis=q.ndim - 2),
                k=k, v=v, operands=_rows(ops, start, chunk, first), shapes=local,
                score_mod=with_index_offsets(score_mod, batch, head, first, True),
                mask_mod=with_index_offsets(bound.mask_mod, batch, head, first, False))
            results.append(attend(mine))
        # out's rows are axis -2, the statistics' -1.
        return tuple(jnp.concatenate(parts, axis=-2 if i == 0 else -1)
                     for i, parts in enumerate(zip(*results, strict=True)))

    lead = len(shapes.batch_shape)
    batch_spec = [batch_axis if i == 0 else None for i in range(lead)]
    heads_spec = [head_axis] if shapes.has_heads_axis else []
    qkv_spec = PartitionSpec(*batch_spec, *heads_spec, seq_axis, None)
    stat_spec = PartitionSpec(*batch_spec, *heads_spec, seq_axis)
    stats = 2 if bound.return_max_scores else 1
    mapped = jax.shard_map(
        body, mesh=mesh,
        in_specs=(qkv_spec, qkv_spec, qkv_spec,
                  partition_specs(ops, {0: batch_axis, 1: head_axis, ROWS: seq_axis}),
                  PartitionSpec()),
        out_specs=(qkv_spec, *([stat_spec] * stats)),
        check_vma=False,  # the blockwise kernels create unsharded accumulators
    )
    out, *rest = mapped(q, bound.k, bound.v, ops, alibi)
    return (order(out, -2, inverse=True), *(order(x, -1, inverse=True) for x in rest))

