"""Blockwise tangent kernel (forward-mode AD): the tangents of `out` and `lse` for
tangents of q, k, v and of the differentiable operands, given the forward's `out` and
`lse`.

It walks the forward's block plan (`schedule.band_ranges`, `loops.over_band`), so
nothing of size seq_q x seq_k is stored. Per query row, with `P = exp(S - lse)` the
softmax over the attended keys, `S` the logits as the forward forms them and `M` the
dropout multiplier (`keep / (1 - rate)`, or 1):

    dS     = scale (dQ K^T + Q dK^T) + d(score terms)
             [then through the score_mod's jvp, and times 1 - tanh^2 with a softcap]
    d_lse  = rowsum(P * dS)                             (dropout does not touch lse)
    d_out  = (P * M) dV + (P * M * dS) V - d_lse * out

(`dP = P * (dS - d_lse)` and `out` carries `M`, hence the last term.) The score terms
are linear (`_semantics.score_terms`), so their tangent is the same terms of the
operands' tangents; a score_mod's is `jax.jvp` of it on the block, along `dS` and the
tangents of its arrays. Per block: `S`, `dS` (one product `[q, dq] [dk, k]^T` of twice
the depth), `(P*M) dV` and `(P*M*dS) V`; tangents that are zero are not materialised and
their products are skipped (`_tangent_inputs`). A row with no key gets zero tangents.
Two entry points:

- `tangent`, given the forward's `out` and `lse`: the linear map that reverse mode
  transposes (`_autodiff.linear`), so it recomputes the logits the forward formed.
- `forward_and_tangent`, one pass that computes `out`, `lse` and their tangents together
  (`jax.jvp` where nothing is transposed): the online softmax carries `[P V, P dV]` (one
  product of the weights with `[v, dv]`), `(P dS) V` and `rowsum(P dS)`, all rescaled by
  the running max, so the logits are formed once. Per block: `S`, `dS`, `P [V, dV]` and
  `(P dS) V`, the 3.0-forwards product floor of a jvp against 3.5 for the forward and
  `tangent` in turn (`benchmarks/jvp_results.md`).
"""

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array

from ..._core.config import KernelConfig, stat_dtype
from ..._core.operands import Operands, combine, constant_part, replace
from ..._mods.tracing import apply_score_mod
from ..._semantics import softmax
from ..._semantics.softmax import finite_lse
from ..schedule import Bands, Limits, band_ranges, run_limits
from .heads import Head, per_head
from .loops import over_band
from .tile import (
    attended_values,
    dropout_multiplier,
    folds_scale,
    logits,
    matmul,
    nonfinite_keys,
    rows,
    scaled,
    score_terms,
    tile_mod_indices,
    unscan,
    visit,
)


class _TangentHead(NamedTuple):
    """What every block step of one kv head reads. Tangents that are zero are absent."""

    cfg: KernelConfig
    head: Head  # the operands' tangents in `head.tangents`
    q: Array  # (g, seq_q, d), `scaled`
    qq: Array | None  # against `kk`: qq kk^T = q dk^T + dq k^T (None: dq = dk = 0)
    k: Array  # (seq_k, d)
    kk: Array | None
    vv: Array  # [v, dv] (seq_k, dim_v [+ dim_v]); v alone when dv = 0
    dim_v: int


def tangent(
    cfg: KernelConfig, q: Array, k: Array, v: Array, ops: Operands, out: Array, lse: Array,
    dq: Array | None, dk: Array | None, dv: Array | None, d_ops: Operands,
) -> tuple[Array, Array]:
    """`(d_out, d_lse)`, padded and in the internal layout like `forward`'s outputs.
    `dq`, `dk`, `dv` are None where zero; `d_ops` holds the tangents of the
    differentiable operands (None where zero; a score_mod's arrays are differentiated
    together, with zeros filled in, or not at all)."""
    has = tuple(t is not None for t in (dq, dk, dv))
    kernel = functools.partial(_tangent_head, cfg, band_ranges(cfg, by="q"), has)
    tangents = tuple(t for t in (dq, dk, dv) if t is not None)
    return per_head(kernel, ops, (q, k, v, out, lse, *tangents), tangents=d_ops,
                    parallel=cfg.parallel_heads)


def _tangent_inputs(cfg: KernelConfig, head: Head, q, k, v, dq, dk, dv) -> _TangentHead:
    """`_TangentHead` of one kv head; `dq`, `dk`, `dv` are None where zero, which saves
    the products they would enter (`dq` alone: `dq k^T` at depth d rather than 2d)."""
    q = scaled(cfg, q)
    qq = kk = None
    if dq is not None and dk is not None:
        qq = jnp.concatenate([q, scaled(cfg, dq)], axis=-1)
        kk = jnp.concatenate([dk, k], axis=-1)  # so that [q, dq] [dk, k]^T = q dk^T + dq k^T
    elif dq is not None:
        qq, kk = scaled(cfg, dq), k
    elif dk is not None:
        qq, kk = q, dk
    vv = v if dv is None else jnp.concatenate([v, dv], axis=-1)
    return _TangentHead(cfg, head, q, qq, k, kk, vv, v.shape[-1])


def _tangent_head(cfg: KernelConfig, bands: Bands, has: tuple[bool, ...], head: Head,
                  arrays: tuple[Array, ...]) -> tuple[Array, Array]:
    q, k, v, out, lse, *tangents = arrays
    it = iter(tangents)
    dq, dk, dv = (next(it) if h else None for h in has)
    inputs = _tangent_inputs(cfg, head, q, k, v, dq, dk, dv)
    bad = nonfinite_keys(inputs.vv)  # value rows (or their tangents) holding NaN or inf
    limits = run_limits(cfg, head.operands, by="q")
    groups, num_q = q.shape[0], q.shape[1] // cfg.block_q
    # (g, seq_q, ...) -> (num_q, g, bq, ...): one slice per query block.
    out_blocks = jnp.moveaxis(out.reshape(groups, num_q, cfg.block_q, -1), 1, 0)
    lse_blocks = jnp.moveaxis(lse.reshape(groups, num_q, cfg.block_q), 1, 0)
    block = functools.partial(_tangent_query_block, inputs, bad, bands, limits)
    xs = (jnp.arange(num_q, dtype=jnp.int32), out_blocks, lse_blocks)
    _, (d_out, d_lse) = jax.lax.scan(block, None, xs)
    return unscan(d_out), unscan(d_lse)


def _tangent_query_block(inputs: _TangentHead, bad: Array, bands: Bands,
                         limits: Limits | None, _, xs):
    """`(d_out, d_lse)` of one query block, given its `out` and `lse`."""
    i, out_blk, lse_blk = xs  # (g, bq, dv), (g, bq)
    cfg = inputs.cfg
    bq = cfg.block_q
    q_blk = rows(inputs.q, i * bq, bq, 1)
    qq_blk = None if inputs.qq is None else rows(inputs.qq, i * bq, bq, 1)
    stat = stat_dtype(q_blk.dtype)
    attended = lse_blk > -jnp.inf
    # Rows with no key: any finite lse gives p = 0 (all their logits are -inf).
    init = (jnp.zeros_like(out_blk, stat), jnp.zeros_like(lse_blk, stat),
            finite_lse(lse_blk).astype(stat))

    def step(carry, j: Array, positional: bool):
        k_start = j * cfg.block_k
        blocks = _blocks(inputs, q_blk, qq_blk, k_start)
        tile = functools.partial(_tangent_tile, inputs, bad, blocks, i * bq, k_start)
        return visit(cfg, inputs.head, i, j, positional, tile, carry)

    acc_t, d_lse, _ = over_band(bands, i, step, init, limits)
    d_out = acc_t - d_lse[..., None] * out_blk.astype(stat)
    d_out = jnp.where(attended[..., None], d_out, 0.0)
    d_lse = jnp.where(attended, d_lse, 0.0)
    return None, (d_out.astype(inputs.q.dtype), d_lse)


def _blocks(inputs: _TangentHead, q_blk: Array, qq_blk: Array | None, k_start: Array
            ) -> tuple[Any, ...]:
    """`(q, qq, k, kk, vv)` blocks of one block pair (`qq`, `kk` None where absent)."""
    bk = inputs.cfg.block_k
    kk = None if inputs.kk is None else rows(inputs.kk, k_start, bk, 0)
    return q_blk, qq_blk, rows(inputs.k, k_start, bk, 0), kk, rows(inputs.vv, k_start, bk, 0)


def _score_mod_jvp(inputs: _TangentHead, q_start, k_start, ds: Array | None, found: list):
    """The block's `score_mod` as `tile.logits` applies it, leaving the tangent of its
    output (from the logits' tangent `ds` and the tangents of its arrays) in `found`.
    None without a score_mod."""
    cfg, head = inputs.cfg, inputs.head
    if cfg.mods is None or cfg.mods.score is None:
        return None
    mods, ops = cfg.mods, head.operands
    d_arrays = None if head.tangents is None else head.tangents.score_mod_arrays
    idx = tile_mod_indices(cfg, head, q_start, k_start)

    def apply(s, arrays):
        return apply_score_mod(mods, replace(ops, score_mod_arrays=arrays), s, idx)

    def mod(s: Array) -> Array:
        if ds is None and d_arrays is None:
            return apply(s, ops.score_mod_arrays)
        d_s = jnp.zeros_like(s) if ds is None else jnp.broadcast_to(ds, s.shape)
        if d_arrays is None:
            out, d_out = jax.jvp(lambda s: apply(s, ops.score_mod_arrays), (s,), (d_s,))
        else:
            out, d_out = jax.jvp(apply, (s, ops.score_mod_arrays), (d_s, d_arrays))
        found.append(d_out)
        return out

    return mod


def _logits_and_tangent(inputs: _TangentHead, blocks, q_start, k_start):
    """The block's logits `s` exactly as the forward computes them (score terms,
    score_mod, softcap) and their tangent `ds` (None: zero)."""
    q_blk, qq_blk, k_blk, kk_blk, _ = blocks
    cfg, head = inputs.cfg, inputs.head
    stat = stat_dtype(q_blk.dtype)
    ds = None
    if qq_blk is not None:
        ds = matmul(qq_blk, kk_blk, "qd,kd->qk", stat)  # q dk^T + dq k^T
        if not folds_scale(qq_blk.dtype):
            ds = ds * jnp.asarray(cfg.scale, stat)
    if head.tangents is not None:
        # The score terms are linear: their tangent is the same terms of the tangents.
        d_terms = combine(head.tangents, constant_part(head.operands))
        d_add = score_terms(cfg, head, q_start, k_start, stat, ops=d_terms)
        if d_add is not None:
            ds = d_add if ds is None else ds + d_add
    add = score_terms(cfg, head, q_start, k_start, stat)
    found: list = []
    mod = _score_mod_jvp(inputs, q_start, k_start, ds, found)
    s, t = logits(cfg, q_blk, k_blk, add, mod)
    if found:
        ds = found[0]
    if t is not None and ds is not None:
        ds = ds * (1.0 - t * t)
    return s, ds


def _tangent_tile(inputs: _TangentHead, bad: Array, blocks, q_start, k_start, mask,
                  carry: Any):
    """One (query block, key block) update of `(acc_t, acc_ds, lse)`: the weights come
    out normalised by the row's known lse, so nothing is rescaled."""
    vv_blk, dim_v = blocks[4], inputs.dim_v
    acc_t, acc_ds, lse = carry
    stat = acc_t.dtype
    s, ds = _logits_and_tangent(inputs, blocks, q_start, k_start)
    reaches = None
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
        # No 0 * NaN from value rows the masked pairs do not attend (as in the forward).
        vv_blk, reaches = attended_values(
            vv_blk, mask, rows(bad, k_start, inputs.cfg.block_k, 0))
    p = jnp.exp(s - lse[..., None])
    drop = dropout_multiplier(inputs.cfg, inputs.head, q_start, k_start, stat)
    dtype = vv_blk.dtype
    if vv_blk.shape[-1] > dim_v:  # (P*M) dV
        p_v = p if drop is None else p * drop
        acc_t = acc_t + matmul(p_v.astype(dtype), vv_blk[:, dim_v:], "qk,kd->qd", stat)
    if ds is not None:  # (P*M*dS) V and rowsum(P*dS)
        p_ds = p * ds
        if inputs.cfg.mods is not None and inputs.cfg.mods.score is not None:
            # Where p = 0 a score_mod's derivative may leave ds non-finite (at logits it
            # sent to -inf); elsewhere it is finite.
            p_ds = jnp.where(p > 0, p_ds, 0.0)
        p_ds_v = p_ds if drop is None else p_ds * drop
        acc_t = acc_t + matmul(p_ds_v.astype(dtype), vv_blk[:, :dim_v], "qk,kd->qd", stat)
        acc_ds = acc_ds + p_ds.sum(axis=-1)
    return softmax.poison(acc_t, reaches), acc_ds, lse


def forward_and_tangent(
    cfg: KernelConfig, q: Array, k: Array, v: Array, ops: Operands,
    dq: Array | None, dk: Array | None, dv: Array | None, d_ops: Operands,
) -> tuple[Array, Array, Array, Array, Array]:
    """`forward`'s `(out, lse, max_score)` and `tangent`'s `(d_out, d_lse)` in one pass
    over the blocks (arguments as `tangent`'s, without `out` and `lse`)."""
    has = tuple(t is not None for t in (dq, dk, dv))
    kernel = functools.partial(_one_pass_head, cfg, band_ranges(cfg, by="q"), has)
    tangents = tuple(t for t in (dq, dk, dv) if t is not None)
    return per_head(kernel, ops, (q, k, v, *tangents), tangents=d_ops,
                    parallel=cfg.parallel_heads)


class _OnePass(NamedTuple):
    """A query block's running state: the forward's, with `acc` `(g, bq, dim_v [+
    dim_v])` holding `sum_j p_j M_j [v_j, dv_j]`, and the tangent's sums against the same
    running max."""

    running: softmax.Running
    acc_t: Array  # (g, bq, dim_v): sum_j p_j dS_j M_j v_j
    acc_ds: Array  # (g, bq): sum_j p_j dS_j


def _one_pass_head(cfg: KernelConfig, bands: Bands, has: tuple[bool, ...], head: Head,
                   arrays: tuple[Array, ...]) -> tuple[Array, ...]:
    q, k, v, *tangents = arrays
    it = iter(tangents)
    dq, dk, dv = (next(it) if h else None for h in has)
    inputs = _tangent_inputs(cfg, head, q, k, v, dq, dk, dv)
    # Value rows holding a NaN or inf: of v (they poison `out`) and of [v, dv] (d_out).
    bad = (nonfinite_keys(v), nonfinite_keys(inputs.vv))
    limits = run_limits(cfg, head.operands, by="q")

    def query_block(_, i):
        return None, _one_pass_query_block(inputs, bad, bands, limits, i)

    num_q = q.shape[1] // cfg.block_q
    _, results = jax.lax.scan(query_block, None, jnp.arange(num_q, dtype=jnp.int32))
    return tuple(unscan(x) for x in results)


def _one_pass_query_block(inputs: _TangentHead, bad: tuple[Array, Array], bands: Bands,
                          limits: Limits | None, i: Array) -> tuple[Array, ...]:
    """`(out, lse, max_score, d_out, d_lse)` of query block `i`."""
    cfg, dim_v = inputs.cfg, inputs.dim_v
    bq = cfg.block_q
    q_blk = rows(inputs.q, i * bq, bq, 1)
    qq_blk = None if inputs.qq is None else rows(inputs.qq, i * bq, bq, 1)
    groups, stat = q_blk.shape[0], stat_dtype(q_blk.dtype)
    running = softmax.start(q_blk, (groups, bq, inputs.vv.shape[-1]), stat)
    init = _OnePass(running, jnp.zeros_like(q_blk, stat, shape=(groups, bq, dim_v)),
                    jnp.zeros_like(running.row_sum))

    def step(state: _OnePass, j: Array, positional: bool) -> _OnePass:
        k_start = j * cfg.block_k
        blocks = _blocks(inputs, q_blk, qq_blk, k_start)
        tile = functools.partial(_one_pass_tile, inputs, bad, blocks, i * bq, k_start)
        return visit(cfg, inputs.head, i, j, positional, tile, state)

    state = over_band(bands, i, step, init, limits)
    acc, row_max, row_sum = state.running
    out, lse = softmax.finish(acc[..., :dim_v], row_max, row_sum)
    # As `finish`: a row that attended nothing gets zero tangents, a NaN row stays NaN.
    attended = row_sum != 0
    safe_sum = jnp.where(attended, row_sum, 1.0)
    d_lse = state.acc_ds / safe_sum
    d_out = state.acc_t + acc[..., dim_v:] if acc.shape[-1] > dim_v else state.acc_t
    d_out = d_out / safe_sum[..., None] - d_lse[..., None] * out
    d_out = jnp.where(attended[..., None], d_out, 0.0)
    d_lse = jnp.where(attended, d_lse, 0.0)
    dtype = inputs.q.dtype
    return (out.astype(dtype), lse, softmax.max_score(row_max, row_sum),
            d_out.astype(dtype), d_lse)


def _poisoned(acc: Array, dim_v: int, reach_v: Array | None, reach_any: Array | None
              ) -> Array:
    """`acc` with the `v` columns NaN in the rows that attend a non-finite value, and the
    `dv` columns NaN in those that attend a non-finite value or tangent (as
    `softmax.poison` does to the forward's whole row)."""
    if reach_v is None or reach_any is None:
        return acc
    is_v = jnp.arange(acc.shape[-1]) < dim_v
    reach = jnp.where(is_v, reach_v[..., None], reach_any[..., None])
    return jnp.where(reach, jnp.asarray(jnp.nan, acc.dtype), acc)


def _one_pass_tile(inputs: _TangentHead, bad: tuple[Array, Array], blocks, q_start,
                   k_start, mask, state: _OnePass) -> _OnePass:
    """Take key block `k_start` into the query block's running state: the forward's
    online-softmax step on `[v, dv]`, and the tangent's sums rescaled alike."""
    cfg, dim_v = inputs.cfg, inputs.dim_v
    stat = state.acc_t.dtype
    s, ds = _logits_and_tangent(inputs, blocks, q_start, k_start)
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    p, alpha, row_max, row_sum = softmax.rescale(state.running, s)
    drop = dropout_multiplier(cfg, inputs.head, q_start, k_start, stat)
    vv_blk = blocks[4]
    reach_v = reach_any = None
    if mask is not None:  # masked pairs: no 0 * NaN from the values they do not attend
        bad_v, bad_any = (rows(b, k_start, cfg.block_k, 0) for b in bad)
        vv_blk, reach_any = attended_values(vv_blk, mask, bad_any)
        reach_v = (reach_any if vv_blk.shape[-1] == dim_v
                   else attended_values(vv_blk[:, :dim_v], mask, bad_v)[1])
    dtype = vv_blk.dtype
    p_v = p if drop is None else p * drop
    acc = alpha[..., None] * state.running.acc + matmul(
        p_v.astype(dtype), vv_blk, "qk,kd->qd", stat)
    acc = _poisoned(acc, dim_v, reach_v, reach_any)
    acc_t, acc_ds = alpha[..., None] * state.acc_t, alpha * state.acc_ds
    if ds is not None:  # (P*M*dS) V and rowsum(P*dS)
        p_ds = p * ds
        if cfg.mods is not None and cfg.mods.score is not None:
            p_ds = jnp.where(p > 0, p_ds, 0.0)  # as in `_tangent_tile`
        p_ds_v = p_ds if drop is None else p_ds * drop
        acc_t = acc_t + matmul(p_ds_v.astype(dtype), vv_blk[:, :dim_v], "qk,kd->qd", stat)
        acc_ds = acc_ds + p_ds.sum(axis=-1)
    return _OnePass(softmax.Running(acc, row_max, row_sum), acc_t, acc_ds)
