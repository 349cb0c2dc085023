"""Blockwise backward kernel: recomputes each scheduled block from q, k, v and lse.

A pure function of its inputs: the VJP rule prepares what it needs (`prepare`: the
softmax-backward `delta` and an lse without -inf), as in Pallas' attention kernels.

Per kv head (`_heads.per_head`), key blocks are the outer loop: a key block's dk and dv
stay in the carry of an inner loop over its band of query blocks and are emitted once;
dq accumulates in place. Gradients accumulate in the statistics dtype; nothing of size
seq_q x seq_k is stored.

The logits are formed transposed, `(block_k, groups * block_q)`, with q, dO and dq held
transposed too: then all five block products are plain row-major matmuls. In the
untransposed form dk and dv contract over the rows of both operands (`p^T dO`), which
XLA's CPU GEMM runs at about half speed.

Reading order: `backward` -> `_head` (one kv head) -> `_key_block` (one key block's loop
over query blocks) -> `_query_step` (one block pair).
"""

import functools
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._core.config import KernelConfig, stat_dtype
from .._kernels.heads import Head, per_head
from .._kernels.schedule import Bands, Limits, band_ranges, over_band, run_limits
from .._kernels.tile import (
    dropout_multiplier,
    flex_indices,
    folds_scale,
    logits_t,
    matmul_t,
    positions,
    scaled,
    score_terms,
    transposed,
    visit,
)
from .._mods.tracing import NO_FLEX, FlexArrays, apply_score
from .._semantics.masking import Masks
from .._semantics.score_terms import ScoreMods, accumulate
from .._semantics.softmax import finite_lse


def prepare(out: Array, lse: Array, d_out: Array, d_lse: Array) -> tuple[Array, Array]:
    """`(lse, delta)` for `backward`: lse with -inf made finite (`finite_lse`), and
    `delta = rowsum(dO * O) - d_lse` in the statistics dtype. (d lse / d s is the
    softmax, so an lse cotangent just shifts the softmax-backward delta.)"""
    stat = stat_dtype(out.dtype)
    delta = jnp.sum(d_out.astype(stat) * out.astype(stat), axis=-1) - d_lse.astype(stat)
    return finite_lse(lse), delta


class _QueryBlocks(NamedTuple):
    """One kv head's query-side inputs cut into row blocks, `(num_q, g * bq, c)`, and
    their transposes `(num_q, c, g * bq)` (`_cut`)."""

    q_rows: Array  # scaled queries
    q_cols: Array
    do_rows: Array
    do_cols: Array
    lse_cols: Array  # (num_q, 1, g * bq)
    delta_cols: Array


class _HeadInputs(NamedTuple):
    """What every block step of one kv head reads."""

    cfg: KernelConfig
    head: Head
    seed: Array | None
    has_data_mask: bool
    flex: FlexArrays
    query: _QueryBlocks
    groups: int
    dtype: jnp.dtype  # of q and k (the products' operands)
    v_dtype: jnp.dtype


class _KeyBlock(NamedTuple):
    number: Array  # j
    start: Array
    k: Array  # (bk, d)
    k_t: Array  # (d, bk)
    v: Array  # (bk, dv)


def backward(
    cfg: KernelConfig,
    q: Array,
    k: Array,
    v: Array,
    mods: ScoreMods,
    lse: Array,
    delta: Array,
    d_out: Array,
    masks: Masks,
    seed: Array | None,
    flex: FlexArrays = NO_FLEX,
    mods_wanted: tuple[bool, bool] = (True, True),
    score_wanted: bool = True,
) -> tuple[Array, Array, Array, ScoreMods, Any]:
    """Cotangents of q, k, v, the score terms `mods` (internal layout) and the
    `score_mod`'s floating arrays `flex.score`, given `lse` and `delta` from `prepare` and
    the cotangent `d_out` of `out`. A score term whose entry of `mods_wanted` (bias,
    slopes) is False gets zeros, without accumulating anything per block; so do the
    score_mod's arrays without `score_wanted` (a frozen table costs no scatter-add)."""
    bands = band_ranges(cfg.seq_q, cfg.seq_k, cfg.block_q, cfg.block_k, cfg.band_window,
                        cfg.offset, by="k")
    kernel_flex = flex
    if not score_wanted:  # the arrays become constants of the score_mod's VJP
        kernel_flex = flex._replace(
            score=jax.tree.map(lambda _: None, flex.score),
            score_const=eqx.combine(flex.score, flex.score_const),
        )
    kernel = functools.partial(_head, cfg, bands, seed, not masks.is_empty, kernel_flex,
                               mods_wanted)
    d_q, d_k, d_v, d_mods, d_score = per_head(kernel, (masks, mods),
                                              (q, k, v, d_out, lse, delta))

    def reduce(grad: Array, like: Array) -> Array:
        """Per-(batch, kv head) cotangents summed where the term broadcast over them."""
        axes = tuple(a for a in (0, 1) if like.shape[a] == 1)
        return grad.sum(axis=axes, keepdims=True).astype(like.dtype)

    # The score_mod's arrays are shared by every (batch, kv head): sum their cotangents.
    if score_wanted:
        d_score = jax.tree.map(lambda g, p: g.sum(axis=(0, 1)).astype(p.dtype), d_score,
                               flex.score)
    else:
        d_score = jax.tree.map(jnp.zeros_like, flex.score)
    # Only the bias and the slopes are differentiable (positions are not).
    d_mods = ScoreMods(*(None if m is None else jnp.zeros_like(m) if g is None else reduce(g, m)
                         for g, m in ((d_mods.bias, mods.bias), (d_mods.slopes, mods.slopes))))
    return d_q, d_k, d_v, d_mods, d_score


def _cut(x: Array, block: int) -> tuple[Array, Array]:
    """`(g, seq_q, c)` -> row blocks `(num_q, g * block, c)` and their transposes."""
    groups, seq, c = x.shape
    x = x.reshape(groups, seq // block, block, c)
    blocks = x.transpose(1, 0, 2, 3).reshape(seq // block, groups * block, c)
    return blocks, blocks.transpose(0, 2, 1)


def _head(
    cfg: KernelConfig, bands: Bands, seed: Array | None, has_data_mask: bool,
    flex: FlexArrays, mods_wanted: tuple[bool, bool], head: Head, arrays: tuple[Array, ...],
) -> tuple[Array, Array, Array, ScoreMods, Any]:
    q, k, v, d_out, lse, delta = arrays
    stat = stat_dtype(q.dtype)
    groups, seq_q_pad, dim = q.shape
    seq_k_pad, dim_v = v.shape
    bq, bk = cfg.block_q, cfg.block_k
    num_q, num_k = seq_q_pad // bq, seq_k_pad // bk
    query = _QueryBlocks(
        *_cut(scaled(cfg, q), bq), *_cut(d_out, bq),
        _cut(lse[..., None], bq)[1], _cut(delta[..., None], bq)[1],
    )
    inputs = _HeadInputs(cfg, head, seed, has_data_mask, flex, query, groups, q.dtype,
                         v.dtype)
    keys = (k.reshape(num_k, bk, dim), v.reshape(num_k, bk, dim_v))
    limits = run_limits(cfg, head.masks, by="k")

    def key_block(carry, j):
        return _key_block(inputs, bands, limits, keys, carry, j)

    terms = (head.mods.bias, head.mods.slopes)
    d_mods = ScoreMods(*(jnp.zeros_like(m, stat) if m is not None and wanted else None
                         for m, wanted in zip(terms, mods_wanted, strict=True)))
    # The score_mod's arrays' cotangents accumulate in the statistics dtype.
    d_score = jax.tree.map(lambda p: jnp.zeros_like(p, stat), flex.score)
    (dq_cols, d_mods, d_score), (d_k, d_v) = jax.lax.scan(
        key_block, (jnp.zeros_like(query.q_cols, stat), d_mods, d_score),
        jnp.arange(num_k, dtype=jnp.int32),
    )
    # (num_q, d, g * bq) -> (g, seq_q, d)
    d_q = dq_cols.reshape(num_q, dim, groups, bq).transpose(2, 0, 3, 1)
    d_q = d_q.reshape(groups, seq_q_pad, dim) * jnp.asarray(cfg.scale, stat)
    d_k, d_v = d_k.reshape(seq_k_pad, dim), d_v.reshape(seq_k_pad, dim_v)
    return d_q.astype(q.dtype), d_k, d_v, d_mods, d_score


_Carry = tuple[Array, Array, Array, ScoreMods, Any]  # dq (transposed), dk, dv, d_mods, d_score


def _key_block(
    inputs: _HeadInputs, bands: Bands, limits: Limits | None,
    keys: tuple[Array, Array], carry: tuple[Array, ScoreMods, Any], j: Array,
) -> tuple[tuple[Array, ScoreMods, Any], tuple[Array, Array]]:
    """Key block `j`'s dk and dv, adding its share of dq (and of the score terms' and
    the score_mod's cotangents) into the carry."""
    cfg = inputs.cfg
    dq_cols, d_mods, d_score = carry
    stat = dq_cols.dtype
    k_blk, v_blk = keys[0][j], keys[1][j]
    block = _KeyBlock(j, j * cfg.block_k, k_blk, k_blk.T, v_blk)
    step = functools.partial(_query_step, inputs, block)
    # `*_like`: under shard_map the state must vary across devices as k and v do.
    init = (dq_cols, jnp.zeros_like(k_blk, stat), jnp.zeros_like(v_blk, stat), d_mods,
            d_score)
    dq_cols, dk_b, dv_b, d_mods, d_score = over_band(bands, j, step, init, limits)
    if not folds_scale(inputs.dtype):
        dk_b = dk_b * jnp.asarray(cfg.scale, stat)  # q was left unscaled
    return (dq_cols, d_mods, d_score), (dk_b.astype(inputs.dtype),
                                        dv_b.astype(inputs.v_dtype))


def _query_step(
    inputs: _HeadInputs, block: _KeyBlock, carry: _Carry, i: Array, positional: bool,
) -> _Carry:
    """Add query block `i`'s contribution to the gradients of one key block."""
    cfg = inputs.cfg
    update = functools.partial(_update, inputs, block, i * cfg.block_q, i)
    return visit(cfg, inputs.head, inputs.flex, i, block.number, positional,
                 inputs.has_data_mask, update, carry,
                 orient=lambda m: transposed(m, inputs.groups, cfg.block_q))


def _score_mod_t(inputs: _HeadInputs, q_start: Array, k_start: Array, vjps: list):
    """The block's `score_mod` on transposed logits `(bk, g * bq)`; its VJP (to the
    logits and the score_mod's arrays) is left in `vjps`. None without a score_mod."""
    cfg, groups = inputs.cfg, inputs.groups
    if cfg.flex is None or cfg.flex.score is None:
        return None
    flex_cfg = cfg.flex
    idx = flex_indices(cfg, inputs.head, q_start, k_start)

    def mod_t(s_t: Array) -> Array:
        def on_rows(s_t, diff):  # the score_mod sees the forward's layout, (g, bq, bk)
            s = s_t.reshape(cfg.block_k, groups, cfg.block_q).transpose(1, 2, 0)
            out = apply_score(flex_cfg, inputs.flex._replace(score=diff), s, idx)
            return out.transpose(2, 0, 1).reshape(cfg.block_k, groups * cfg.block_q)

        out, vjp = jax.vjp(on_rows, s_t, inputs.flex.score)
        vjps.append(vjp)
        return out

    return mod_t


def _update(
    inputs: _HeadInputs, block: _KeyBlock, q_start: Array, i: Array, mask: Array | None,
    carry: _Carry,
) -> _Carry:
    cfg, query, head = inputs.cfg, inputs.query, inputs.head
    dq_cols, dk_b, dv_b, d_mods, d_score = carry
    stat = dk_b.dtype
    add = score_terms(cfg, head, q_start, block.start, stat)
    add_t = transposed(add, inputs.groups, cfg.block_q)
    vjps: list = []
    mod_t = _score_mod_t(inputs, q_start, block.start, vjps)
    s, t = logits_t(cfg, block.k, query.q_rows[i], query.q_cols[i], add_t, mod_t)
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    p = jnp.exp(s - query.lse_cols[i])
    dp = matmul_t(block.v, query.do_rows[i], query.do_cols[i], stat)
    drop = dropout_multiplier(cfg, inputs.seed, inputs.head, q_start, block.start, stat)
    drop = transposed(drop, inputs.groups, cfg.block_q)
    p_v = p
    if drop is not None:
        p_v, dp = p * drop, dp * drop
    dv_b = dv_b + jnp.matmul(p_v.astype(inputs.v_dtype), query.do_rows[i],
                             preferred_element_type=stat)
    ds = p * (dp - query.delta_cols[i])
    if t is not None:
        ds = ds * (1.0 - t * t)
    if vjps:  # through the score_mod: ds becomes the cotangent of its input
        ds, d_part = vjps[0](ds)
        d_score = jax.tree.map(lambda a, g: a + g.astype(a.dtype), d_score, d_part)
    if not head.mods.is_empty:  # ds is the cotangent of the score terms too
        d_scores_t = ds.reshape(cfg.block_k, inputs.groups, cfg.block_q)  # no copy
        q_pos, k_pos = positions(cfg, q_start, block.start)
        d_mods = accumulate(d_mods, head.mods, d_scores_t, q_start, block.start, q_pos, k_pos,
                            cfg.score_offset)
    ds = ds.astype(inputs.dtype)
    # dk against the scaled queries is exact; dq is scaled once at the end.
    dk_b = dk_b + jnp.matmul(ds, query.q_rows[i], preferred_element_type=stat)
    dq_blk = dq_cols[i] + jnp.matmul(block.k_t, ds, preferred_element_type=stat)
    dq_cols = jax.lax.dynamic_update_index_in_dim(dq_cols, dq_blk, i, axis=0)
    return dq_cols, dk_b, dv_b, d_mods, d_score
