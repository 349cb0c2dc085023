"""Per-block pieces shared by the forward and backward kernels: slicing, logits, masks,
and the loop over one band of blocks."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ._config import KernelConfig
from ._masking import Masks, data_mask, dropout_keep, head_index, positional_mask
from ._schedule import Bands


def rows(x: Array, start: Array, size: int, axis: int) -> Array:
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def logits(cfg: KernelConfig, q_blk: Array, k_blk: Array) -> tuple[Array, Array | None]:
    """Logits of one block in the statistics dtype, from queries already multiplied by
    the scale (one pass over q instead of one over every logit).

    Returns `(s, tanh)`: the capped logits and, with a softcap, the tanh the backward
    pass needs for the cap's derivative.
    """
    stat = jnp.promote_types(q_blk.dtype, jnp.float32)
    s = jnp.einsum("bhgqd,bhkd->bhgqk", q_blk, k_blk, preferred_element_type=stat)
    if cfg.softcap is None:
        return s, None
    cap = jnp.asarray(cfg.softcap, stat)
    t = jnp.tanh(s * (1.0 / cap))
    return cap * t, t


def scaled(cfg: KernelConfig, q: Array) -> Array:
    return q * jnp.asarray(cfg.scale, q.dtype)


def allowed(
    cfg: KernelConfig, masks: Masks, q_start: Array, k_start: Array, positional: bool
) -> Array | None:
    """Which pairs of the block attend, `(b|1, h|1, g|1, block_q|1, block_k)` (None: all)."""
    mask = data_mask(masks, q_start, k_start, cfg.block_q, cfg.block_k)
    if positional:
        q_pos = q_start + jnp.arange(cfg.block_q, dtype=jnp.int32).reshape(1, 1, 1, -1, 1)
        k_pos = k_start + jnp.arange(cfg.block_k, dtype=jnp.int32).reshape(1, 1, 1, 1, -1)
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
    q_pos = q_start + jnp.arange(cfg.block_q, dtype=jnp.int32)[:, None]
    k_pos = k_start + jnp.arange(cfg.block_k, dtype=jnp.int32)[None, :]
    keep = dropout_keep(seed, head_index(batch, kv_heads, groups), q_pos[None, None, None],
                        k_pos[None, None, None], cfg.dropout_rate)
    return jnp.where(keep, jnp.asarray(1.0 / (1.0 - cfg.dropout_rate), dtype),
                     jnp.asarray(0.0, dtype))


def skip_if_empty(mask: Array | None, has_data_mask: bool, compute, keep, operands):
    """Run `compute` unless the data masks empty the block (then `keep`).

    Causal and window emptiness is handled statically by the schedule; this catches
    blocks emptied by padding masks and segment ids at run time.
    """
    if mask is None or not has_data_mask:
        return compute(operands)
    return jax.lax.cond(jnp.any(mask), compute, keep, operands)


def over_band(
    bands: Bands, outer: Array, step: Callable[[Any, Array, bool], Any], carry: Any
) -> Any:
    """Fold `step(carry, inner_block, positional)` over the inner blocks of one outer
    block: first the whole ones (no positional mask), then the partial ones at either end
    of the band. Trip counts are dynamic, so every outer block shares one compiled loop."""
    lo, full_lo, full_hi, hi = (jnp.asarray(x)[outer] for x in bands)
    if int(np.max(bands.full_hi - bands.full_lo, initial=0)) > 0:
        carry = jax.lax.fori_loop(
            full_lo, full_hi, lambda j, c: step(c, j, False), carry
        )
    if bands.max_partial > 0:
        n_left = full_lo - lo

        def partial(t, c):
            return step(c, jnp.where(t < n_left, lo + t, full_hi + t - n_left), True)

        carry = jax.lax.fori_loop(0, n_left + hi - full_hi, partial, carry)
    return carry
