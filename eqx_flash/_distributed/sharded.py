"""Global-array entry point for sequence-parallel attention.

`sharded_flash_attention` takes and returns global arrays and binds them; then, with
`strategy="ring"` (the default), it brings them into the internal layout, reorders the
sequence for the chosen layout, runs the ring (`ring.ring_attention`) under
`jax.shard_map` over the sequence mesh axis (batch and heads may be sharded over other
axes at the same time), and restores the order. How each operand is sharded and
reordered follows from its role on the ring (`ring_operands.role_of`). With
`strategy="ulysses"` it hands the bound call to `ulysses.ulysses_attention`, with
`strategy="all_gather"` the checked arguments to `all_gather.all_gather_attention`.
"""

import dataclasses
import functools
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from beartype import beartype
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, jaxtyped

from .._api.binder import bind, is_concrete, refuse
from .._core.operands import SHARED, Operands, layout_of, map_fields, partition_specs, replace
from .._core.options import AttentionOptions
from .._core.shapes import Shapes, merge_heads, split_heads
from .._core.types import (
    AlibiSlopes,
    Attended,
    Bias,
    BlockSize,
    Flag,
    KernelsName,
    Key,
    KeyMask,
    KeyPositions,
    KeySegmentIds,
    Lengths,
    MaskMod,
    OptionalReal,
    Query,
    QueryPositions,
    QuerySegmentIds,
    ScoreMod,
    Sinks,
    Value,
    WindowLike,
)
from .._mods.block_mask import BlockMask
from .._semantics.masking import lengths_or, valid_rows
from .._semantics.softmax import with_sink
from .all_gather import all_gather_attention
from .ring import Ring, ring_attention, ring_of
from .ring_operands import role_of
from .sequence_order import (
    Layout,
    check_layout,
    from_ring_layout,
    ring_order,
    to_ring_layout,
    zigzag_in_map,
)
from .ulysses import ulysses_attention

STRATEGIES = ("ring", "ulysses", "all_gather")


@jaxtyped(typechecker=beartype)
def sharded_flash_attention(
    q: Query,
    k: Key,
    v: Value,
    mask: KeyMask | None = None,
    *,
    mesh: Mesh,
    seq_axis: str,
    batch_axis: str | None = None,
    head_axis: str | None = None,
    layout: Layout | None = None,
    causal: Flag = False,
    window: WindowLike = None,
    q_segment_ids: QuerySegmentIds | None = None,
    kv_segment_ids: KeySegmentIds | None = None,
    q_lengths: Lengths | None = None,
    kv_lengths: Lengths | None = None,
    q_positions: QueryPositions | None = None,
    kv_positions: KeyPositions | None = None,
    scale: OptionalReal = None,
    softcap: OptionalReal = None,
    block_q: BlockSize = None,
    block_k: BlockSize = None,
    kernels: KernelsName = None,
    bias: Bias | None = None,
    alibi_slopes: AlibiSlopes | None = None,
    sinks: Sinks | None = None,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    block_mask: BlockMask | None = None,
    return_max_scores: Flag = False,
    strategy: str = "ring",
) -> Attended:
    """`flash_attention` on global arrays, with the sequence sharded over `mesh`.

    **Arguments:**

    - `q`, `k`, `v`, `mask`, `causal`, `window`, `q_segment_ids`, `kv_segment_ids`,
        `scale`, `softcap`, `block_q`, `block_k`, `kernels`: as in `flash_attention`
        (global arrays; `kernels` picks the family each device's kernels come from).
    - `q_lengths`, `kv_lengths`: as in `flash_attention`, carried round the ring as
        segment ids (padding gets ids no valid row has, and is zeroed so that NaN there
        reaches nothing); blocks past the lengths are still computed. With `causal` or a
        `window`, `kv_lengths - q_lengths` must equal `seq_k - seq_q` (as for padded
        self-attention with equal lengths), since the ring aligns them on the global
        sequence: otherwise a `ValueError` for concrete lengths; under `jax.jit`, where no
        value check may abort a multi-device program, the lengths are shrunk to the
        largest pair with that difference (`q_lengths = min(q_lengths, kv_lengths -
        (seq_k - seq_q))`, `kv_lengths = min(kv_lengths, q_lengths + (seq_k - seq_q))`),
        giving `flash_attention`'s result for those lengths (with positions no such
        condition: the lengths only mark the padding). Lengths outside `[0, seq]`
        are clamped under `jax.jit` as in `flash_attention`.
    - `q_positions`, `kv_positions`: as in `flash_attention` (global arrays), under
        every strategy: the ring carries the key positions with k and v and runs every
        chunk pair (blocks out of reach skipped at run time), Ulysses hands each device
        the whole sequence's positions, all_gather shards the query positions with the
        queries.
    - `sinks`: as in `flash_attention`, counted once per row; differentiable.
    - `return_max_scores`: as in `flash_attention`, reduced over the ring.
    - `bias`, `alibi_slopes`: as in `flash_attention` (global arrays; ALiBi at global
        positions), both differentiable. The bias is reordered with the sequence and
        sharded by query rows: each device holds its queries' rows against all keys,
        `seq_q * seq_k / devices` entries (`ring_flash_attention`).
    - `mesh`: a `jax.sharding.Mesh`.
    - `seq_axis`: mesh axis the sequence is split over (the ring).
    - `batch_axis`: optional mesh axis for the first leading axis of q, k, v (data
        parallel).
    - `head_axis`: optional mesh axis for the heads axis (tensor parallel); must divide
        the number of kv heads.
    - `layout`: sequence order on the ring (see `ring_flash_attention`). Default:
        `"zigzag"` for causal or windowed attention when the lengths allow (balanced
        work), else `"contiguous"`. Ring only.
    - `strategy`: `"ring"` (default): k and v travel round the devices, each attending
        its own queries to one shard at a time (first-order derivatives, forward and
        reverse). `"ulysses"` (DeepSpeed-Ulysses): an all-to-all turns the sequence
        shards of q, k, v into
        head shards, each device runs the single-device kernels on the whole sequence
        for `heads / devices` heads, and a second all-to-all turns the result back. The
        query heads must be divisible by the devices (the seq axis's, times the head
        axis's), and the kv heads divisible by them or a divisor of them (then each kv
        head is repeated); otherwise a `ValueError`. Under it every option works as in
        `flash_attention` — `score_mod` and `mask_mod` too, with global head indices —
        and so do forward mode and second-order derivatives; `block_mask` raises
        `NotImplementedError` (pass the mask_mod alone: each device summarises it).
        `"all_gather"` (kvax, Llama-3 context parallelism): k and v all-gathered, each
        device's queries (zigzag-balanced for causal/window) against every key with the
        single-device kernels; the backward reduce-scatters dk and dv. k and v cost
        O(seq) per device. Every option works (causal, the window and ALiBi measured on
        the queries' global positions, a `score_mod`/`mask_mod` called with global
        indices), with `batch_axis` and `head_axis` too (the kv heads divisible by the
        head axis), and so do forward mode and second order; `block_mask` and `layout`
        raise `NotImplementedError`.

    **Returns:**

    `(out, lse)` (and the max scores) as `flash_attention` returns them, as global arrays
    sharded like q.

    On the ring, `score_mod`, `mask_mod` and `block_mask` raise `NotImplementedError`:
    use `strategy="ulysses"`, `alibi_slopes`/`bias` and causal/window/segment ids, or
    `ring_flash_attention` (which takes `score_mod`/`mask_mod`) inside your own
    `jax.shard_map`.
    """
    arguments = locals()
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(map(repr, STRATEGIES))}; "
                         f"got {strategy!r}")
    if strategy == "ring":
        refuse("sharded_flash_attention", arguments, {name: (
            "use strategy='ulysses' (every option, with global head indices), call "
            "ring_flash_attention inside your own jax.shard_map (it takes score_mod "
            "and mask_mod, at global positions), or use alibi_slopes=/bias= for score "
            "terms and causal=, window=, a key mask or segment ids for masks")
            for name in ("score_mod", "mask_mod", "block_mask")})
    elif strategy == "all_gather":
        refuse("sharded_flash_attention(strategy='all_gather')", arguments, {
            "block_mask": "pass the mask_mod alone (each device summarises it)",
            "layout": "it balances causal/window work with the zigzag order itself"})
    else:
        refuse("sharded_flash_attention(strategy='ulysses')", arguments, {
            "block_mask": "pass the mask_mod alone (each device summarises it for its "
                          "heads)",
            "layout": "Ulysses keeps the sequence in order (layout is the ring's)"})
    if layout is not None:
        check_layout(layout)
    for name in ("mesh", "seq_axis", "batch_axis", "head_axis", "layout", "strategy"):
        del arguments[name]
    if seq_axis not in mesh.shape:
        raise ValueError(f"seq_axis={seq_axis!r} is not an axis of the mesh {dict(mesh.shape)}")
    bound = bind("sharded_flash_attention", **arguments)
    shapes = bound.shapes
    if batch_axis is not None and not shapes.batch_shape:
        raise ValueError(f"batch_axis={batch_axis!r} needs a batch axis; got q.shape={q.shape}")
    if head_axis is not None and not shapes.has_heads_axis:
        raise ValueError(f"head_axis={head_axis!r} needs a heads axis; got q.shape={q.shape}")
    if strategy == "ulysses":
        return ulysses_attention(bound, mesh=mesh, seq_axis=seq_axis, batch_axis=batch_axis,
                                 head_axis=head_axis)
    if strategy == "all_gather":
        return all_gather_attention(bound, mesh=mesh, seq_axis=seq_axis,
                                    batch_axis=batch_axis, head_axis=head_axis)
    n = mesh.shape[seq_axis]
    if layout is None:
        balanced = n > 1 and not bound.options.window.is_unbounded
        fits = shapes.seq_q % (2 * n) == 0 and shapes.seq_k % (2 * n) == 0
        layout = "zigzag" if balanced and fits else "contiguous"
    for seq in (shapes.seq_q, shapes.seq_k):
        ring_order(seq, n, layout)  # raises on lengths the layout cannot split
    q5, k4, v4 = split_heads(bound.q, bound.k, bound.v, shapes)
    ops = bound.operands
    if ops.has_lengths:
        q5, k4, v4, ops = _lengths_as_segment_ids(shapes, bound.options, q5, k4, v4, ops)
    local = dataclasses.replace(shapes, seq_q=shapes.seq_q // n, seq_k=shapes.seq_k // n)
    ring, _ = ring_of(bound, seq_axis, n, layout, local=local)
    out, lse, top = _sharded(q5, k4, v4, replace(ops, sinks=None), ring=ring, mesh=mesh,
                             batch_axis=batch_axis, head_axis=head_axis)
    # The sink joins the merged global result: elementwise, sharded as out and lse are.
    out, lse = with_sink(out, lse, None if ops.sinks is None else ops.sinks[..., 0])
    out, lse = merge_heads(out, lse, shapes)
    return (out, lse, top.reshape(lse.shape)) if bound.return_max_scores else (out, lse)


# Segment ids of padding: no valid row has them, and a padded query's is not a padded key's.
PADDED_QUERY_ID = jnp.iinfo(jnp.int32).min
PADDED_KEY_ID = jnp.iinfo(jnp.int32).min + 1


def _lengths_as_segment_ids(shapes: Shapes, options: AttentionOptions, q, k, v,
                            ops: Operands) -> tuple[Array, Array, Array, Operands]:
    """Valid lengths as segment ids the ring already carries, with the padded rows of q,
    k, v zeroed (`valid_rows`: NaN padding reaches nothing). Internal layout."""
    q_len, kv_len = lengths_or(ops, shapes.seq_q, shapes.seq_k)
    if not options.window.is_unbounded and not ops.has_positions:
        # Causal too: the ring aligns on the global lengths (positions place it themselves).
        offset = shapes.seq_k - shapes.seq_q
        message = (
            f"sharded_flash_attention with causal/window needs kv_lengths - q_lengths == "
            f"seq_k - seq_q = {offset} (the ring aligns the diagonal on the global sequence)"
        )
        q_len, kv_len = jnp.asarray(q_len), jnp.asarray(kv_len)
        bad = jnp.any(kv_len - q_len != offset)
        if is_concrete(bad) and bool(bad):
            raise ValueError(f"{message}; got q_lengths={np.asarray(q_len).ravel().tolist()}"
                             f", kv_lengths={np.asarray(kv_len).ravel().tolist()}")
        # Traced (no value check may abort a multi-device program): the valid region
        # shrinks to the largest lengths with that difference, the result that of
        # `flash_attention` with them. A no-op for lengths that satisfy it.
        q_len, kv_len = (
            jnp.clip(jnp.minimum(q_len, kv_len - offset), 0, shapes.seq_q).reshape(-1, 1, 1, 1, 1),
            jnp.minimum(kv_len, q_len + offset).reshape(-1, 1, 1, 1, 1),
        )
        ops = replace(ops, q_lengths=q_len, kv_lengths=kv_len)
    q, k, v = valid_rows(q, k, v, ops, shapes.seq_q, shapes.seq_k)
    q_valid = jnp.arange(shapes.seq_q).reshape(1, 1, 1, -1, 1) < q_len
    k_valid = jnp.arange(shapes.seq_k).reshape(1, 1, 1, 1, -1) < kv_len

    def ids(given: Array | None, valid: Array, padded: int) -> Array:
        base = jnp.zeros((1,) * 5, jnp.int32) if given is None else given
        return jnp.where(valid, base, jnp.asarray(padded, jnp.int32))

    ops = replace(ops, q_lengths=None, kv_lengths=None,
                  q_segment_ids=ids(ops.q_segment_ids, q_valid, PADDED_QUERY_ID),
                  kv_segment_ids=ids(ops.kv_segment_ids, k_valid, PADDED_KEY_ID))
    return q, k, v, ops


def _sequence_axes(name: str, x: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`(sharded, in ring order)`: the axes of operand `name` split over the ring's
    devices, and those arranged in ring order (`ring_operands.role_of`: the rows of a
    device and its travelling keys are sharded; a `"columns"` operand holds every key,
    in ring order)."""
    role = role_of(name, x)
    if role == "rows":
        return (3,), (3,)
    if role == "travelling":
        return (4,), (4,)
    if role == "columns":
        rows = (3,) if x.shape[3] != 1 else ()
        return rows, (*rows, 4)
    return (), ()


def _ring_operand_specs(ops: Operands, seq_axis: Hashable, batch_axis: Hashable | None,
                        head_axis: Hashable | None) -> Operands:
    """Each operand's `PartitionSpec`: batch and heads axes where it has them, and its
    sequence axes (`_sequence_axes`) over the ring."""

    def mesh_axes(name: str, x: Any) -> dict[int, Hashable | None]:
        return {0: batch_axis, 1: head_axis,
                **dict.fromkeys(_sequence_axes(name, x)[0], seq_axis)}

    return partition_specs(ops, mesh_axes)


@functools.partial(jax.jit, static_argnames=("ring", "mesh", "batch_axis", "head_axis"))
def _sharded(q, k, v, ops: Operands, *, ring: Ring, mesh: Mesh, batch_axis, head_axis):
    n, layout, seq_axis = ring.num_devices, ring.layout, ring.axis_name
    q_spec = PartitionSpec(batch_axis, head_axis, None, seq_axis, None)
    kv_spec = PartitionSpec(batch_axis, head_axis, seq_axis, None)
    lse_spec = PartitionSpec(batch_axis, head_axis, None, seq_axis)
    # Zigzag is reached from contiguous shards by moving whole chunks between devices
    # inside the map (two ppermutes); striped needs a token-level shuffle, left to XLA.
    # The key columns of a "columns" operand are in ring order whatever the layout.
    in_map = layout == "zigzag"

    def arrange(x: Array, axis: int, inverse: bool = False) -> Array:
        """The sequence axis `axis` of q, k, v, out or lse in ring order (or back)."""
        if in_map:
            return zigzag_in_map(x, seq_axis, n, axis, inverse=inverse)
        move = from_ring_layout if inverse else to_ring_layout
        return move(x, num_devices=n, layout=layout, axis=axis)

    def outside(name: str, x: Any) -> Any:
        """An operand's sequence axes in ring order, before it is sharded."""
        if layout_of(name) == SHARED or (in_map and role_of(name, x) != "columns"):
            return x
        for axis in _sequence_axes(name, x)[1]:
            x = to_ring_layout(x, num_devices=n, layout=layout, axis=axis)
        return x

    def inside(name: str, x: Any) -> Any:
        """Zigzag: an operand's sharded axes reordered as q's are, inside the map."""
        if layout_of(name) == SHARED or role_of(name, x) == "columns":
            return x
        for axis in _sequence_axes(name, x)[0]:
            x = zigzag_in_map(x, seq_axis, n, axis, inverse=False)
        return x

    def local(q, k, v, ops):
        if in_map:
            q, k, v = arrange(q, 3), arrange(k, 2), arrange(v, 2)
            ops = map_fields(inside, ops)
        out, lse, top = ring_attention(ring, q, k, v, ops)
        if in_map:
            out, lse, top = (arrange(out, 3, inverse=True), arrange(lse, 3, inverse=True),
                             arrange(top, 3, inverse=True))
        return out, lse, top

    sharded = jax.shard_map(
        local, mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec,
                  _ring_operand_specs(ops, seq_axis, batch_axis, head_axis)),
        out_specs=(q_spec, lse_spec, lse_spec),
        # The blockwise kernels create unsharded accumulators; see ring_flash_attention.
        check_vma=False,
    )
    ops = map_fields(outside, ops)
    if in_map:
        return sharded(q, k, v, ops)
    q, k, v = arrange(q, 3), arrange(k, 2), arrange(v, 2)
    out, lse, top = sharded(q, k, v, ops)
    return tuple(arrange(x, 3, inverse=True) for x in (out, lse, top))
