"""Blockwise backward kernel: recomputes each scheduled block from q, k, v and lse.

Per kv head (`_blocks.per_head`), key blocks are the outer loop: a key block's dk and dv
stay in the carry of an inner loop over its band of query blocks and are emitted once;
dq accumulates in place. Gradients accumulate in the statistics dtype; nothing of size
seq_q x seq_k is stored.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array

from . import _blocks
from ._config import KernelConfig, stat_dtype
from ._masking import Masks
from ._schedule import band_ranges


def backward(
    cfg: KernelConfig,
    q: Array,
    k: Array,
    v: Array,
    out: Array,
    lse: Array,
    d_out: Array,
    d_lse: Array,
    masks: Masks,
    seed: Array | None,
) -> tuple[Array, Array, Array]:
    """Cotangents of q, k, v given those of `out` and `lse` (all in the internal layout)."""
    stat = stat_dtype(q.dtype)
    seq_k_pad, dim = k.shape[2:]
    dim_v = v.shape[-1]
    bq, bk = cfg.block_q, cfg.block_k
    has_data = not masks.is_empty
    # d lse / d s = softmax, so an lse cotangent just shifts the softmax-backward delta.
    delta = jnp.sum(d_out.astype(stat) * out.astype(stat), axis=-1) - d_lse.astype(stat)
    # Rows with no key have lse = -inf and all-masked logits; any finite shift gives p = 0.
    lse = jnp.where(lse == -jnp.inf, 0.0, lse)
    bands = band_ranges(cfg.seq_q, cfg.seq_k, bq, bk, cfg.window, cfg.offset, by="k")

    def head_kernel(head: _blocks.Head, arrays):
        q, k, v, d_out, lse, delta = arrays
        q_s = _blocks.scaled(cfg, q)

        def key_block(d_q, j):
            k_start = j * bk
            k_blk = _blocks.rows(k, k_start, bk, 0)
            v_blk = _blocks.rows(v, k_start, bk, 0)

            def step(carry, i, positional):
                q_start = i * bq
                q_blk = _blocks.rows(q_s, q_start, bq, 1)
                do_blk = _blocks.rows(d_out, q_start, bq, 1)
                lse_blk = _blocks.rows(lse, q_start, bq, 1)
                delta_blk = _blocks.rows(delta, q_start, bq, 1)
                mask = _blocks.allowed(cfg, head.masks, q_start, k_start, positional)

                def update(carry):
                    d_q, dk_b, dv_b = carry
                    s, t = _blocks.logits(cfg, q_blk, k_blk)
                    if mask is not None:
                        s = jnp.where(mask, s, -jnp.inf)
                    p = jnp.exp(s - lse_blk[..., None])
                    dp = _blocks.matmul(do_blk, v_blk, "qd,kd->qk", stat)
                    drop = _blocks.dropout_multiplier(cfg, seed, head, q_start, k_start, stat)
                    if drop is not None:
                        p_v, dp = p * drop, dp * drop
                    else:
                        p_v = p
                    dv_b = dv_b + _blocks.matmul_t(p_v.astype(v.dtype), do_blk, stat)
                    ds = p * (dp - delta_blk[..., None])
                    if t is not None:
                        ds = ds * (1.0 - t * t)
                    ds = ds.astype(q.dtype)
                    # dk against the scaled queries is exact; dq is scaled once at the end.
                    dk_b = dk_b + _blocks.matmul_t(ds, q_blk, stat)
                    dq_b = _blocks.rows(d_q, q_start, bq, 1) + _blocks.matmul(
                        ds, k_blk, "qk,kd->qd", stat
                    )
                    d_q = jax.lax.dynamic_update_slice_in_dim(d_q, dq_b, q_start, axis=1)
                    return d_q, dk_b, dv_b

                return _blocks.skip_if_empty(mask, has_data, update, lambda c: c, carry)

            # `*_like`: under shard_map the state must vary across devices as k and v do.
            init = (d_q, jnp.zeros_like(k_blk, stat), jnp.zeros_like(v_blk, stat))
            d_q, dk_b, dv_b = _blocks.over_band(bands, j, step, init)
            if not _blocks.folds_scale(q.dtype):
                dk_b = dk_b * jnp.asarray(cfg.scale, stat)  # q_s was left unscaled
            return d_q, (dk_b.astype(k.dtype), dv_b.astype(v.dtype))

        num_k = seq_k_pad // bk
        d_q, (d_k, d_v) = jax.lax.scan(
            key_block, jnp.zeros_like(q, stat), jnp.arange(num_k, dtype=jnp.int32)
        )
        d_q = d_q * jnp.asarray(cfg.scale, stat)
        return d_q.astype(q.dtype), d_k.reshape(seq_k_pad, dim), d_v.reshape(seq_k_pad, dim_v)

    return _blocks.per_head(head_kernel, masks, (q, k, v, d_out, lse, delta))
