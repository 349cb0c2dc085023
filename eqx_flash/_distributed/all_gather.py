"""All-gather context parallelism (kvax, Llama-3 style): every device gets all the keys.

q stays sharded along the sequence; k and v (and the key-side arrays) are all-gathered
along it inside `jax.shard_map`, and each device attends its own queries to every key
with the single-device kernels (`flash_attention`: forward mode and second-order
derivatives included). The backward pass is the transpose of the gather: a
reduce-scatter of dk and dv. k and v cost O(seq) per device (the queries, outputs and
their gradients O(seq / devices)).

A device's queries sit at a global offset known only at run time (its axis index), so
what depends on query positions is restated on global positions: causal, the window and
valid lengths become one `mask_mod` (whose block summary skips the blocks it empties),
ALiBi joins the `score_mod`, and a user's `score_mod`/`mask_mod` are called with global
query indices. With `q_positions`/`kv_positions`, causal, the window and ALiBi are
measured on those and pass through (the query positions sharded with the queries). For
causal or windowed attention the queries are balanced with the zigzag
layout (device `d` holds chunks `d` and `2n - 1 - d`), each chunk attended on its own.
"""

from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from .._api.flash import flash_attention
from .._core.options import Window
from .._core.shapes import Shapes
from .sequence_order import from_ring_layout, to_ring_layout


def _flat(x: Any, batch_shape: tuple[int, ...]) -> Any:
    """A per-batch-element array `(*batch,)` (axes 1 or missing broadcast), flattened."""
    if x is None:
        return None
    x = jnp.asarray(x)
    return jnp.broadcast_to(x, batch_shape).reshape(-1) if batch_shape else x.reshape(1)


def _per_head(x: Any, shapes: Shapes) -> Any:
    """ALiBi slopes `(heads,)` or `(*batch, heads)` as `(batch, heads)`."""
    x = jnp.asarray(x)
    return jnp.broadcast_to(x, (*shapes.batch_shape, shapes.heads)).reshape(-1, shapes.heads)


def _positional_mods(shapes: Shapes, window: Window, offset: Any, arrays: dict[str, Any],
                     score_mod: Any, mask_mod: Any) -> tuple[Any, Any]:
    """`(score_mod, mask_mod)` on a device's local query indices `i` whose global index is
    `i + offset`: the window/causal band, valid lengths and ALiBi of `flash_attention`
    on global positions, and the user's own modifications."""
    q_len, kv_len, slopes = arrays["q_lengths"], arrays["kv_lengths"], arrays["alibi_slopes"]
    lengths = q_len is not None or kv_len is not None
    shift = shapes.seq_k - shapes.seq_q

    def mask(b, h, i, j):
        gi = i + offset
        allowed = jnp.ones(jnp.broadcast_shapes(jnp.shape(gi), jnp.shape(j)), bool)
        p = gi + shift
        if lengths:
            ql = shapes.seq_q if q_len is None else q_len[b]
            kl = shapes.seq_k if kv_len is None else kv_len[b]
            allowed = allowed & (gi < ql) & (j < kl)
            p = gi + (kl - ql)  # causal and window align on the valid lengths
        if window.left is not None:
            allowed = allowed & (j >= p - window.left)
        if window.right is not None:
            allowed = allowed & (j <= p + window.right)
        if mask_mod is not None:
            allowed = allowed & mask_mod(b, h, gi, j)
        return allowed

    needs_mask = lengths or not window.is_unbounded or mask_mod is not None

    def score(s, b, h, i, j):
        gi = i + offset
        if slopes is not None:
            distance = jnp.abs(gi + shift - j).astype(s.dtype)
            s = s - slopes[b, h].astype(s.dtype) * distance
        return s if score_mod is None else score_mod(s, b, h, gi, j)

    needs_score = slopes is not None or score_mod is not None
    return (score if needs_score else None), (mask if needs_mask else None)


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
    # With positions, causal, the window and ALiBi are measured on them, not on the
    # device's offset: they pass through, and only the lengths become a mask_mod.
    by_position = q_positions is not None
    slopes = None if by_position else arguments.pop("alibi_slopes")
    per_row = {
        "q_lengths": _flat(arguments.pop("q_lengths"), shapes.batch_shape),
        "kv_lengths": _flat(arguments.pop("kv_lengths"), shapes.batch_shape),
        "alibi_slopes": None if slopes is None else _per_head(slopes, shapes),
    }
    if by_position:
        window = Window()
    else:
        for name in ("causal", "window"):
            arguments.pop(name)
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
    replicated = jax.tree.map(lambda _: PartitionSpec(), (mask, per_row, arrays))

    def body(q, k, v, mask, q_ids, q_positions, bias, per_row, arrays):
        k, v = (jax.lax.all_gather(x, seq_axis, axis=x.ndim - 2, tiled=True) for x in (k, v))
        me = jax.lax.axis_index(seq_axis)
        results = []
        for piece in range(pieces):
            start = piece * chunk
            index = me if piece == 0 else 2 * n - 1 - me
            score, masked = _positional_mods(shapes, window, index * chunk, per_row,
                                             score_mod, mask_mod)

            def rows_of(x, axis, start=start):
                return None if x is None else jax.lax.slice_in_dim(x, start, start + chunk,
                                                                   axis=axis)

            results.append(flash_attention(
                jax.lax.slice_in_dim(q, start, start + chunk, axis=q.ndim - 2), k, v, mask,
                q_segment_ids=rows_of(q_ids, -1), q_positions=rows_of(q_positions, -1),
                bias=rows_of(bias, -2) if rows_bias else bias, score_mod=score,
                mask_mod=masked, **arrays, **static))
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

