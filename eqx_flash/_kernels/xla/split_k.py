"""Flash-decoding forward: few queries against many keys, the keys split into `splits`
lanes whose partial results are merged by their log-sum-exp.

The regular forward walks a query block's key blocks one after another: with one or a
few queries, a long chain of tiny products. Here each loop step takes `splits`
consecutive key blocks at once (one contiguous slice of K and V, one wide product), and
lane `p` keeps its own online-softmax state over blocks `p, p + splits, ...`: the lanes are
the split-K partial results, merged at the end by `softmax.merge_all`. The loop runs
over the rounds that the run-time limits leave (lengths, segment ids, the band), so a
long, mostly empty cache costs its valid part. Same inputs and outputs as
`forward.forward`; the backward pass is the regular `backward.backward`.

It runs where the configuration says (`KernelConfig.split_k`: `policy.configure` sets
`splits` for few queries without score terms, score_mod or mask_mod). It copes with
garbage (NaN) in the keys and values that nothing attends, so the caller need not clean
K and V first: for one decoding step that clean-up pass would cost more than the
attention itself. (Under differentiation they are cleaned all the same:
`_autodiff.derivatives`.)
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array

from ..._core.config import KernelConfig, stat_dtype
from ..._core.operands import Operands, padded
from ..._core.shapes import ceil_div
from ..._semantics import softmax
from ..schedule import band_ranges, run_limits
from .heads import Head, Rows, per_head
from .tile import (
    allowed,
    attended_values,
    dropout_multiplier,
    logits,
    rows,
    scaled,
    unscan,
)


def split_k_forward(cfg: KernelConfig, q: Array, k: Array, v: Array, ops: Operands
                    ) -> tuple[Array, Array, Array]:
    """`forward.forward` with the key blocks taken `cfg.splits` at a time, one lane each.
    K and V are read in place, a round at a time (`heads.Rows`): a long cache is read
    once, not first copied head by head."""
    return per_head(functools.partial(_split_k_head, cfg), ops, (q,), whole=(k, v),
                    parallel=cfg.parallel_heads)


def _split_k_head(
    cfg: KernelConfig, head: Head, arrays: tuple[Array, ...], kv: tuple[Rows, Rows],
) -> tuple[Array, Array, Array]:
    (q,) = arrays
    k, v = kv
    groups = q.shape[0]
    lanes, bk = cfg.splits, cfg.block_k
    width = lanes * bk
    seq_k = k.seq
    ops = head.operands
    if seq_k < width:  # one short round: pad it (small) with keys masked by position
        k, v = (Rows(jnp.pad(x(0, seq_k), ((0, width - seq_k), (0, 0)))) for x in (k, v))
        ops = padded(ops, None, width)
    bands = band_ranges(cfg, by="q")
    lo, hi = jnp.asarray(bands.lo), jnp.asarray(bands.hi)
    limits = run_limits(cfg, ops, by="q")
    if limits is not None:
        lo, hi = jnp.maximum(lo, limits[0]), jnp.minimum(hi, limits[1])
        hi = jnp.maximum(hi, lo)
    # One round's products and masks are those of one block `lanes` times wider.
    wide = dataclasses.replace(cfg, block_k=width)
    q = scaled(cfg, q)
    stat = stat_dtype(q.dtype)
    last_start = k.seq - width

    def query_block(_, i):
        q_start = i * cfg.block_q
        q_blk = rows(q, q_start, cfg.block_q, 1)  # (g, bq, d)
        state = softmax.start(q_blk, (lanes, groups, cfg.block_q, v.x.shape[-1]), stat)

        def one_round(r, state):
            # A ragged last round reads the last `width` keys, the ones before `r * width`
            # (already seen) masked: no padded copy of the cache.
            k_start = jnp.minimum(r * width, last_start)
            k_blk, v_blk = k(k_start, width), v(k_start, width)
            s, _ = logits(wide, q_blk, k_blk, None)  # (g, bq, lanes * bk)
            mask = allowed(wide, ops, q_start, k_start, True)
            assert mask is not None  # positional: always a mask
            if seq_k % width:
                k_pos = k_start + jnp.arange(width, dtype=jnp.int32).reshape(1, 1, width)
                mask = mask & (k_pos >= r * width)
            s = jnp.where(mask, s, -jnp.inf)
            # The cache is not cleaned up front (`_api.flash`): a value row that no query
            # of this block sees may be garbage (NaN), and 0 * NaN is NaN.
            v_blk, reaches_nonfinite = attended_values(v_blk, mask, lanes=lanes)
            s = jnp.moveaxis(s.reshape(groups, cfg.block_q, lanes, bk), 2, 0)
            p, alpha, row_max, row_sum = softmax.rescale(state, s)
            drop = dropout_multiplier(wide, head, q_start, k_start, stat)
            if drop is not None:
                p = p * jnp.moveaxis(drop.reshape(groups, cfg.block_q, lanes, bk), 2, 0)
            v_lanes = v_blk.reshape(lanes, bk, v_blk.shape[-1])
            pv = jnp.einsum("lgqk,lkd->lgqd", p.astype(v_blk.dtype), v_lanes,
                            preferred_element_type=stat)
            acc = softmax.poison(alpha[..., None] * state.acc + pv, reaches_nonfinite)
            return softmax.Running(acc, row_max, row_sum)

        state = jax.lax.fori_loop(lo[i] // lanes, ceil_div(hi[i], lanes), one_round, state)
        out, lse = softmax.finish(*state)  # per lane: (lanes, g, bq, dv), (lanes, g, bq)
        max_score = jnp.max(softmax.max_score(state.row_max, state.row_sum), axis=0)
        return None, (*softmax.merge_all(out, lse, axis=0), max_score)

    num_q = q.shape[1] // cfg.block_q
    _, (out, lse, max_score) = jax.lax.scan(query_block, None,
                                            jnp.arange(num_q, dtype=jnp.int32))
    return unscan(out).astype(q.dtype), unscan(lse), unscan(max_score)
