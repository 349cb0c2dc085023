"""DeepSpeed-Ulysses sequence parallelism: trade sequence shards for head shards.

q, k and v arrive sharded along the sequence. Inside `jax.shard_map`, one `all_to_all`
per array turns that into sharding along the heads: each device then holds the *whole*
sequence for `heads / devices` query heads (and their kv heads), runs the single-device
kernels on it (`_api.flash.attend`: every option, its jvp and second-order derivatives
included, since those are the single-device kernels' own), and a second `all_to_all`
turns the outputs back into sequence shards. Activations stay O(N / devices) per device;
per-call arrays that span the sequence (masks, segment ids, a bias) are handed to each
device whole for its heads.

Grouped-query attention: the kv heads are split over the devices with their query heads
when the device count divides them; when it is a multiple of them instead, each kv head
is repeated `devices / kv_heads` times first (each device then holds one kv head, the one
its query heads read, and the repeats' gradients are summed back by the transpose of the
repeat). Otherwise a `ValueError` names the head counts and the axis size.
"""

import dataclasses
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from .._api.binder import Bound
from .._api.flash import attend
from .._core.operands import SHARED, Operands, layout_of, map_fields, partition_specs
from .._mods.tracing import with_index_offsets


def _check_head_split(shapes, n: int, head_devices: int) -> int:
    """The kv-head repeat factor (1: none) for `n` devices along the sequence axis and
    `head_devices` along the heads axis, or a ValueError."""
    heads, kv_heads = shapes.heads, shapes.kv_heads
    if not shapes.has_heads_axis:
        raise ValueError("strategy='ulysses' shards the heads axis; q has none "
                         f"(q.shape has no heads axis: batch_shape={shapes.batch_shape})")
    devices = n * head_devices
    if heads % devices:
        raise ValueError(
            f"strategy='ulysses' needs the number of query heads divisible by the devices "
            f"it spreads them over; got heads={heads}, kv_heads={kv_heads}, seq axis size "
            f"{n}" + (f" x head axis size {head_devices}" if head_devices > 1 else ""))
    if kv_heads % devices == 0:
        return 1
    if devices % kv_heads == 0:
        return devices // kv_heads
    raise ValueError(
        f"strategy='ulysses' needs the kv heads divisible by the devices, or the devices by "
        f"the kv heads; got heads={heads}, kv_heads={kv_heads}, {devices} devices")


def _repeat_kv_heads(ops: Operands, kv_heads: int, groups: int, repeat: int) -> Operands:
    """Operands in the internal layout `(batch|1, kv_heads|1, groups|1, ...)` for the kv
    heads repeated `repeat` times: `(batch|1, kv_heads * repeat, groups / repeat, ...)`.
    One that varies over the groups has its kv-heads axis spelled out and is reshaped;
    one that varies over kv heads only is repeated."""

    def one(name: str, x: Any) -> Any:
        if layout_of(name) == SHARED or (x.shape[1] == 1 and x.shape[2] == 1):
            return x
        if x.shape[2] == groups and groups > 1:
            x = jnp.broadcast_to(x, (x.shape[0], kv_heads, *x.shape[2:]))
            return x.reshape(x.shape[0], kv_heads * repeat, groups // repeat, *x.shape[3:])
        return jnp.repeat(x, repeat, axis=1)

    return map_fields(one, ops)


def ulysses_attention(bound: Bound, *, mesh: Mesh, seq_axis: Hashable,
                      batch_axis: Hashable | None, head_axis: Hashable | None
                      ) -> tuple[Any, ...]:
    """`attend(bound)` with the sequence of q, k, v sharded over `seq_axis` (and batch,
    heads over `batch_axis`, `head_axis`), computed Ulysses-style; results as `attend`'s,
    sharded along the sequence like q."""
    shapes = bound.shapes
    n = mesh.shape[seq_axis]
    head_devices = 1 if head_axis is None else mesh.shape[head_axis]
    repeat = _check_head_split(shapes, n, head_devices)
    k, v, ops = bound.k, bound.v, bound.operands
    if repeat > 1:
        k, v = (jnp.repeat(x, repeat, axis=-3) for x in (k, v))
        ops = _repeat_kv_heads(ops, shapes.kv_heads, shapes.groups, repeat)
    devices = n * head_devices
    local = dataclasses.replace(shapes, heads=shapes.heads // devices,
                                kv_heads=shapes.kv_heads * repeat // devices)
    lead = len(shapes.batch_shape)
    batch = [batch_axis if batch_axis is not None and i == 0 else None for i in range(lead)]
    qkv_spec = PartitionSpec(*batch, head_axis, seq_axis, None)
    stat_spec = PartitionSpec(*batch, head_axis, seq_axis)
    heads_spec = seq_axis if head_axis is None else (head_axis, seq_axis)
    # The mods' batch index is flat over q's leading axes, the first of them sharded.
    local_batch = shapes.batch // mesh.shape[batch_axis] if batch_axis else 0

    def body(q, k, v, ops):
        # Sequence shards -> head shards: the whole sequence, heads / devices of them.
        q, k, v = (jax.lax.all_to_all(x, seq_axis, x.ndim - 3, x.ndim - 2, tiled=True)
                   for x in (q, k, v))
        offset = jax.lax.axis_index(seq_axis) * local.heads
        if head_axis is not None:
            offset = offset + jax.lax.axis_index(head_axis) * local.heads * n
        batch_offset = 0 if batch_axis is None else jax.lax.axis_index(batch_axis) * local_batch
        mine = dataclasses.replace(
            bound, q=q, k=k, v=v, operands=ops, shapes=dataclasses.replace(
                local, batch_shape=(q.shape[:lead])),
            score_mod=with_index_offsets(bound.score_mod, batch_offset, offset, 0, True),
            mask_mod=with_index_offsets(bound.mask_mod, batch_offset, offset, 0, False))
        results = attend(mine)
        # ...and back: out (*, h, seq, dv), lse and max scores (*, h, seq).
        out, *stats = results
        out = jax.lax.all_to_all(out, seq_axis, out.ndim - 2, out.ndim - 3, tiled=True)
        stats = [jax.lax.all_to_all(x, seq_axis, x.ndim - 1, x.ndim - 2, tiled=True)
                 for x in stats]
        return (out, *stats)

    num_stats = 2 if bound.return_max_scores else 1
    mapped = jax.shard_map(
        body, mesh=mesh,
        in_specs=(qkv_spec, qkv_spec, qkv_spec,
                  partition_specs(ops, {0: batch_axis, 1: heads_spec})),
        out_specs=(qkv_spec, *([stat_spec] * num_stats)),
        # The blockwise kernels create unsharded accumulators (as on the ring).
        check_vma=False,
    )
    return mapped(bound.q, k, v, ops)
