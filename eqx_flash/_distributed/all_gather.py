"""All-gather context parallelism (kvax, Llama-3 style): every device gets all the keys.

q stays sharded along the sequence; k and v (and the key-side arrays) are all-gathered
along it inside `jax.shard_map`, and each device attends its own queries to every key
with the single-device kernels (`flash_attention`: forward mode and second-order
derivatives included). The backward pass is the transpose of the gather: a
reduce-scatter of dk and dv. k and v cost O(seq) per device (the queries, outputs and
their gradients O(seq / devices)).

A device's queries sit at a global offset known only at run time (its axis index), so
causal, the window and ALiBi are measured on positions (`q_positions`/`kv_positions`):
the caller's, else each query's global index aligned bottom-right (on the valid lengths
when given), so that each device's kernels skip the key blocks out of reach at run time.
Valid lengths become each piece's own; a user's `score_mod`/`mask_mod` are called with
global query indices (and ALiBi with lengths, aligned on the sequences as in
`flash_attention`, joins the `score_mod`). For causal or windowed attention the queries
are balanced with the zigzag layout (device `d` holds chunks `d` and `2n - 1 - d`), each
chunk attended on its own.
"""

from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array

from .._api.flash import flash_attention
from .._core.options import Window
from .._core.shapes import Shapes
from .sequence_order import from_ring_layout, to_ring_layout


def _per_batch(x: Any, batch_shape: tuple[int, ...]) -> Any:
    """Lengths `(*batch,)` (axes 1 or missing broadcast) as `batch_shape`."""
    return None if x is None else jnp.broadcast_to(jnp.asarray(x, jnp.int32), batch_shape)


def _slopes_per_row(x: Any, shapes: Shapes) -> Any:
    """ALiBi slopes `(heads,)` or `(*batch, heads)` as `(batch, heads)`."""
    x = jnp.asarray(x)
    return jnp.broadcast_to(x, (*shapes.batch_shape, shapes.heads)).reshape(-1, shapes.heads)


def _query_positions(shapes: Shapes, start: Any, chunk: int, lengths: dict[str, Any]
                     ) -> Array:
    """Positions of `chunk` queries from global index `start` against keys at positions
    `arange(seq_k)`, aligned bottom-right as `flash_attention` aligns causal and the
    window: on the valid lengths when given (`(*batch, chunk)`), else on the sequences."""
    index = start + jnp.arange(chunk, dtype=jnp.int32)
    q_len, kv_len = lengths["q_lengths"], lengths["kv_lengths"]
    if q_len is None and kv_len is None:
        return index + (shapes.seq_k - shapes.seq_q)
    q_len = shapes.seq_q if q_len is None else q_len
    kv_len = shapes.seq_k if kv_len is None else kv_len
    shift = jnp.broadcast_to(jnp.asarray(kv_len - q_len, jnp.int32), shapes.batch_shape)
    return shift[..., None] + index.reshape((1,) * len(shapes.batch_shape) + (chunk,))


def _global_mods(offset: Any, slopes: Any, shapes: Shapes, score_mod: Any, mask_mod: Any
                 ) -> tuple[Any, Any]:
    """`(score_mod, mask_mod)` on a device's local query indices `i` whose global index is
    `i + offset`: the user's own modifications at global indices, and ALiBi `slopes`
    (`(batch, heads)`, or None) on global indices aligned on the sequences."""
    shift = shapes.seq_k - shapes.seq_q

    def score(s, b, h, i, j):
        gi = i + offset
        if slopes is not None:
            distance = jnp.abs(gi + shift - j).astype(s.dtype)
            s = s - slopes[b, h].astype(s.dtype) * distance
        return s if score_mod is None else score_mod(s, b, h, gi, j)

    def mask(b, h, i, j):
        return mask_mod(b, h, i + offset, j)

    return (None if slopes is None and score_mod is None else score,
            None if mask_mod is None else mask)


def all_gather_attention(
    q, k, v, mask, arguments: dict[str, Any], *, shapes: Shapes, window: Window, mesh: Mesh,
    seq_axis: Hashable, zigzag: bool,
) -> tuple[Any, ...]:
    """`flash_attention(q, k, v, mask, **arguments)` with the sequence of q, k, v sharded
    over `seq_axis`, k and v all-gathered; results sharded along the sequence like q.
    `arguments` are the public keyword arguments (already checked by the binder)."""
    n = mesh.shape[seq_axis]
    pieces = 2 if zigzag else 1
    chunk = shapes.seq_q // (n * pieces)
    layout = "zigzag" if zigzag else "contiguous"
    q_ids, bias = arguments.pop("q_segment_ids"), arguments.pop("bias")
    q_positions = arguments.pop("q_positions")
    score_mod, mask_mod = arguments.pop("score_mod"), arguments.pop("mask_mod")
    lengths = {name: _per_batch(arguments.pop(name), shapes.batch_shape)
               for name in ("q_lengths", "kv_lengths")}
    # Causal, the window and ALiBi act on positions: the caller's, else the queries'
    # global positions aligned as flash_attention aligns them, so each device's kernels
    # skip the key blocks out of reach at run time. ALiBi with lengths stays aligned on
    # the sequences (flash_attention's ALiBi ignores the lengths): a score_mod then.
    given_positions = q_positions is not None
    alibi_in_score = not given_positions and any(x is not None for x in lengths.values())
    slopes = arguments.pop("alibi_slopes") if alibi_in_score else None
    slopes = None if slopes is None else _slopes_per_row(slopes, shapes)
    make_positions = not given_positions and (
        not window.is_unbounded or arguments.get("alibi_slopes") is not None)
    if make_positions:
        arguments["kv_positions"] = jnp.arange(shapes.seq_k, dtype=jnp.int32)
    # The query-side arrays in the layout's order, sharded with the queries.
    rows_bias = bias is not None and jnp.ndim(bias) >= 2 and jnp.shape(bias)[-2] != 1

    def order(x, axis):
        return to_ring_layout(x, num_devices=n, layout=layout, axis=axis)

    q = order(q, -2)
    q_ids = None if q_ids is None else order(jnp.asarray(q_ids), -1)
    q_positions = None if q_positions is None else order(jnp.asarray(q_positions), -1)
    if rows_bias:
        bias = order(jnp.asarray(bias), -2)

    def spec(x: Any, axis: int | None) -> Any:
        if x is None:
            return None
        axes: list[Any] = [None] * jnp.ndim(x)
        if axis is not None:
            axes[axis] = seq_axis
        return PartitionSpec(*axes)

    # Arrays travel through the map (replicated); the rest are static settings.
    arrays = {n: x for n, x in arguments.items() if isinstance(x, jax.Array | np.ndarray)}
    static = {n: x for n, x in arguments.items() if n not in arrays}
    per_row = dict(lengths, alibi_slopes=slopes)
    replicated = jax.tree.map(lambda _: PartitionSpec(), (mask, per_row, arrays))

    def body(q, k, v, mask, q_ids, q_positions, bias, per_row, arrays):
        k, v = (jax.lax.all_gather(x, seq_axis, axis=x.ndim - 2, tiled=True) for x in (k, v))
        me = jax.lax.axis_index(seq_axis)
        results = []
        for piece in range(pieces):
            start = piece * chunk
            index = me if piece == 0 else 2 * n - 1 - me
            first = index * chunk  # the piece's first global query
            score, masked = _global_mods(first, per_row["alibi_slopes"], shapes, score_mod,
                                         mask_mod)

            def rows_of(x, axis, start=start):
                return None if x is None else jax.lax.slice_in_dim(x, start, start + chunk,
                                                                   axis=axis)

            local = {}
            if per_row["q_lengths"] is not None:  # the piece's valid rows
                local["q_lengths"] = jnp.clip(per_row["q_lengths"] - first, 0, chunk)
            if per_row["kv_lengths"] is not None:
                local["kv_lengths"] = per_row["kv_lengths"]
            if given_positions:
                local["q_positions"] = rows_of(q_positions, -1)
            elif make_positions:
                local["q_positions"] = _query_positions(shapes, first, chunk, per_row)
            results.append(flash_attention(
                jax.lax.slice_in_dim(q, start, start + chunk, axis=q.ndim - 2), k, v, mask,
                q_segment_ids=rows_of(q_ids, -1),
                bias=rows_of(bias, -2) if rows_bias else bias, score_mod=score,
                mask_mod=masked, **local, **arrays, **static))
        if pieces == 1:
            return results[0]
        # out's rows are axis -2, the statistics' -1.
        return tuple(jnp.concatenate(parts, axis=-2 if i == 0 else -1)
                     for i, parts in enumerate(zip(*results, strict=True)))

    stats = 2 if static.get("return_max_scores") else 1
    mapped = jax.shard_map(
        body, mesh=mesh,
        in_specs=(spec(q, -2), spec(k, -2), spec(v, -2), replicated[0], spec(q_ids, -1),
                  spec(q_positions, -1), spec(bias, -2 if rows_bias else None), replicated[1],
                  replicated[2]),
        out_specs=(spec(q, -2), *([spec(q[..., 0], -1)] * stats)),
        check_vma=False,  # the blockwise kernels create unsharded accumulators
    )
    results = mapped(q, k, v, mask, q_ids, q_positions, bias, per_row, arrays)
    out, *rest = results
    out = from_ring_layout(out, num_devices=n, layout=layout, axis=-2)
    rest = [from_ring_layout(x, num_devices=n, layout=layout, axis=-1) for x in rest]
    return (out, *rest)

