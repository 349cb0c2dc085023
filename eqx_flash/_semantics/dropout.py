"""Dropout's counter-based hash: whether an attention weight survives is a pure function
of (key, flat head index, query position, key position), so a pattern never depends on
how the work is blocked, and the kernels and the reference drop the same entries.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int, UInt32


def _mix(h: UInt32[Array, "*b"]) -> UInt32[Array, "*b"]:
    """A 32-bit integer finaliser ("lowbias32"); bijective and well mixed."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x846CA68B)
    return h ^ (h >> 16)


def seed_from_key(key: Array) -> UInt32[Array, ""]:
    """Fold a PRNG key (any implementation) into one 32-bit seed."""
    words = jax.random.key_data(key).reshape(-1).astype(jnp.uint32)
    h = jnp.uint32(0x9E3779B9)
    for i in range(words.shape[0]):
        h = _mix(h ^ words[i])
    return h


def dropout_keep(
    seed: UInt32[Array, ""],
    head_index: Int[Array, "*#b"],
    q_pos: Int[Array, "*#b"],
    k_pos: Int[Array, "*#b"],
    rate: float,
) -> Bool[Array, "*b"]:
    """Whether attention weight (head, i, j) survives dropout: a pure function of
    (key, flat leading index, i, j), so kernels and reference drop the same entries."""
    return keep_for_head(head_seed(seed, head_index), q_pos, k_pos, rate)


def head_seed(seed: UInt32[Array, ""], head_index: Int[Array, "*#b"]) -> UInt32[Array, "*#b"]:
    """The first half of `dropout_keep`: the seed of one head (a kernel that reads
    it per head from a table calls `keep_for_head` with it)."""
    return _mix(seed ^ head_index.astype(jnp.uint32))


def keep_for_head(
    seed_of_head: UInt32[Array, "*#b"],
    q_pos: Int[Array, "*#b"] | UInt32[Array, "*#b"],
    k_pos: Int[Array, "*#b"] | UInt32[Array, "*#b"],
    rate: float,
) -> Bool[Array, "*b"]:
    """The rest of `dropout_keep`: one hash per query (row) and per key (column), then
    one per pair."""
    row = _mix(seed_of_head ^ q_pos.astype(jnp.uint32))
    col = _mix(k_pos.astype(jnp.uint32) ^ jnp.uint32(0x68E31DA4))
    h = _mix(row + col)
    threshold = jnp.uint32(min(int(rate * 2.0**32), 2**32 - 1))
    return h >= threshold


def flat_head_index(b: Array, h: Array, kv_heads: int, groups: int) -> Int[Array, "..."]:
    """Flat index over q's leading axes (heads included) of the query heads grouped on kv
    head `h` of batch element `b`: `(b * kv_heads + h) * groups + g`, shaped
    `(*broadcast(b, h), groups, 1, 1)` to broadcast against logits `(..., seq_q, seq_k)`.

    The one definition of the head coordinate of dropout's counter: the kernels (one kv
    head at a time) and the reference (all heads at once) both call it.
    """
    n = jnp.asarray(b, jnp.int32)[..., None] * kv_heads + jnp.asarray(h, jnp.int32)[..., None]
    g = jnp.arange(groups, dtype=jnp.int32).reshape((1,) * (n.ndim - 1) + (groups,))
    return (n * groups + g)[..., None, None]
