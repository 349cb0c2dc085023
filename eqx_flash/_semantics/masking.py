"""The one definition of which (query, key) pairs attend, and which are dropped.

The blockwise kernels evaluate these functions on one block of positions, the reference
on the whole grid, and `_schedule` reasons about the positional part block by block, so
all three agree by construction.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int, UInt32

from .._core.config import Window


class Masks(NamedTuple):
    """Data-dependent masks in the internal layout (`_shapes.mask_to_internal`).

    Each is `(batch|1, kv_heads|1, groups|1, seq_q|1, seq_k|1)` or None.
    """

    key_mask: Array | None = None
    pair_mask: Array | None = None
    q_segment_ids: Array | None = None
    kv_segment_ids: Array | None = None
    # Valid lengths (right padding), `(batch|1, 1, 1, 1, 1)` int32; see `length_mask`.
    q_lengths: Array | None = None
    kv_lengths: Array | None = None
    # A `mask_mod`'s block summary (`_block_mask`), `(batch|1, kv_heads|1, 1, num_q,
    # num_k)` int8: per block, not per position, so never padded or sliced as the rest.
    block_flags: Array | None = None

    @property
    def has_lengths(self) -> bool:
        return self.q_lengths is not None or self.kv_lengths is not None

    @property
    def is_empty(self) -> bool:
        """No data-dependent mask on positions (the block summary is not one)."""
        return all(m is None for m in self._replace(block_flags=None))


def positional_mask(
    q_pos: Int[Array, "*#b"], k_pos: Int[Array, "*#b"], offset: int, seq_k: int, window: Window
) -> Bool[Array, "*#b"]:
    """Window around `p = q_pos + offset` (causal is `right=0`; the public API aligns
    bottom-right, `offset = seq_k - seq_q`) and key padding (`k_pos < seq_k`).

    The result broadcasts against the positions (without a window it depends on `k_pos`
    alone)."""
    p = q_pos + offset
    allowed = k_pos < seq_k
    if window.left is not None:
        allowed = allowed & (k_pos >= p - window.left)
    if window.right is not None:
        allowed = allowed & (k_pos <= p + window.right)
    return allowed


def length_mask(
    q_pos: Int[Array, "*#b"], k_pos: Int[Array, "*#b"], q_len: Array | int, kv_len: Array | int,
    window: Window,
) -> Bool[Array, "*#b"]:
    """Variable lengths (right padding): query `i < q_len` sees key `j < kv_len`, within
    `window` around `p = i + kv_len - q_len` (causal and window align bottom-right on the
    *valid* lengths). With lengths the kernels' static band ignores the window
    (`KernelConfig.band_window`) and this predicate applies it instead."""
    allowed = (q_pos < q_len) & (k_pos < kv_len)
    p = q_pos + (kv_len - q_len)
    if window.left is not None:
        allowed = allowed & (k_pos >= p - window.left)
    if window.right is not None:
        allowed = allowed & (k_pos <= p + window.right)
    return allowed


def lengths_or(masks: Masks, seq_q: int, seq_k: int) -> tuple[Array | int, Array | int]:
    """`(q_len, kv_len)` of `masks`, the full sequence where a length is not given."""
    q_len = seq_q if masks.q_lengths is None else masks.q_lengths
    kv_len = seq_k if masks.kv_lengths is None else masks.kv_lengths
    return q_len, kv_len


def valid_rows(
    q: Array, k: Array, v: Array, masks: Masks, seq_q: int, seq_k: int, keys: bool = True
) -> tuple[Array, Array, Array]:
    """q, k, v (internal layout, unpadded) with the rows that can never attend set to 0:
    queries at or past `q_lengths`, keys at or past `kv_lengths` or masked by the key mask
    for every query of their kv head. O(N d) once, so that NaN or inf in padding (an
    uninitialised cache) reaches no output and no gradient: a masked logit is replaced by
    -inf, but its weight 0 times a NaN value would still be NaN. The `where` also gives
    those rows zero cotangents."""
    if masks.q_lengths is not None:
        q_pos = jnp.arange(seq_q, dtype=jnp.int32).reshape(1, 1, 1, -1, 1)
        q = jnp.where(q_pos < masks.q_lengths, q, jnp.zeros((), q.dtype))
    if not keys:  # (`keys=False`: the queries only)
        return q, k, v
    keep = None
    if masks.kv_lengths is not None:
        k_pos = jnp.arange(seq_k, dtype=jnp.int32).reshape(1, 1, -1, 1)
        keep = k_pos < masks.kv_lengths[:, :, 0]  # (batch|1, 1, seq_k, 1)
    if masks.key_mask is not None:
        # (b|1, h|1, g|1, 1, seq_k) -> attended by some query head of the kv head
        some = jnp.any(masks.key_mask, axis=(2, 3))[..., None]  # (b|1, h|1, seq_k, 1)
        keep = some if keep is None else keep & some
    if keep is not None:
        k = jnp.where(keep, k, jnp.zeros((), k.dtype))
        v = jnp.where(keep, v, jnp.zeros((), v.dtype))
    return q, k, v


def block_of(x: Array, q_start: Array | int, k_start: Array | int, block_q: int, block_k: int):
    """Slice one block out of a mask whose seq axes may be broadcast (size 1)."""
    if x.shape[-2] != 1:
        x = jax.lax.dynamic_slice_in_dim(x, q_start, block_q, axis=-2)
    if x.shape[-1] != 1:
        x = jax.lax.dynamic_slice_in_dim(x, k_start, block_k, axis=-1)
    return x


def data_mask(
    masks: Masks, q_start: Array | int, k_start: Array | int, block_q: int, block_k: int
) -> Array | None:
    """AND of the data-dependent masks over one block (None when there are none)."""
    allowed = None

    def conj(a, b):
        return b if a is None else a & b

    if masks.key_mask is not None:
        allowed = conj(allowed, block_of(masks.key_mask, q_start, k_start, block_q, block_k))
    if masks.pair_mask is not None:
        allowed = conj(allowed, block_of(masks.pair_mask, q_start, k_start, block_q, block_k))
    if masks.q_segment_ids is not None and masks.kv_segment_ids is not None:
        qs = block_of(masks.q_segment_ids, q_start, k_start, block_q, block_k)
        ks = block_of(masks.kv_segment_ids, q_start, k_start, block_q, block_k)
        allowed = conj(allowed, qs == ks)
    return allowed


# --- dropout: a counter-based hash, so a pattern never depends on how work is blocked ---


def _mix(h: UInt32[Array, "*b"]) -> UInt32[Array, "*b"]:
    """A 32-bit integer finaliser ("lowbias32"); bijective and well mixed."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x846CA68B)
    return h ^ (h >> 16)


def dropout_seed(key: Array) -> UInt32[Array, ""]:
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
    row = _mix(_mix(seed ^ head_index.astype(jnp.uint32)) ^ q_pos.astype(jnp.uint32))
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
