"""Blockwise backward kernel: recomputes each scheduled block from q, k, v and lse.

Gradients accumulate in the statistics dtype; nothing of size seq_q x seq_k is stored.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array

from . import _blocks
from ._config import KernelConfig, stat_dtype
from ._masking import Masks
from ._schedule import block_schedule


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
    # d lse / d s = softmax, so an lse cotangent just shifts the softmax-backward delta.
    delta = jnp.sum(d_out.astype(stat) * out.astype(stat), axis=-1) - d_lse.astype(stat)
    # Rows with no key have lse = -inf and all-masked logits; any finite shift gives p = 0.
    lse = jnp.where(lse == -jnp.inf, 0.0, lse)
    d_q = jnp.zeros(q.shape, stat)
    d_k = jnp.zeros(k.shape, stat)
    d_v = jnp.zeros(v.shape, stat)
    bq, bk = cfg.block_q, cfg.block_k

    def step(carry, pair, positional):
        d_q, d_k, d_v = carry
        q_start, k_start = pair[0] * bq, pair[1] * bk
        q_blk = _blocks.rows(q, q_start, bq, 3)
        k_blk = _blocks.rows(k, k_start, bk, 2)
        v_blk = _blocks.rows(v, k_start, bk, 2)
        do_blk = _blocks.rows(d_out, q_start, bq, 3)
        lse_blk = _blocks.rows(lse, q_start, bq, 3)
        delta_blk = _blocks.rows(delta, q_start, bq, 3)
        mask = _blocks.allowed(cfg, masks, q_start, k_start, positional)
        grads = (
            _blocks.rows(d_q, q_start, bq, 3),
            _blocks.rows(d_k, k_start, bk, 2),
            _blocks.rows(d_v, k_start, bk, 2),
        )

        def update(grads):
            dq_b, dk_b, dv_b = grads
            s, t = _blocks.logits(cfg, q_blk, k_blk)
            if mask is not None:
                s = jnp.where(mask, s, -jnp.inf)
            p = jnp.exp(s - lse_blk[..., None])
            dp = jnp.einsum(
                "bhgqd,bhkd->bhgqk", do_blk, v_blk, preferred_element_type=stat
            )
            drop = _blocks.dropout_multiplier(cfg, seed, q.shape, q_start, k_start, stat)
            if drop is not None:
                p_v, dp = p * drop, dp * drop
            else:
                p_v = p
            dv_b = dv_b + jnp.einsum(
                "bhgqk,bhgqd->bhkd", p_v.astype(v.dtype), do_blk, preferred_element_type=stat
            )
            ds = p * (dp - delta_blk[..., None])
            if t is not None:
                ds = ds * (1.0 - t * t)
            ds = (ds * jnp.asarray(cfg.scale, stat)).astype(q.dtype)
            dq_b = dq_b + jnp.einsum("bhgqk,bhkd->bhgqd", ds, k_blk, preferred_element_type=stat)
            dk_b = dk_b + jnp.einsum("bhgqk,bhgqd->bhkd", ds, q_blk, preferred_element_type=stat)
            return dq_b, dk_b, dv_b

        dq_b, dk_b, dv_b = _blocks.skip_if_empty(mask, update, lambda g: g, grads)
        d_q = jax.lax.dynamic_update_slice_in_dim(d_q, dq_b, q_start, axis=3)
        d_k = jax.lax.dynamic_update_slice_in_dim(d_k, dk_b, k_start, axis=2)
        d_v = jax.lax.dynamic_update_slice_in_dim(d_v, dv_b, k_start, axis=2)
        return (d_q, d_k, d_v), None

    schedule = block_schedule(cfg.seq_q, cfg.seq_k, bq, bk, cfg.window, cfg.offset)
    carry = (d_q, d_k, d_v)
    for pairs, positional in ((schedule.partial, True), (schedule.full, False)):
        if len(pairs):
            carry, _ = jax.lax.scan(
                lambda c, p, positional=positional: step(c, p, positional),
                carry,
                jnp.asarray(pairs),
            )
    d_q, d_k, d_v = carry
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype)
