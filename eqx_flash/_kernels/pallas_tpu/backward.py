"""The Pallas TPU backward: one fused kernel, or a dq kernel and a dk/dv kernel.

Given the forward's lse and `delta = rowsum(dO * O) - d_lse` (`backward_statistics`, the
family contract), each block pair's weights are `p = exp(s - lse)` and the logits'
cotangent `ds = p * (dO v^T - delta)`. Key blocks are the outer loop and their query
blocks the steps (the transposed plan); the logits are formed transposed, `(bk, bq)` per
query head, so that `dv += p^T dO` and `dk += ds^T q` are plain products, dk and dv
accumulating in VMEM. The fused kernel also adds `ds k` into a dq for the whole head
held in VMEM, written once when the head is done: five products per block pair instead
of seven (`Tuning.fused_backward`, where dq fits). Otherwise a separate dq kernel walks
the forward's plan. At masked pairs `ds` is set to 0, so a value that is not finite
there reaches no gradient of a query that does not attend it (as the XLA kernels).

Reading order: `backward` -> `_dkv_call` (fused or not) / `_dq_call` -> their kernels.
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array

from ..._core.config import KernelConfig, stat_dtype
from ..._core.operands import Operands, differentiable_part, reduce_to
from ._call import planned_call, split_refs
from ._operands import SUBLANES, BlockOperands, lane_blocks, prepare
from ._plan import Plan, backward_plan, forward_plan
from ._platform import on_tpu_or_interpreted
from ._tile import (
    DEFAULT_TUNING,
    LANES,
    NN,
    NT,
    TN,
    Tuning,
    Units,
    dot,
    lanes,
    logits,
    per_head_term,
    units,
)
from ._tile import prepared_queries as _prepared_queries

# VMEM a fused backward may spend on the whole head's dq (its float32 accumulator and
# the double-buffered output block); past it, the dq kernel runs instead.
FUSED_DQ_BYTES = 40 * 2**20


def backward(cfg: KernelConfig, q: Array, k: Array, v: Array, ops: Operands, lse: Array,
             delta: Array, d_out: Array, wanted: Operands, tuning: Tuning = DEFAULT_TUNING
             ) -> tuple[Array, Array, Array, Operands]:
    """The family contract's backward (the XLA family's `backward`): cotangents of q, k,
    v and of the differentiable operands `wanted` among those the family covers (ALiBi's
    slopes: summed per key block in the dk/dv kernel, added up here)."""
    stat = stat_dtype(q.dtype)
    u = units(cfg, q.dtype, tuning)
    fwd_plan, bwd_plan = forward_plan(cfg), backward_plan(cfg)
    masked = fwd_plan.any_partial or ops.has_data_mask or ops.has_positions
    b, h, g, seq_q, d = q.shape
    q_in = _prepared_queries(q, u)
    # lse in the kernel's units, so that `p = exp(s - lse)` needs no conversion per pair.
    lse_u, delta = u.from_natural(lse.astype(stat)), delta.astype(stat)
    dkv_ops = prepare(cfg, ops, q.shape[:3], v if masked else None, transposed=True,
                      alibi_units=u.before_cap)
    dq_bytes = g * seq_q * d * (4 + 2 * q.dtype.itemsize)
    fused = tuning.fused_backward and dq_bytes <= FUSED_DQ_BYTES
    slopes = ops.alibi_slopes is not None and wanted.alibi_slopes is not None
    call = functools.partial(_dkv_call, cfg, bwd_plan, dkv_ops, u, tuning.backward_chunk(cfg),
                             fused, slopes)
    results = list(on_tpu_or_interpreted(call, q_in, k, v, d_out, lse_u, delta))
    d_slopes = results.pop() if slopes else None
    if fused:
        d_q, d_k, d_v = results
    else:
        d_k, d_v = results
        dq_ops = prepare(cfg, ops, q.shape[:3], v if masked else None,
                         alibi_units=u.before_cap)
        d_q = on_tpu_or_interpreted(functools.partial(_dq_call, cfg, fwd_plan, dq_ops, u),
                                    q_in, k, v, d_out, lse_u, delta)
    d_ops = jax.tree.map(lambda _: None, differentiable_part(ops))
    if d_slopes is not None:
        # `sum(ds * distance)` per (batch, kv head, key block, query head, lane): the
        # slopes' cotangent is minus its total (the term is `-slope * distance`).
        per_head = -d_slopes.sum(axis=(2, 4, 5))  # (b, h, g)
        like = ops.alibi_slopes
        assert like is not None
        if like.shape[2] == 1:
            per_head = per_head.sum(axis=2, keepdims=True)
        d_ops = dataclasses.replace(d_ops, alibi_slopes=reduce_to(
            "alibi_slopes", per_head[..., None, None], like))
    return d_q, d_k, d_v, d_ops


def _ds(p, dp, delta, t, mask):
    """The logits' cotangent: softmax backward, through the cap, zero at masked pairs."""
    ds = p * (dp - delta)
    if t is not None:
        ds = ds * (1.0 - t * t)
    if mask is not None:
        ds = jnp.where(mask, ds, 0.0)
    return ds


def _by_flag(flag, operands: BlockOperands, step) -> None:
    """`step(positional)` on the steps with a block: 2 whole by position, 1 partial (see
    `_plan`); with data masks, one variant that reads the flag."""
    if operands.masks_data:
        pl.when(flag != 0)(lambda: step(flag == 1))
    else:
        pl.when(flag == 2)(lambda: step(False))
        pl.when(flag == 1)(lambda: step(True))


# dk, dv (and dq, fused): per key block, its query blocks (the transposed plan).


def _dkv_call(cfg: KernelConfig, plan: Plan, operands: BlockOperands, u: Units,
              chunk: int, fused: bool, slopes: bool, q, k, v, d_out, lse, delta, *,
              interpret: bool):
    b, h, g, seq_q, d = q.shape
    dv = v.shape[-1]
    bq, bk = cfg.block_q, cfg.block_k
    num_k, steps = plan.kv_block.shape
    stat = lse.dtype

    def q_map(bi, hi, j, s, q_block, *tables):
        return bi, hi, 0, q_block[j, s], 0

    def row_map(bi, hi, j, s, q_block, *tables):
        return bi, hi, 0, q_block[j, s], 0, 0

    def kv_map(bi, hi, j, s, *tables):
        return bi, hi, j, 0

    def head_map(bi, hi, j, s, *tables):
        return bi, hi, 0, 0, 0

    rows = tuple(lane_blocks(x, bq) for x in (lse, delta))  # queries along the lanes
    in_specs = [
        pl.BlockSpec((None, None, g, bq, d), q_map),
        pl.BlockSpec((None, None, bk, d), kv_map),
        pl.BlockSpec((None, None, bk, dv), kv_map),
        pl.BlockSpec((None, None, g, bq, dv), q_map),
        pl.BlockSpec((None, None, g, None, SUBLANES, bq), row_map),
        pl.BlockSpec((None, None, g, None, SUBLANES, bq), row_map),
        *operands.block_specs(bq, bk),
    ]
    out_specs = [pl.BlockSpec((None, None, bk, d), kv_map),
                 pl.BlockSpec((None, None, bk, dv), kv_map)]
    outputs = [(k.shape, k.dtype), (v.shape, v.dtype)]
    scratch = [pltpu.VMEM((bk, d), stat), pltpu.VMEM((bk, dv), stat)]
    item = q.dtype.itemsize
    blocks = 2 * item * (g * bq * (d + dv) + bk * (d + dv)) + 4 * (bk * (d + dv) + 4 * bk * chunk)
    if fused:
        out_specs.insert(0, pl.BlockSpec((None, None, g, seq_q, d), head_map))
        outputs.insert(0, (q.shape, q.dtype))
        scratch.append(pltpu.VMEM((g, seq_q, d), stat))
        blocks += g * seq_q * d * (4 + 2 * item)
        # dq gathers over the key blocks: they run in order within a head.
        semantics = ("parallel", "parallel", "arbitrary", "arbitrary")
    else:
        semantics = ("parallel", "parallel", "parallel", "arbitrary")
    if slopes:  # per key block, `sum(ds * distance)` over its query rows, per lane
        out_specs.append(pl.BlockSpec((None, None, None, g, 1, chunk),
                                      lambda bi, hi, j, s, *tables: (bi, hi, j, 0, 0, 0)))
        outputs.append(((b, h, num_k, g, 1, chunk), jnp.float32))
    kernel = functools.partial(_dkv_kernel, cfg=cfg, operands=operands, u=u, chunk=chunk,
                               steps=steps, fused=fused, slopes=slopes)
    return planned_call(
        kernel, plan=plan, operands=operands, grid=(b, h, num_k, steps), in_specs=in_specs,
        out_specs=out_specs, outputs=outputs, scratch=scratch, semantics=semantics,
        vmem_bytes=blocks,
        name="eqx_flash_backward_fused" if fused else "eqx_flash_backward_dkv",
        interpret=interpret)(q, k, v, d_out, *rows)


def _dkv_kernel(q_block_ref, flag_ref, *refs, cfg: KernelConfig, operands: BlockOperands,
                u: Units, chunk: int, steps: int, fused: bool, slopes: bool):
    tables, (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), operand_refs, rest = split_refs(
        refs, operands, 6)
    scratch = 3 if fused else 2  # the outputs come first, `ds_distance_ref` last of them
    outputs, rest = list(rest[:-scratch]), rest[-scratch:]
    ds_distance_ref = outputs.pop() if slopes else None
    if fused:
        dq_ref, dk_ref, dv_ref, dk_acc, dv_acc, dq_acc = (*outputs, *rest)
    else:
        dk_ref, dv_ref, dk_acc, dv_acc = (*outputs, *rest)
        dq_ref: Any = None
        dq_acc: Any = None
    bi, hi, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    num_k = pl.num_programs(2)
    g, bq, _ = q_ref.shape
    bk = k_ref.shape[0]
    stat = dk_acc.dtype

    if fused:
        @pl.when((j == 0) & (s == 0))
        def _init_dq():
            dq_acc[...] = jnp.zeros(dq_acc.shape, stat)

    @pl.when(s == 0)
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, stat)
        dv_acc[...] = jnp.zeros(dv_acc.shape, stat)
        if ds_distance_ref is not None:
            ds_distance_ref[...] = jnp.zeros(ds_distance_ref.shape, ds_distance_ref.dtype)

    flag, qb = flag_ref[j, s], q_block_ref[j, s]

    def step(positional):
        # (Tables read in the step, under its `pl.when`: inside a user's shard_map,
        # Pallas' interpreter rejects a read of a varying table outside one.)
        coefficients = None
        if operands.alibi is not None:
            coefficients = operands.alibi_coefficients(tables, bi, hi, pl.num_programs(1), g)
        k, v = k_ref[...], v_ref[...]
        dk, dv = dk_acc[...], dv_acc[...]
        for group in range(g):  # the query heads of this kv head, one product each
            for c in range(bq // chunk):
                queries = pl.ds(c * chunk, chunk)
                q, do = q_ref[group, queries, :], do_ref[group, queries, :]
                distance = term = None
                if coefficients is not None:
                    distance = operands.alibi_distance(cfg, operand_refs, qb * bq + c * chunk,
                                                       j * bk, (bk, chunk), group,
                                                       queries=queries)
                    term = coefficients[group] * jnp.broadcast_to(distance, (bk, chunk))
                st, t = logits(cfg, u, k, q, stat, term)  # (bk, chunk)
                mask = operands.mask(cfg, operand_refs, tables, bi, qb * bq + c * chunk,
                                     j * bk, (bk, chunk), positional, group,
                                     queries=queries)
                if mask is not None:
                    st = jnp.where(mask, st, -jnp.inf)
                p = u.exp(st - lse_ref[group, 0:1, queries])
                dp = dot(v, do, NT, stat)
                drop = operands.dropout(tables, bi, hi, pl.num_programs(1), g,
                                        qb * bq + c * chunk, j * bk, (bk, chunk), group)
                p_v = p
                if drop is not None:
                    p_v, dp = p * drop, dp * drop
                dv = dv + dot(p_v.astype(do.dtype), do, NN, stat)
                ds = _ds(p, dp, delta_ref[group, 0:1, queries], t, mask)
                if ds_distance_ref is not None:
                    assert distance is not None
                    ds_distance_ref[group] += jnp.sum(ds * distance, axis=0, keepdims=True)
                dk = dk + dot(ds.astype(q.dtype), q, NN, stat)
                if fused:
                    rows = pl.ds(qb * bq + c * chunk, chunk)
                    dq_acc[group, rows, :] += dot(ds.astype(k.dtype), k, TN, stat)
        dk_acc[...] = dk
        dv_acc[...] = dv

    _by_flag(flag, operands, step)

    @pl.when(s == steps - 1)
    def _finish():
        # dk of the natural logits `scale * q.k`: the queries carry `u.fold` of it.
        dk = dk_acc[...] * jnp.asarray(cfg.scale / u.fold, stat)
        dk_ref[...] = dk.astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)

    if fused:
        @pl.when((j == num_k - 1) & (s == steps - 1))
        def _finish_dq():
            dq = dq_acc[...] * jnp.asarray(cfg.scale, stat)
            dq_ref[...] = dq.astype(dq_ref.dtype)


# dq alone: per query block, its key blocks (the forward's plan).


def _dq_call(cfg: KernelConfig, plan: Plan, operands: BlockOperands, u: Units, q, k, v,
             d_out, lse, delta, *, interpret: bool):
    b, h, g, seq_q, d = q.shape
    dv = v.shape[-1]
    bq, bk = cfg.block_q, cfg.block_k
    num_q, steps = plan.kv_block.shape
    stat = lse.dtype

    def q_map(bi, hi, i, s, *tables):
        return bi, hi, 0, i, 0

    def kv_map(bi, hi, i, s, kv_block, *tables):
        return bi, hi, kv_block[i, s], 0

    columns = tuple(jnp.broadcast_to(x[..., None], (*x.shape, LANES)) for x in (lse, delta))
    in_specs = [
        pl.BlockSpec((None, None, g, bq, d), q_map),
        pl.BlockSpec((None, None, bk, d), kv_map),
        pl.BlockSpec((None, None, bk, dv), kv_map),
        pl.BlockSpec((None, None, g, bq, dv), q_map),
        pl.BlockSpec((None, None, g, bq, LANES), q_map),
        pl.BlockSpec((None, None, g, bq, LANES), q_map),
        *operands.block_specs(bq, bk),
    ]
    item = q.dtype.itemsize
    rows = g * bq
    blocks = (2 * item * (rows * (d + dv) + bk * (d + dv) + rows * d)
              + 4 * (rows * d + 4 * rows * bk + 4 * rows * LANES))
    kernel = functools.partial(_dq_kernel, cfg=cfg, operands=operands, u=u, steps=steps)
    (d_q,) = planned_call(
        kernel, plan=plan, operands=operands, grid=(b, h, num_q, steps), in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, g, bq, d), q_map)],
        outputs=[(q.shape, q.dtype)], scratch=[pltpu.VMEM((rows, d), stat)],
        semantics=("parallel", "parallel", "parallel", "arbitrary"), vmem_bytes=blocks,
        name="eqx_flash_backward_dq", interpret=interpret)(q, k, v, d_out, *columns)
    return d_q


def _dq_kernel(kv_block_ref, flag_ref, *refs, cfg: KernelConfig, operands: BlockOperands,
               u: Units, steps: int):
    tables, (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), operand_refs, rest = split_refs(
        refs, operands, 6)
    dq_ref, acc_ref = rest
    bi, hi, i, s = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    g, bq, d = q_ref.shape
    bk, dv = v_ref.shape
    rows, stat = g * bq, acc_ref.dtype

    @pl.when(s == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, stat)

    flag, kb = flag_ref[i, s], kv_block_ref[i, s]

    def step(positional):
        term = None
        if operands.alibi is not None:
            distance = operands.alibi_distance(cfg, operand_refs, i * bq, kb * bk, (1, bq, bk))
            term = per_head_term(operands.alibi_coefficients(
                tables, bi, hi, pl.num_programs(1), g), distance)
        sc, t = logits(cfg, u, q_ref[...].reshape(rows, d), k_ref[...], stat, term)
        mask = operands.mask(cfg, operand_refs, tables, bi, i * bq, kb * bk, (1, bq, bk),
                             positional)
        full_mask = None
        if mask is not None:
            full_mask = jnp.broadcast_to(mask, (g, bq, bk)).reshape(rows, bk)
            sc = jnp.where(full_mask, sc, -jnp.inf)
        p = u.exp(sc - lanes(lse_ref[...].reshape(rows, LANES), bk))
        dp = dot(do_ref[...].reshape(rows, dv), v_ref[...], NT, stat)
        drop = operands.dropout(tables, bi, hi, pl.num_programs(1), g, i * bq, kb * bk,
                                (1, bq, bk))
        if drop is not None:
            dp = dp * drop
        delta = lanes(delta_ref[...].reshape(rows, LANES), bk)
        ds = _ds(p, dp, delta, t, full_mask)
        k = k_ref[...]
        acc_ref[...] += dot(ds.astype(k.dtype), k, NN, stat)

    _by_flag(flag, operands, step)

    @pl.when(s == steps - 1)
    def _finish():
        dq = acc_ref[...] * jnp.asarray(cfg.scale, stat)
        dq_ref[...] = dq.reshape(g, bq, d).astype(dq_ref.dtype)
