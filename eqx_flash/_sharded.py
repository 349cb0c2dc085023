"""Global-array entry point for ring attention, and the load-balancing sequence orders.

`sharded_flash_attention` takes and returns global arrays: it reorders the sequence for
the chosen layout, runs `ring_flash_attention` under `jax.shard_map` over the sequence
mesh axis (batch and heads may be sharded over other axes at the same time), and
restores the order.
"""

import functools
from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, ArrayLike

from ._ring import LAYOUTS, Layout, ring_flash_attention, subchunks
from ._validation import check_masks, check_qkv


def ring_order(seq_len: int, num_devices: int, layout: Layout) -> np.ndarray:
    """Global positions in the order that makes contiguous sharding give each device its
    part of `layout` (see `ring_flash_attention`): `x[..., ring_order(...), :]`.

    **Arguments:**

    - `seq_len`: length of the global sequence.
    - `num_devices`: size of the ring (mesh axis).
    - `layout`: `"contiguous"`, `"zigzag"` or `"striped"`.

    **Returns:**

    An `int` NumPy permutation of `range(seq_len)`.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    chunks = num_devices * subchunks(layout)
    if seq_len % chunks:
        raise ValueError(
            f"layout={layout!r} on {num_devices} devices cuts the sequence into {chunks} "
            f"equal chunks; seq_len={seq_len} is not divisible by {chunks}"
        )
    positions = np.arange(seq_len)
    if layout == "contiguous":
        return positions
    if layout == "striped":
        # Device i gets tokens i, i + n, i + 2n, ...
        return positions.reshape(-1, num_devices).T.reshape(-1)
    pieces = positions.reshape(chunks, -1)
    return np.concatenate(
        [np.concatenate([pieces[i], pieces[chunks - 1 - i]]) for i in range(num_devices)]
    )


def _reorder(x: Array, num_devices: int, layout: Layout, axis: int, inverse: bool) -> Array:
    # Reshapes, flips and transposes rather than a gather, so that XLA can move whole
    # chunks between devices instead of gathering the sequence everywhere.
    ring_order(x.shape[axis], num_devices, layout)  # validates
    if layout == "contiguous":
        return x
    x = jnp.moveaxis(x, axis, -1)
    lead, seq, n = x.shape[:-1], x.shape[-1], num_devices
    if layout == "striped":
        shape = (n, seq // n) if inverse else (seq // n, n)
        x = jnp.swapaxes(x.reshape(*lead, *shape), -1, -2)
    elif not inverse:
        halves = x.reshape(*lead, 2, n, seq // (2 * n))
        x = jnp.stack([halves[..., 0, :, :], jnp.flip(halves[..., 1, :, :], axis=-2)], axis=-2)
    else:
        pairs = x.reshape(*lead, n, 2, seq // (2 * n))
        x = jnp.stack([pairs[..., 0, :], jnp.flip(pairs[..., 1, :], axis=-2)], axis=-3)
    return jnp.moveaxis(x.reshape(*lead, seq), -1, axis)


def to_ring_layout(
    x: ArrayLike, *, num_devices: int, layout: Layout, axis: int = -2
) -> Array:
    """Reorder the sequence axis of a global array for `ring_flash_attention(layout=...)`:
    the same as `jnp.take(x, ring_order(...), axis)`.

    Shard the result contiguously over the ring's mesh axis. Use `axis=-1` for masks,
    segment ids and `lse`.
    """
    return _reorder(jnp.asarray(x), num_devices, layout, axis, inverse=False)


def from_ring_layout(
    x: ArrayLike, *, num_devices: int, layout: Layout, axis: int = -2
) -> Array:
    """Undo `to_ring_layout` (e.g. on the gathered `out`, or `lse` with `axis=-1`)."""
    return _reorder(jnp.asarray(x), num_devices, layout, axis, inverse=True)


def _spec(ndim: int, placed: dict[int, Hashable | None]) -> PartitionSpec:
    axes: list[Hashable | None] = [None] * ndim
    for position, name in placed.items():
        axes[position] = name
    return PartitionSpec(*axes)


def sharded_flash_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    mask: ArrayLike | None = None,
    *,
    mesh: Mesh,
    seq_axis: str,
    batch_axis: str | None = None,
    head_axis: str | None = None,
    layout: Layout | None = None,
    causal: bool = False,
    window: int | tuple[int | None, int | None] | None = None,
    q_segment_ids: ArrayLike | None = None,
    kv_segment_ids: ArrayLike | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[Array, Array]:
    """`flash_attention` on global arrays, with the sequence sharded over `mesh`.

    **Arguments:**

    - `q`, `k`, `v`, `mask`, `causal`, `window`, `q_segment_ids`, `kv_segment_ids`,
        `scale`, `softcap`, `block_q`, `block_k`: as in `flash_attention` (global arrays).
    - `mesh`: a `jax.sharding.Mesh`.
    - `seq_axis`: mesh axis the sequence is split over (the ring).
    - `batch_axis`: optional mesh axis for the first leading axis of q, k, v (data
        parallel).
    - `head_axis`: optional mesh axis for the heads axis (tensor parallel); must divide
        the number of kv heads.
    - `layout`: sequence order on the ring (see `ring_flash_attention`). Default:
        `"zigzag"` for causal or windowed attention when the lengths allow (balanced
        work), else `"contiguous"`.

    **Returns:**

    `(out, lse)` as `flash_attention` returns them, as global arrays sharded like q.
    """
    q, k, v, shapes = check_qkv(q, k, v)
    if isinstance(window, list) and len(window) == 2:
        window = (window[0], window[1])  # a static (hashable) argument below
    check_masks(shapes, mask, None, q_segment_ids, kv_segment_ids)  # clear shape errors
    if seq_axis not in mesh.shape:
        raise ValueError(f"seq_axis={seq_axis!r} is not an axis of the mesh {dict(mesh.shape)}")
    n = mesh.shape[seq_axis]
    if layout is None:
        balanced = n > 1 and (causal or window is not None)
        fits = shapes.seq_q % (2 * n) == 0 and shapes.seq_k % (2 * n) == 0
        layout = "zigzag" if balanced and fits else "contiguous"
    for seq in (shapes.seq_q, shapes.seq_k):
        ring_order(seq, n, layout)  # raises on lengths the layout cannot split
    if batch_axis is not None and not shapes.batch_shape:
        raise ValueError(f"batch_axis={batch_axis!r} needs a batch axis; got q.shape={q.shape}")
    if head_axis is not None and not shapes.has_heads_axis:
        raise ValueError(f"head_axis={head_axis!r} needs a heads axis; got q.shape={q.shape}")
    extras = {}
    for name, x, seq in (
        ("mask", mask, shapes.seq_k),
        ("q_segment_ids", q_segment_ids, shapes.seq_q),
        ("kv_segment_ids", kv_segment_ids, shapes.seq_k),
    ):
        if x is None:
            continue
        x = jnp.asarray(x)
        # Broadcast to (*batch, [heads,] seq) so every mesh axis splits a real axis.
        with_heads = shapes.has_heads_axis and x.ndim == q.ndim - 1
        lead = shapes.lead_shape if with_heads else shapes.batch_shape
        extras[name] = jnp.broadcast_to(x, (*lead, seq))
    return _sharded(
        q, k, v, extras, mesh=mesh, seq_axis=seq_axis, batch_axis=batch_axis,
        head_axis=head_axis, layout=layout, causal=causal, window=window, scale=scale,
        softcap=softcap, block_q=block_q, block_k=block_k,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "mesh", "seq_axis", "batch_axis", "head_axis", "layout", "causal", "window",
        "scale", "softcap", "block_q", "block_k",
    ),
)
def _sharded(q, k, v, extras, *, mesh, seq_axis, batch_axis, head_axis, layout, **kwargs):
    n = mesh.shape[seq_axis]

    def spec(x: Array, with_heads: bool) -> PartitionSpec:
        placed = {x.ndim - 1: seq_axis}
        if batch_axis is not None:
            placed[0] = batch_axis
        if with_heads and head_axis is not None:
            placed[x.ndim - 2] = head_axis
        return _spec(x.ndim, placed)

    qkv_specs = []
    for x in (q, k, v):
        placed = {x.ndim - 2: seq_axis}
        if batch_axis is not None:
            placed[0] = batch_axis
        if head_axis is not None:
            placed[x.ndim - 3] = head_axis
        qkv_specs.append(_spec(x.ndim, placed))
    extra_specs = {
        name: spec(x, with_heads=x.ndim == q.ndim - 1) for name, x in extras.items()
    }
    lse_spec = PartitionSpec(*qkv_specs[0][:-1])

    # Zigzag is reached from contiguous shards by moving whole chunks between devices
    # inside the map (two ppermutes); striped needs a token-level shuffle, left to XLA.
    in_map = layout == "zigzag"

    def local(q, k, v, extras):
        if in_map:
            q, k, v = (_zigzag(x, seq_axis, n, x.ndim - 2, inverse=False) for x in (q, k, v))
            extras = {
                name: _zigzag(x, seq_axis, n, x.ndim - 1, inverse=False)
                for name, x in extras.items()
            }
        out, lse = ring_flash_attention(
            q, k, v, extras.get("mask"), axis_name=seq_axis, layout=layout,
            q_segment_ids=extras.get("q_segment_ids"),
            kv_segment_ids=extras.get("kv_segment_ids"), **kwargs,
        )
        if in_map:
            out = _zigzag(out, seq_axis, n, out.ndim - 2, inverse=True)
            lse = _zigzag(lse, seq_axis, n, lse.ndim - 1, inverse=True)
        return out, lse

    ring = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(*qkv_specs, extra_specs),
        out_specs=(qkv_specs[0], lse_spec),
        # The blockwise kernels create unsharded accumulators; see ring_flash_attention.
        check_vma=False,
    )
    if in_map:
        return ring(q, k, v, extras)

    def arrange(x: Array, axis: int) -> Array:
        return to_ring_layout(x, num_devices=n, layout=layout, axis=axis)

    q, k, v = arrange(q, -2), arrange(k, -2), arrange(v, -2)
    out, lse = ring(q, k, v, {name: arrange(x, -1) for name, x in extras.items()})
    return (
        from_ring_layout(out, num_devices=n, layout=layout, axis=-2),
        from_ring_layout(lse, num_devices=n, layout=layout, axis=-1),
    )


def _zigzag(x: Array, axis_name: Hashable, n: int, axis: int, inverse: bool) -> Array:
    """Inside `shard_map`: contiguous shards to zigzag ones (device `i` holding chunks
    `2i, 2i+1` to holding `i, 2n-1-i`), or back. Each device always holds one even and one
    odd chunk, so one ppermute moves the even chunks and one the odd ones."""
    me = jax.lax.axis_index(axis_name)
    first, second = jnp.split(x, 2, axis=axis)

    def home(chunk: int) -> int:  # device holding `chunk` in the zigzag layout
        return chunk if chunk < n else 2 * n - 1 - chunk

    if not inverse:
        even = jax.lax.ppermute(first, axis_name, [(i, home(2 * i)) for i in range(n)])
        odd = jax.lax.ppermute(second, axis_name, [(i, home(2 * i + 1)) for i in range(n)])
        # Device d's first zigzag chunk is chunk d: the even one iff d is even.
        d_even = me % 2 == 0
        return jnp.concatenate(
            [jnp.where(d_even, even, odd), jnp.where(d_even, odd, even)], axis=axis
        )
    d_even = me % 2 == 0
    even, odd = jnp.where(d_even, first, second), jnp.where(d_even, second, first)
    # Device d's even chunk is d or 2n-1-d, whichever is even; it goes to (chunk // 2).
    even_chunk = [d if d % 2 == 0 else 2 * n - 1 - d for d in range(n)]
    odd_chunk = [2 * n - 1 - c for c in even_chunk]
    even = jax.lax.ppermute(even, axis_name, [(d, even_chunk[d] // 2) for d in range(n)])
    odd = jax.lax.ppermute(odd, axis_name, [(d, odd_chunk[d] // 2) for d in range(n)])
    return jnp.concatenate([even, odd], axis=axis)
