"""The one definition of which (query, key) pairs attend.

The kernels evaluate these functions on the values of one block (the operands sliced by
`_core.operands.block`, the block's positions), the reference on the whole grid, and the
block plan (`_kernels.schedule`) reasons about the window block by block with
`window_overlap`, so all three agree by construction.
"""

from typing import TypeVar, cast

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from .._core.config import KernelConfig
from .._core.operands import Operands
from .._core.options import Window

# Positions: JAX arrays in the kernels and the reference, NumPy in the static block plan.
P = TypeVar("P", Array, np.ndarray)

def shifted(p: P, by: int) -> P:
    """`p + by` for a Python int `by`, saturated at the ends of `p`'s integer dtype:
    exact wherever the sum fits, the dtype's end where it does not. A window's ends
    `q_pos - left`, `q_pos + right` would wrap round for positions near the int32
    limits (and then exclude every key); saturated, `k >= p - left` and `k <= p + right`
    stay exact for every int32 key. Costs a compare and a select on the rows only.
    (NumPy arrays, the static block plan's, stay NumPy.)"""
    if by == 0:
        return p
    xp = np if isinstance(p, np.ndarray) else jnp
    info = np.iinfo(p.dtype)
    end, limit = (info.max, info.max - by) if by > 0 else (info.min, info.min - by)
    if not info.min <= limit <= info.max:  # every p passes the end
        return cast(P, xp.full_like(p, end))
    past = p > limit if by > 0 else p < limit
    # `by` modulo 2^bits as an in-range constant: the wrapped sum is exact where it fits.
    wrapped = (by - info.min) % (1 << info.bits) + info.min
    return cast(P, xp.where(past, xp.asarray(end, p.dtype), p + xp.asarray(wrapped, p.dtype)))


def within_window(allowed: P | None, k_pos: P, p: P, window: Window) -> P:
    """`allowed` (None: everything) and `p - left <= k_pos <= p + right`, the one
    statement of the window (a side that is None is unbounded; at least one is not when
    `allowed` is None), exact for any integer positions (`shifted`)."""
    for inside in (None if window.left is None else k_pos >= shifted(p, -window.left),
                   None if window.right is None else k_pos <= shifted(p, window.right)):
        if inside is not None:
            allowed = inside if allowed is None else allowed & inside
    assert allowed is not None
    return allowed


def window_overlap(p_first: P, p_last: P, k_first: P, k_last: P, window: Window, some: P,
                   every: P) -> tuple[P, P]:
    """For queries at aligned positions `[p_first, p_last]` and keys at `[k_first,
    k_last]` (NumPy or JAX arrays, broadcasting): `(some & whether some pair is within
    the window, every & whether every pair is)`, by `within_window`. The differences
    `k - p` fill `[k_first - p_last, k_last - p_first]` and the window is an interval of
    differences, so both answers are exact, and one statement of the window serves the
    static block plan and the run-time limits as it serves the mask."""
    left, right = Window(window.left, None), Window(None, window.right)
    some = within_window(within_window(some, k_last, p_first, left), k_first, p_last, right)
    every = within_window(within_window(every, k_first, p_last, left), k_last, p_first, right)
    return some, every


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


def position_mask(blk: Operands, window: Window) -> Array | None:
    """Causal and the window measured on the positions of one block (`blk.q_positions`,
    `blk.kv_positions`): `q - left <= kv <= q + right`, absolute (no bottom-right
    offset). None without positions or without a window (then positions mask nothing)."""
    if not blk.has_positions or window.is_unbounded:
        return None
    return within_window(None, blk.kv_positions, blk.q_positions, window)


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


def data_mask(blk: Operands) -> Array | None:
    """AND of the data-dependent masks over one block of operand values (None when there
    are none)."""
    allowed = None

    def conj(a, b):
        return b if a is None else a & b

    if blk.key_mask is not None:
        allowed = conj(allowed, blk.key_mask)
    if blk.pair_mask is not None:
        allowed = conj(allowed, blk.pair_mask)
    if blk.q_segment_ids is not None and blk.kv_segment_ids is not None:
        allowed = conj(allowed, blk.q_segment_ids == blk.kv_segment_ids)
    return allowed


def allowed(cfg: KernelConfig, blk: Operands, q_pos: Array, k_pos: Array, positional: bool
            ) -> Array | None:
    """Which pairs of one block attend, `(groups|1, block_q|1, block_k)` (None: all), for
    a kernel configured by `cfg`: the data masks of the block's operand values `blk`,
    the lengths, and, where `positional` (a block the plan does not know to be whole),
    the band (`positional_mask` on the block's indices `q_pos`, `k_pos`) and the window
    on positions. `mask_mod` is the kernels' (`_mods.tracing`)."""
    mask = data_mask(blk)
    if positional:
        pos = positional_mask(q_pos, k_pos, cfg.offset, cfg.seq_k, cfg.band_window)
        mask = pos if mask is None else mask & pos
        # With positions and a window, `positional` also says the block is not whole by
        # position (`_kernels.schedule.position_limits`).
        by_position = position_mask(blk, cfg.window)
        if by_position is not None:
            mask = mask & by_position
    if blk.has_lengths:
        q_len, kv_len = lengths_or(blk, cfg.seq_q, cfg.seq_k)
        by_length = length_mask(q_pos, k_pos, q_len, kv_len, length_window(blk, cfg.window))
        mask = by_length if mask is None else mask & by_length
    return mask
