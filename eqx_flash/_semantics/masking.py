"""The one definition of which (query, key) pairs attend.

The kernels evaluate these functions on one block of positions, the reference on the
whole grid, and the schedule (`_kernels.schedule`) reasons about the positional part
block by block, so all three agree by construction.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from .._core.operands import Operands
from .._core.options import Window


def shifted(p: Array, by: int) -> Array:
    """`p + by` for a Python int `by`, saturated at the ends of `p`'s integer dtype:
    exact wherever the sum fits, the dtype's end where it does not. A window's ends
    `q_pos - left`, `q_pos + right` would wrap round for positions near the int32
    limits (and then exclude every key); saturated, `k >= p - left` and `k <= p + right`
    stay exact for every int32 key. Costs a compare and a select on the rows only."""
    if by == 0:
        return p
    info = jnp.iinfo(p.dtype)
    end, limit = (info.max, info.max - by) if by > 0 else (info.min, info.min - by)
    if not info.min <= limit <= info.max:  # every p passes the end
        return jnp.full_like(p, end)
    past = p > limit if by > 0 else p < limit
    # `by` modulo 2^bits as an in-range constant: the wrapped sum is exact where it fits.
    wrapped = (by - info.min) % (1 << info.bits) + info.min
    return jnp.where(past, jnp.asarray(end, p.dtype), p + jnp.asarray(wrapped, p.dtype))


def within_window(allowed: Array | None, k_pos: Array, p: Array, window: Window) -> Array:
    """`allowed` (None: everything) and `p - left <= k_pos <= p + right`, the one
    statement of the window (a side that is None is unbounded; at least one is not when
    `allowed` is None), exact for any integer positions (`shifted`)."""
    for inside in (None if window.left is None else k_pos >= shifted(p, -window.left),
                   None if window.right is None else k_pos <= shifted(p, window.right)):
        if inside is not None:
            allowed = inside if allowed is None else allowed & inside
    assert allowed is not None
    return allowed


def positional_mask(
    q_pos: Int[Array, "*#b"], k_pos: Int[Array, "*#b"], offset: int, seq_k: int, window: Window
) -> Bool[Array, "*#b"]:
    """Window around `p = q_pos + offset` (causal is `right=0`; the public API aligns
    bottom-right, `offset = seq_k - seq_q`) and key padding (`k_pos < seq_k`).

    The result broadcasts against the positions (without a window it depends on `k_pos`
    alone)."""
    return within_window(k_pos < seq_k, k_pos, q_pos + offset, window)


def length_mask(
    q_pos: Int[Array, "*#b"], k_pos: Int[Array, "*#b"], q_len: Array | int, kv_len: Array | int,
    window: Window,
) -> Bool[Array, "*#b"]:
    """Variable lengths (right padding): query `i < q_len` sees key `j < kv_len`, within
    `window` around `p = i + kv_len - q_len` (causal and window align bottom-right on the
    *valid* lengths). With lengths the kernels' static band ignores the window
    (`KernelConfig.band_window`) and this predicate applies it instead."""
    allowed = (q_pos < q_len) & (k_pos < kv_len)
    return within_window(allowed, k_pos, q_pos + (kv_len - q_len), window)


def position_mask(
    ops: Operands, q_start: Array | int, k_start: Array | int, block_q: int, block_k: int,
    window: Window,
) -> Array | None:
    """Causal and the window measured on the positions of one block (`ops.q_positions`,
    `ops.kv_positions`): `q - left <= kv <= q + right`, absolute (no bottom-right
    offset). None without positions or without a window (then positions mask nothing)."""
    if not ops.has_positions or window.is_unbounded:
        return None
    qp = block_of(ops.q_positions, q_start, k_start, block_q, block_k)
    kp = block_of(ops.kv_positions, q_start, k_start, block_q, block_k)
    return within_window(None, kp, qp, window)


def length_window(ops: Operands, window: Window) -> Window:
    """The window `length_mask` aligns on the valid lengths: none with positions, which
    place the window themselves (`position_mask`)."""
    return Window(None, None) if ops.has_positions else window


def lengths_or(ops: Operands, seq_q: int, seq_k: int) -> tuple[Array | int, Array | int]:
    """`(q_len, kv_len)` of `ops`, the full sequence where a length is not given."""
    q_len = seq_q if ops.q_lengths is None else ops.q_lengths
    kv_len = seq_k if ops.kv_lengths is None else ops.kv_lengths
    return q_len, kv_len


def valid_rows(
    q: Array, k: Array, v: Array, ops: Operands, seq_q: int, seq_k: int, keys: bool = True
) -> tuple[Array, Array, Array]:
    """q, k, v (internal layout, unpadded) with the rows that can never attend set to 0:
    queries at or past `q_lengths`, keys at or past `kv_lengths` or masked by the key mask
    for every query of their kv head. O(N d) once, so that NaN or inf in padding (an
    uninitialised cache) reaches no output and no gradient: a masked logit is replaced by
    -inf, but its weight 0 times a NaN value would still be NaN. The `where` also gives
    those rows zero cotangents."""
    if ops.q_lengths is not None:
        q_pos = jnp.arange(seq_q, dtype=jnp.int32).reshape(1, 1, 1, -1, 1)
        q = jnp.where(q_pos < ops.q_lengths, q, jnp.zeros((), q.dtype))
    if not keys:  # (`keys=False`: the queries only)
        return q, k, v
    keep = None
    if ops.kv_lengths is not None:
        k_pos = jnp.arange(seq_k, dtype=jnp.int32).reshape(1, 1, -1, 1)
        keep = k_pos < ops.kv_lengths[:, :, 0]  # (batch|1, 1, seq_k, 1)
    if ops.key_mask is not None:
        # (b|1, h|1, g|1, 1, seq_k) -> attended by some query head of the kv head
        some = jnp.any(ops.key_mask, axis=(2, 3))[..., None]  # (b|1, h|1, seq_k, 1)
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
    ops: Operands, q_start: Array | int, k_start: Array | int, block_q: int, block_k: int
) -> Array | None:
    """AND of the data-dependent masks over one block (None when there are none)."""
    allowed = None

    def conj(a, b):
        return b if a is None else a & b

    if ops.key_mask is not None:
        allowed = conj(allowed, block_of(ops.key_mask, q_start, k_start, block_q, block_k))
    if ops.pair_mask is not None:
        allowed = conj(allowed, block_of(ops.pair_mask, q_start, k_start, block_q, block_k))
    if ops.q_segment_ids is not None and ops.kv_segment_ids is not None:
        qs = block_of(ops.q_segment_ids, q_start, k_start, block_q, block_k)
        ks = block_of(ops.kv_segment_ids, q_start, k_start, block_q, block_k)
        allowed = conj(allowed, qs == ks)
    return allowed
