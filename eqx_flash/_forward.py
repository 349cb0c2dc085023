"""Blockwise forward kernel: online softmax over the scheduled block pairs.

Inputs are in the internal layout (`_layout`), padded to whole blocks. No validation here.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array

from . import _blocks
from ._config import KernelConfig, stat_dtype
from ._masking import Masks
from ._schedule import block_schedule


def forward(
    cfg: KernelConfig, q: Array, k: Array, v: Array, masks: Masks, seed: Array | None
) -> tuple[Array, Array]:
    """Returns `out` `(b, h, g, seq_q_padded, dim_v)` in q's dtype and `lse`
    `(b, h, g, seq_q_padded)` in the statistics dtype (-inf for rows with no key)."""
    batch, kv_heads, groups, seq_q_pad, _ = q.shape
    dim_v = v.shape[-1]
    stat = stat_dtype(q.dtype)
    acc = jnp.zeros((batch, kv_heads, groups, seq_q_pad, dim_v), stat)
    row_max = jnp.full((batch, kv_heads, groups, seq_q_pad), -jnp.inf, stat)
    row_sum = jnp.zeros((batch, kv_heads, groups, seq_q_pad), stat)
    bq, bk = cfg.block_q, cfg.block_k

    def step(carry, pair, positional):
        acc, row_max, row_sum = carry
        q_start, k_start = pair[0] * bq, pair[1] * bk
        q_blk = _blocks.rows(q, q_start, bq, 3)
        k_blk = _blocks.rows(k, k_start, bk, 2)
        v_blk = _blocks.rows(v, k_start, bk, 2)
        mask = _blocks.allowed(cfg, masks, q_start, k_start, positional)
        state = (
            _blocks.rows(acc, q_start, bq, 3),
            _blocks.rows(row_max, q_start, bq, 3),
            _blocks.rows(row_sum, q_start, bq, 3),
        )

        def update(state):
            acc_b, max_b, sum_b = state
            s, _ = _blocks.logits(cfg, q_blk, k_blk)
            if mask is not None:
                s = jnp.where(mask, s, -jnp.inf)
            new_max = jnp.maximum(max_b, s.max(axis=-1))
            # A row that has seen no key yet keeps max -inf; shift it by 0 instead.
            shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)
            p = jnp.exp(s - shift[..., None])
            alpha = jnp.exp(max_b - shift)
            new_sum = alpha * sum_b + p.sum(axis=-1)
            drop = _blocks.dropout_multiplier(cfg, seed, q.shape, q_start, k_start, stat)
            p_v = p if drop is None else p * drop
            pv = jnp.einsum(
                "bhgqk,bhkd->bhgqd", p_v.astype(v.dtype), v_blk, preferred_element_type=stat
            )
            return alpha[..., None] * acc_b + pv, new_max, new_sum

        acc_b, max_b, sum_b = _blocks.skip_if_empty(mask, update, lambda st: st, state)
        acc = jax.lax.dynamic_update_slice_in_dim(acc, acc_b, q_start, axis=3)
        row_max = jax.lax.dynamic_update_slice_in_dim(row_max, max_b, q_start, axis=3)
        row_sum = jax.lax.dynamic_update_slice_in_dim(row_sum, sum_b, q_start, axis=3)
        return (acc, row_max, row_sum), None

    schedule = block_schedule(cfg.seq_q, cfg.seq_k, bq, bk, cfg.window, cfg.offset)
    carry = (acc, row_max, row_sum)
    for pairs, positional in ((schedule.partial, True), (schedule.full, False)):
        if len(pairs):
            carry, _ = jax.lax.scan(
                lambda c, p, positional=positional: step(c, p, positional),
                carry,
                jnp.asarray(pairs),
            )
    acc, row_max, row_sum = carry
    attended = row_sum > 0
    safe_sum = jnp.where(attended, row_sum, 1.0)
    out = jnp.where(attended[..., None], acc / safe_sum[..., None], 0.0)
    lse = jnp.where(attended, row_max + jnp.log(safe_sum), -jnp.inf)
    return out.astype(q.dtype), lse
