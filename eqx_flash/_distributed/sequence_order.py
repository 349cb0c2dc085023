"""Sequence orders for ring attention: how the global sequence is cut into device shards.

`"contiguous"`: device `i` holds the `i`-th slice. `"zigzag"`: the sequence is cut into
`2n` chunks and device `i` holds chunks `i` and `2n-1-i` (balances causal work).
`"striped"`: device `i` holds tokens `i, i+n, i+2n, ...`. The ring kernel
(`_distributed.ring`) reads `subchunks`/`chunk_index`; `to_ring_layout`/`from_ring_layout`
reorder global arrays.
"""

from collections.abc import Hashable
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike

Layout = Literal["contiguous", "zigzag", "striped"]
LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag", "striped")


def check_layout(layout: object) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got layout={layout!r}")


def subchunks(layout: str) -> int:
    """How many contiguous pieces of the global sequence one device holds."""
    return 2 if layout == "zigzag" else 1


def chunk_index(layout: str, num_devices: int, device: int, piece: int) -> int:
    """Global chunk number of `piece` on `device` (chunks of `seq / (devices * pieces)`).

    Zigzag gives device `i` chunks `i` and `2n - 1 - i`, so each device has one early and
    one late chunk and causal work is even. (Striped is token-level, handled apart.)
    """
    if layout == "zigzag":
        return device if piece == 0 else 2 * num_devices - 1 - device
    return device


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
    check_layout(layout)
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


def zigzag_in_map(x: Array, axis_name: Hashable, n: int, axis: int, inverse: bool) -> Array:
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
