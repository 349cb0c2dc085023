"""Blockwise backward kernel: recomputes each scheduled block from q, k, v and lse.

A pure function of its inputs: the derivative rule prepares what it needs
(`_semantics.softmax.backward_statistics`: the softmax-backward `delta` and an lse
without -inf), as in Pallas' attention kernels.

Per kv head (`heads.per_head`), key blocks are the outer loop: a key block's dk and dv
stay in the carry of an inner loop over its band of query blocks and are emitted once;
dq accumulates in place. Gradients accumulate in the statistics dtype; nothing of size
seq_q x seq_k is stored.

The logits are formed transposed, `(block_k, groups * block_q)`, with q, dO and dq held
transposed too: then all five block products are plain row-major matmuls. In the
untransposed form dk and dv contract over the rows of both operands (`p^T dO`), which
XLA's CPU GEMM runs at about half speed.

Reading order: `backward` -> `_backward_head` (one kv head) -> `_backward_key_block`
(one key block's loop over query blocks) -> `_backward_tile` (one block pair).
"""

import functools
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from ..._core.config import KernelConfig, stat_dtype
from ..._core.operands import (
    Operands,
    add_block,
    differentiable_part,
    map_fields,
    reduce_to,
    replace,
    zeros_for,
)
from ..._mods.tracing import apply_score_mod
from ..._semantics.score_terms import cotangents
from ..schedule import Bands, Limits, band_ranges, run_limits
from .heads import Head, per_head
from .loops import over_band
from .tile import (
    dropout_multiplier,
    folds_scale,
    logits_t,
    matmul_t,
    scaled,
    score_terms,
    tile_mod_indices,
    tile_operands,
    tile_positions,
    transposed,
    visit,
)


class _QueryBlocks(NamedTuple):
    """One kv head's query-side inputs cut into row blocks, `(num_q, g * bq, c)`, and
    their transposes `(num_q, c, g * bq)` (`_cut`)."""

    q_rows: Array  # scaled queries
    q_cols: Array
    do_rows: Array
    do_cols: Array
    lse_cols: Array  # (num_q, 1, g * bq)
    delta_cols: Array


class _BackwardHead(NamedTuple):
    """What every block step of one kv head reads."""

    cfg: KernelConfig
    head: Head
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
    ops: Operands,
    lse: Array,
    delta: Array,
    d_out: Array,
    wanted: Operands,
) -> tuple[Array, Array, Array, Operands]:
    """Cotangents of q, k, v and of the differentiable operands, given `lse` and `delta`
    from `_semantics.softmax.backward_statistics` and the cotangent `d_out` of `out`.

    `wanted` is `differentiable_part(ops)` with a bool per leaf: whether its cotangent
    is needed. Only those are accumulated (a constant bias costs no reduction per block,
    a frozen score_mod table no scatter-add); the returned operands hold their
    cotangents, in their own shapes and dtypes, and None elsewhere."""
    # The score_mod's arrays whose cotangent is not wanted become its constants.
    if ops.score_mod_arrays is not None:
        free, frozen = eqx.partition(ops.score_mod_arrays, wanted.score_mod_arrays)
        ops = replace(ops, score_mod_arrays=free,
                      score_mod_consts=eqx.combine(frozen, ops.score_mod_consts))
    kernel = functools.partial(_backward_head, cfg, band_ranges(cfg, by="k"), wanted)
    d_q, d_k, d_v, d_ops = per_head(kernel, ops, (q, k, v, d_out, lse, delta),
                                    parallel=cfg.parallel_heads)
    # Per-(batch, kv head) cotangents, summed where the operand broadcast over them.
    return d_q, d_k, d_v, map_fields(reduce_to, d_ops, differentiable_part(ops))


def _cut(x: Array, block: int) -> tuple[Array, Array]:
    """`(g, seq_q, c)` -> row blocks `(num_q, g * block, c)` and their transposes."""
    groups, seq, c = x.shape
    x = x.reshape(groups, seq // block, block, c)
    blocks = x.transpose(1, 0, 2, 3).reshape(seq // block, groups * block, c)
    return blocks, blocks.transpose(0, 2, 1)


def _backward_head(
    cfg: KernelConfig, bands: Bands, wanted: Operands, head: Head, arrays: tuple[Array, ...],
) -> tuple[Array, Array, Array, Operands]:
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
    inputs = _BackwardHead(cfg, head, query, groups, q.dtype, v.dtype)
    keys = (k.reshape(num_k, bk, dim), v.reshape(num_k, bk, dim_v))
    limits = run_limits(cfg, head.operands, by="k")

    def key_block(carry, j):
        return _backward_key_block(inputs, bands, limits, keys, carry, j)

    d_ops = zeros_for(differentiable_part(head.operands), wanted, stat)
    (dq_cols, d_ops), (d_k, d_v) = jax.lax.scan(
        key_block, (jnp.zeros_like(query.q_cols, stat), d_ops),
        jnp.arange(num_k, dtype=jnp.int32),
    )
    # (num_q, d, g * bq) -> (g, seq_q, d)
    d_q = dq_cols.reshape(num_q, dim, groups, bq).transpose(2, 0, 3, 1)
    d_q = d_q.reshape(groups, seq_q_pad, dim) * jnp.asarray(cfg.scale, stat)
    d_k, d_v = d_k.reshape(seq_k_pad, dim), d_v.reshape(seq_k_pad, dim_v)
    return d_q.astype(q.dtype), d_k, d_v, d_ops


_Carry = tuple[Array, Array, Array, Operands]  # dq (transposed), dk, dv, d_ops


def _backward_key_block(
    inputs: _BackwardHead, bands: Bands, limits: Limits | None,
    keys: tuple[Array, Array], carry: tuple[Array, Operands], j: Array,
) -> tuple[tuple[Array, Operands], tuple[Array, Array]]:
    """Key block `j`'s dk and dv, adding its share of dq (and of the operands'
    cotangents) into the carry."""
    cfg = inputs.cfg
    dq_cols, d_ops = carry
    stat = dq_cols.dtype
    k_blk, v_blk = keys[0][j], keys[1][j]
    block = _KeyBlock(j, j * cfg.block_k, k_blk, k_blk.T, v_blk)

    def step(carry: _Carry, i: Array, positional: bool) -> _Carry:
        tile = functools.partial(_backward_tile, inputs, block, i * cfg.block_q, i)
        return visit(cfg, inputs.head, i, block.number, positional, tile, carry,
                     orient=lambda m: transposed(m, inputs.groups, cfg.block_q))

    # `*_like`: under shard_map the state must vary across devices as k and v do.
    init = (dq_cols, jnp.zeros_like(k_blk, stat), jnp.zeros_like(v_blk, stat), d_ops)
    dq_cols, dk_b, dv_b, d_ops = over_band(bands, j, step, init, limits)
    if not folds_scale(inputs.dtype):
        dk_b = dk_b * jnp.asarray(cfg.scale, stat)  # q was left unscaled
    return (dq_cols, d_ops), (dk_b.astype(inputs.dtype), dv_b.astype(inputs.v_dtype))


def _score_mod_t(inputs: _BackwardHead, q_start: Array, k_start: Array, vjps: list):
    """The block's `score_mod` on transposed logits `(bk, g * bq)`; its VJP (to the
    logits and the score_mod's free arrays) is left in `vjps`. None without a
    score_mod."""
    cfg, groups, ops = inputs.cfg, inputs.groups, inputs.head.operands
    if cfg.mods is None or cfg.mods.score is None:
        return None
    mods = cfg.mods
    idx = tile_mod_indices(cfg, inputs.head, q_start, k_start)

    def mod_t(s_t: Array) -> Array:
        def on_rows(s_t, free):  # the score_mod sees the forward's layout, (g, bq, bk)
            s = s_t.reshape(cfg.block_k, groups, cfg.block_q).transpose(1, 2, 0)
            out = apply_score_mod(mods, replace(ops, score_mod_arrays=free), s, idx)
            return out.transpose(2, 0, 1).reshape(cfg.block_k, groups * cfg.block_q)

        out, vjp = jax.vjp(on_rows, s_t, ops.score_mod_arrays)
        vjps.append(vjp)
        return out

    return mod_t


def _backward_tile(
    inputs: _BackwardHead, block: _KeyBlock, q_start: Array, i: Array, mask: Array | None,
    carry: _Carry,
) -> _Carry:
    """Add query block `i`'s contribution to the gradients of one key block."""
    cfg, query, head = inputs.cfg, inputs.query, inputs.head
    dq_cols, dk_b, dv_b, d_ops = carry
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
    drop = dropout_multiplier(cfg, head, q_start, block.start, stat)
    drop = transposed(drop, inputs.groups, cfg.block_q)
    p_v = p
    if drop is not None:
        p_v, dp = p * drop, dp * drop
    dv_b = dv_b + jnp.matmul(p_v.astype(inputs.v_dtype), query.do_rows[i],
                             preferred_element_type=stat)
    ds = p * (dp - query.delta_cols[i])
    if mask is not None:
        # A masked pair's weight is 0, but a non-finite value row makes its dp NaN (or
        # inf) for every query, and 0 * NaN would carry it to queries that never attend
        # that key: their ds is exactly 0.
        ds = jnp.where(mask, ds, 0.0)
    if t is not None:
        ds = ds * (1.0 - t * t)
    if vjps:  # through the score_mod: ds becomes the cotangent of its input
        ds, d_part = vjps[0](ds)
        d_ops = replace(d_ops, score_mod_arrays=jax.tree.map(
            lambda a, g: a + g.astype(a.dtype), d_ops.score_mod_arrays, d_part))
    if head.operands.has_score_terms:  # ds is the cotangent of the score terms too
        d_scores_t = ds.reshape(cfg.block_k, inputs.groups, cfg.block_q)  # no copy
        q_pos, k_pos = tile_positions(cfg, q_start, block.start)
        blk = tile_operands(cfg, head.operands, q_start, block.start)
        parts = cotangents(blk, d_ops, d_scores_t, q_pos, k_pos, cfg.score_offset)
        d_ops = add_block(d_ops, parts, q_start, block.start)
    ds = ds.astype(inputs.dtype)
    # dk against the scaled queries is exact; dq is scaled once at the end.
    dk_b = dk_b + jnp.matmul(ds, query.q_rows[i], preferred_element_type=stat)
    dq_blk = dq_cols[i] + jnp.matmul(block.k_t, ds, preferred_element_type=stat)
    dq_cols = jax.lax.dynamic_update_index_in_dim(dq_cols, dq_blk, i, axis=0)
    return dq_cols, dk_b, dv_b, d_ops
