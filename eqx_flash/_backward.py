"""Blockwise backward kernel: recomputes each scheduled block from q, k, v and lse.

Per kv head (`_blocks.per_head`), key blocks are the outer loop: a key block's dk and dv
stay in the carry of an inner loop over its band of query blocks and are emitted once;
dq accumulates in place. Gradients accumulate in the statistics dtype; nothing of size
seq_q x seq_k is stored.

The logits are formed transposed, `(block_k, groups * block_q)`, with q, dO and dq held
transposed too: then all five block products are plain row-major matmuls. In the
untransposed form dk and dv contract over the rows of both operands (`p^T dO`), which
XLA's CPU GEMM runs at about half speed.
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
    groups, seq_q_pad, dim = q.shape[2:]
    seq_k_pad, dim_v = v.shape[2:]
    bq, bk = cfg.block_q, cfg.block_k
    num_q, num_k = seq_q_pad // bq, seq_k_pad // bk
    has_data = not masks.is_empty
    # d lse / d s = softmax, so an lse cotangent just shifts the softmax-backward delta.
    delta = jnp.sum(d_out.astype(stat) * out.astype(stat), axis=-1) - d_lse.astype(stat)
    # Rows with no key have lse = -inf and all-masked logits; any finite shift gives p = 0.
    lse = jnp.where(lse == -jnp.inf, 0.0, lse)
    bands = band_ranges(cfg.seq_q, cfg.seq_k, bq, bk, cfg.window, cfg.offset, by="k")

    def q_blocks(x: Array) -> tuple[Array, Array]:
        """`(g, seq_q, c)` -> row blocks `(num_q, g * bq, c)` and their transposes."""
        x = x.reshape(groups, num_q, bq, x.shape[-1])
        rows = x.transpose(1, 0, 2, 3).reshape(num_q, groups * bq, x.shape[-1])
        return rows, rows.transpose(0, 2, 1)

    def head_kernel(head: _blocks.Head, arrays):
        q, k, v, d_out, lse, delta = arrays
        q_rows, q_cols = q_blocks(_blocks.scaled(cfg, q))
        do_rows, do_cols = q_blocks(d_out)
        lse_cols = q_blocks(lse[..., None])[1]  # (num_q, 1, g * bq)
        delta_cols = q_blocks(delta[..., None])[1]
        k_rows = k.reshape(num_k, bk, dim)
        k_cols = k_rows.transpose(0, 2, 1)
        v_rows = v.reshape(num_k, bk, dim_v)
        limits = _blocks.segment_limits(cfg, head.masks, by="k")

        def key_block(dq_cols, j):
            k_start = j * bk
            k_blk, kt_blk, v_blk = k_rows[j], k_cols[j], v_rows[j]

            def step(carry, i, positional):
                q_start = i * bq
                mask = _blocks.allowed_t(cfg, head.masks, q_start, k_start, positional,
                                         groups)

                def update(carry):
                    dq_cols, dk_b, dv_b = carry
                    s, t = _blocks.logits_t(cfg, k_blk, q_cols[i])
                    if mask is not None:
                        s = jnp.where(mask, s, -jnp.inf)
                    p = jnp.exp(s - lse_cols[i])
                    dp = jnp.matmul(v_blk, do_cols[i], preferred_element_type=stat)
                    drop = _blocks.dropout_multiplier_t(cfg, seed, head, q_start, k_start,
                                                        stat)
                    if drop is not None:
                        p_v, dp = p * drop, dp * drop
                    else:
                        p_v = p
                    dv_b = dv_b + jnp.matmul(p_v.astype(v.dtype), do_rows[i],
                                             preferred_element_type=stat)
                    ds = p * (dp - delta_cols[i])
                    if t is not None:
                        ds = ds * (1.0 - t * t)
                    ds = ds.astype(q.dtype)
                    # dk against the scaled queries is exact; dq is scaled once at the end.
                    dk_b = dk_b + jnp.matmul(ds, q_rows[i], preferred_element_type=stat)
                    dq_blk = dq_cols[i] + jnp.matmul(kt_blk, ds, preferred_element_type=stat)
                    dq_cols = jax.lax.dynamic_update_index_in_dim(dq_cols, dq_blk, i, axis=0)
                    return dq_cols, dk_b, dv_b

                return _blocks.skip_if_empty(mask, has_data, update, lambda c: c, carry)

            # `*_like`: under shard_map the state must vary across devices as k and v do.
            init = (dq_cols, jnp.zeros_like(k_blk, stat), jnp.zeros_like(v_blk, stat))
            dq_cols, dk_b, dv_b = _blocks.over_band(bands, j, step, init, limits)
            if not _blocks.folds_scale(q.dtype):
                dk_b = dk_b * jnp.asarray(cfg.scale, stat)  # q was left unscaled
            return dq_cols, (dk_b.astype(k.dtype), dv_b.astype(v.dtype))

        dq_cols, (d_k, d_v) = jax.lax.scan(
            key_block, jnp.zeros_like(q_cols, stat), jnp.arange(num_k, dtype=jnp.int32)
        )
        # (num_q, d, g * bq) -> (g, seq_q, d)
        d_q = dq_cols.reshape(num_q, dim, groups, bq).transpose(2, 0, 3, 1)
        d_q = d_q.reshape(groups, seq_q_pad, dim) * jnp.asarray(cfg.scale, stat)
        return d_q.astype(q.dtype), d_k.reshape(seq_k_pad, dim), d_v.reshape(seq_k_pad, dim_v)

    return _blocks.per_head(head_kernel, masks, (q, k, v, d_out, lse, delta))
