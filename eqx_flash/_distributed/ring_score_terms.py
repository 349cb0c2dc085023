"""Score terms on the ring (`_ring`): a bias sharded by query rows, and ALiBi at global
positions.

A device keeps its query rows of the bias, `(..., local seq_q, global seq_k)` with the key
columns in ring order (`to_ring_layout`), and at each ring step slices the columns of the
key chunk visiting it: nothing travels, and each device holds its share of the bias,
`seq_q * seq_k / devices` entries (rotating columns with the keys would need the same
memory and a transfer per step). The bias cotangent accumulates in the same place.

ALiBi penalises the distance between global positions, and `score_mod`/`mask_mod` take
global indices; those depend on the pair of devices meeting at a ring step, a run-time
value, while the kernels' diagonal offset is static (and reset for unmasked pairs). So
the pair's global positions reach the kernels as arrays (`ScoreMods.q_positions`/
`k_positions`), which also covers the striped layout, where they are not a shifted
range.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._distributed.sequence_order import chunk_index
from .._semantics.score_terms import ScoreMods


class RingMods(NamedTuple):
    """The ring's differentiable score terms, internal layout (`_shapes`)."""

    # Per query piece: `(batch|1, kv_heads|1, groups|1, padded piece|1, columns|1)`, the
    # columns cut into the ring's key chunks, each padded (`bias_columns`).
    bias: tuple[Array | None, ...]
    slopes: Array | None  # (batch|1, kv_heads|1, groups|1, 1, 1)
    score: Any = None  # the score_mod's floating arrays (`_mods.FlexArrays.score`)


def bias_columns(bias: Array | None, chunks: int, padded: int) -> Array | None:
    """Cut the key axis of `bias` into `chunks` equal chunks, each zero-padded to
    `padded` columns (as the key pieces are), so that chunk `c` is one slice."""
    if bias is None or bias.shape[-1] == 1:
        return bias
    chunk = bias.shape[-1] // chunks
    x = bias.reshape(*bias.shape[:-1], chunks, chunk)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded - chunk)])
    return x.reshape(*bias.shape[:-1], chunks * padded)


def column_block(x: Array, chunk: Array, padded: int) -> Array:
    """Key chunk `chunk`'s columns of a `bias_columns` array (all of a size-1 axis)."""
    if x.shape[-1] == 1:
        return x
    return jax.lax.dynamic_slice_in_dim(x, chunk * padded, padded, axis=-1)


def put_column_block(x: Array, block: Array, chunk: Array, padded: int) -> Array:
    """`x` with chunk `chunk`'s columns replaced by `block` (the inverse of `column_block`)."""
    if x.shape[-1] == 1:
        return block
    return jax.lax.dynamic_update_slice_in_dim(x, block, chunk * padded, axis=-1)


def positions(
    layout: str, num_devices: int, device: Array, piece: int, length: int, padded: int
) -> Array:
    """Global positions of the `length` tokens of `piece` on `device` (a run-time index),
    padded on with more to `padded` entries (padding is masked, its values unused)."""
    local = jnp.arange(padded, dtype=jnp.int32)
    if layout == "striped":  # device i holds tokens i, i + n, i + 2n, ...
        return device + num_devices * local
    chunks = jnp.asarray([chunk_index(layout, num_devices, d, piece) for d in range(num_devices)])
    return chunks[device] * length + local


def pair_mods(
    mods: RingMods, qp: int, chunk: Array, padded_k: int, q_pos: Array | None,
    k_pos: Array | None,
) -> ScoreMods:
    """The `ScoreMods` of query piece `qp` against the key piece of global ring chunk
    `chunk`, at global positions `q_pos` and `k_pos` (None: not needed)."""
    bias = mods.bias[qp]
    return ScoreMods(
        bias=None if bias is None else column_block(bias, chunk, padded_k),
        slopes=mods.slopes,
        q_positions=None if q_pos is None else q_pos.reshape(1, 1, 1, -1, 1),
        k_positions=None if k_pos is None else k_pos.reshape(1, 1, 1, 1, -1),
    )
