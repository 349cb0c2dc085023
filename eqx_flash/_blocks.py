"""Per-block pieces shared by the forward and backward kernels: slicing, logits, masks."""

import jax
import jax.numpy as jnp
from jaxtyping import Array

from ._config import KernelConfig
from ._masking import Masks, data_mask, dropout_keep, head_index, positional_mask


def rows(x: Array, start: Array, size: int, axis: int) -> Array:
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def positions(cfg: KernelConfig, q_start: Array, k_start: Array) -> tuple[Array, Array]:
    """Query and key positions of a block, shaped to broadcast against `(b, h, g, q, k)`."""
    q_pos = q_start + jnp.arange(cfg.block_q, dtype=jnp.int32).reshape(1, 1, 1, -1, 1)
    k_pos = k_start + jnp.arange(cfg.block_k, dtype=jnp.int32).reshape(1, 1, 1, 1, -1)
    return q_pos, k_pos


def logits(cfg: KernelConfig, q_blk: Array, k_blk: Array) -> tuple[Array, Array | None]:
    """Scaled (and soft-capped) logits of one block in the statistics dtype.

    Returns `(s, tanh)`: the capped logits and, with a softcap, the tanh the backward
    pass needs for the cap's derivative.
    """
    stat = jnp.promote_types(q_blk.dtype, jnp.float32)
    s = jnp.einsum("bhgqd,bhkd->bhgqk", q_blk, k_blk, preferred_element_type=stat)
    s = s * jnp.asarray(cfg.scale, stat)
    if cfg.softcap is None:
        return s, None
    cap = jnp.asarray(cfg.softcap, stat)
    t = jnp.tanh(s / cap)
    return cap * t, t


def allowed(
    cfg: KernelConfig, masks: Masks, q_start: Array, k_start: Array, positional: bool
) -> Array | None:
    """Which pairs of the block attend (None: all of them)."""
    mask = data_mask(masks, q_start, k_start, cfg.block_q, cfg.block_k)
    if positional:
        q_pos, k_pos = positions(cfg, q_start, k_start)
        pos = positional_mask(q_pos, k_pos, cfg.offset, cfg.seq_k, cfg.window)
        mask = pos if mask is None else mask & pos
    return mask


def dropout_multiplier(
    cfg: KernelConfig, seed: Array | None, shape: tuple[int, ...], q_start: Array,
    k_start: Array, dtype: jnp.dtype,
) -> Array | None:
    """`keep / (1 - rate)` for one block (None without dropout)."""
    if seed is None or cfg.dropout_rate == 0.0:
        return None
    batch, kv_heads, groups = shape[:3]
    q_pos, k_pos = positions(cfg, q_start, k_start)
    keep = dropout_keep(seed, head_index(batch, kv_heads, groups), q_pos, k_pos,
                        cfg.dropout_rate)
    return jnp.where(keep, jnp.asarray(1.0 / (1.0 - cfg.dropout_rate), dtype),
                     jnp.asarray(0.0, dtype))


def skip_if_empty(mask: Array | None, compute, keep, operands):
    """Run `compute` unless the data masks empty the block (then `keep`).

    Causal and window emptiness is handled statically by the schedule; this catches
    blocks emptied by padding masks and segment ids at run time.
    """
    if mask is None:
        return compute(operands)
    return jax.lax.cond(jnp.any(mask), compute, keep, operands)
