"""Blockwise forward kernel: online softmax over the scheduled block pairs.

Per kv head (`_blocks.per_head`), an outer scan over query blocks; each query block's
running statistics live in the carry of an inner loop over its band of key blocks
(`_blocks.over_band`), so no state is written back to a full-size array between blocks.
Inputs are in the internal layout (`_layout`), padded to whole blocks. No validation here.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array

from . import _blocks
from ._config import KernelConfig, stat_dtype
from ._masking import Masks
from ._schedule import band_ranges


def forward(
    cfg: KernelConfig, q: Array, k: Array, v: Array, masks: Masks, seed: Array | None
) -> tuple[Array, Array]:
    """Returns `out` `(b, h, g, seq_q_padded, dim_v)` in q's dtype and `lse`
    `(b, h, g, seq_q_padded)` in the statistics dtype (-inf for rows with no key)."""
    groups, seq_q_pad = q.shape[2], q.shape[3]
    dim_v = v.shape[-1]
    stat = stat_dtype(q.dtype)
    bq, bk = cfg.block_q, cfg.block_k
    has_data = not masks.is_empty
    bands = band_ranges(cfg.seq_q, cfg.seq_k, bq, bk, cfg.window, cfg.offset, by="q")
    # A finite floor for the running max: a row that has seen no key keeps it, and
    # exp(-inf - floor) = 0, exp(floor - floor) = 1, so no -inf guard is needed anywhere.
    floor = jnp.asarray(jnp.finfo(stat).min, stat)

    def head_kernel(head: _blocks.Head, arrays):
        q, k, v = arrays  # (g, seq_q, d), (seq_k, d), (seq_k, dv)
        q = _blocks.scaled(cfg, q)
        limits = _blocks.segment_limits(cfg, head.masks, by="q")

        def query_block(_, i):
            q_start = i * bq
            q_blk = _blocks.rows(q, q_start, bq, 1)

            def step(carry, j, positional):
                k_start = j * bk
                k_blk = _blocks.rows(k, k_start, bk, 0)
                v_blk = _blocks.rows(v, k_start, bk, 0)
                mask = _blocks.allowed(cfg, head.masks, q_start, k_start, positional)

                def update(carry):
                    acc, row_max, row_sum = carry
                    s, _ = _blocks.logits(cfg, q_blk, k_blk)
                    if mask is not None:
                        s = jnp.where(mask, s, -jnp.inf)
                    new_max = jnp.maximum(row_max, s.max(axis=-1))
                    p = jnp.exp(s - new_max[..., None])
                    alpha = jnp.exp(row_max - new_max)
                    new_sum = alpha * row_sum + p.sum(axis=-1)
                    drop = _blocks.dropout_multiplier(cfg, seed, head, q_start, k_start, stat)
                    p_v = p if drop is None else p * drop
                    pv = _blocks.matmul(p_v.astype(v.dtype), v_blk, "qk,kd->qd", stat)
                    return alpha[..., None] * acc + pv, new_max, new_sum

                return _blocks.skip_if_empty(mask, has_data, update, lambda c: c, carry)

            # `*_like(q_blk)`: under shard_map the state must vary across devices as q does.
            init = (
                jnp.zeros_like(q_blk, stat, shape=(groups, bq, dim_v)),
                jnp.full_like(q_blk, floor, stat, shape=(groups, bq)),
                jnp.zeros_like(q_blk, stat, shape=(groups, bq)),
            )
            acc, row_max, row_sum = _blocks.over_band(bands, i, step, init, limits)
            attended = row_sum > 0
            safe_sum = jnp.where(attended, row_sum, 1.0)
            out = jnp.where(attended[..., None], acc / safe_sum[..., None], 0.0)
            lse = jnp.where(attended, row_max + jnp.log(safe_sum), -jnp.inf)
            return None, (out.astype(q.dtype), lse)

        num_q = seq_q_pad // bq
        _, (out, lse) = jax.lax.scan(query_block, None, jnp.arange(num_q, dtype=jnp.int32))
        # (num_q, g, bq, ...) -> (g, num_q * bq, ...)
        out = jnp.moveaxis(out, 0, 1).reshape(groups, seq_q_pad, dim_v)
        lse = jnp.moveaxis(lse, 0, 1).reshape(groups, seq_q_pad)
        return out, lse

    return _blocks.per_head(head_kernel, masks, (q, k, v))
