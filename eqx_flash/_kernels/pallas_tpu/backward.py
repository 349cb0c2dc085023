"""The Pallas TPU backward: one fused kernel, or a dq kernel and a dk/dv kernel.

Given the forward's lse and `delta = rowsum(dO * O) - d_lse` (`backward_statistics`, the
family contract), each block pair's weights are `p = exp(s - lse)` and the logits'
cotangent `ds = p * (dO v^T - delta)`. Key blocks are the outer loop and their query
blocks the steps (the transposed plan); the logits are formed transposed, `(bk, bq)` per
query head, so that `dv += p^T dO` and `dk += ds^T q` are plain products, dk and dv
accumulating in VMEM. The fused kernel also adds `ds k` into a dq for the whole head
held in VMEM, written once when the head is done: five products per block pair instead
of seven (`Tuning.fused_backward`, where dq fits). Otherwise a separate dq kernel walks
the forward's plan; it also writes a bias's cotangent (`ds` itself, summed where the
bias broadcasts), so a backward that wants one runs the two kernels. At masked pairs
`ds` is set to 0, so a value that is not finite there reaches no gradient of a query
that does not attend it (as the XLA kernels).

Reading order: `backward` -> `_dkv_call` (fused or not) / `_dq_call` -> their kernels.
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array

from ..._core.config import KernelConfig, stat_dtype
from ..._core.operands import Operands, differentiable_part, reduce_to
from . import _relative
from ._call import by_flag, planned_call, read_step, split_refs
from ._operands import (
    SUBLANES,
    BlockOperands,
    lane_blocks,
    masks_some_pairs,
    mod_cotangent,
    prepare,
    summed_to,
)
from ._plan import Layout, Plan, applies_mask_mod, backward_plan, forward_plan
from ._platform import on_tpu_or_interpreted
from ._split_mods import Split, floating
from ._tile import (
    DEFAULT_TUNING,
    LANES,
    NN,
    NT,
    TN,
    Tuning,
    Units,
    add_terms,
    and_masks,
    dot,
    lanes,
    logits,
    per_head_term,
    units,
)
from ._tile import prepared_queries as _prepared_queries
from ._tile_mods import ModDerivatives, apply_mask_mod, score_mod

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
    fwd_plan, bwd_plan = forward_plan(cfg, ops.block_flags), backward_plan(cfg, ops.block_flags)
    masked = masks_some_pairs(cfg, ops, fwd_plan.any_partial)
    b, h, g, seq_q, d = q.shape
    q_in = _prepared_queries(q, u)
    # lse in the kernel's units, so that `p = exp(s - lse)` needs no conversion per pair.
    lse_u, delta = u.from_natural(lse.astype(stat)), delta.astype(stat)
    dkv_ops = prepare(cfg, ops, q.shape[:3], v if masked else None, transposed=True,
                      term_units=u.before_cap)
    dq_bytes = g * seq_q * d * (4 + 2 * q.dtype.itemsize)
    # A bias's cotangent is `ds` itself, summed where the bias broadcasts: the dq kernel
    # has it in the bias's own layout, queries along the rows.
    d_bias_wanted = ops.bias is not None and bool(wanted.bias)
    fused = tuning.fused_backward and dq_bytes <= FUSED_DQ_BYTES and not d_bias_wanted
    slopes = ops.alibi_slopes is not None and wanted.alibi_slopes is not None
    arrays_wanted = any(jax.tree.leaves(wanted.score_mod_arrays))
    relative = "relative" in dkv_ops.vectors and arrays_wanted
    # A split score_mod's floating values whose cotangents reach its arrays.
    split = dkv_ops.splits[0]
    mod_values = tuple(floating(split)) if split is not None and arrays_wanted else ()
    call = functools.partial(_dkv_call, cfg, bwd_plan, dkv_ops, u, tuning.backward_chunk(cfg),
                             fused, slopes, relative, mod_values)
    results = list(on_tpu_or_interpreted(call, q_in, k, v, d_out, lse_u, delta))
    d_mod_values = [results.pop() for _ in mod_values][::-1]
    d_windows = results.pop() if relative else None
    d_slopes = results.pop() if slopes else None
    d_bias = None
    if fused:
        d_q, d_k, d_v = results
    else:
        d_k, d_v = results
        dq_ops = prepare(cfg, ops, q.shape[:3], v if masked else None,
                         term_units=u.before_cap)
        d_q, d_bias = on_tpu_or_interpreted(
            functools.partial(_dq_call, cfg, fwd_plan, dq_ops, u,
                              ops.bias.dtype if d_bias_wanted and ops.bias is not None
                              else None),
            q_in, k, v, d_out, lse_u, delta)
    d_ops = jax.tree.map(lambda _: None, differentiable_part(ops))
    if mod_values:
        assert split is not None
        cotangents = _value_cotangents(cfg, split, mod_values, d_mod_values, bwd_plan)
        d_ops = dataclasses.replace(d_ops, score_mod_arrays=mod_cotangent(
            cfg, split, ops, q.shape[:3], wanted.score_mod_arrays, cotangents))
    if d_windows is not None:
        # Each step's window of the transposed vector starts where its tile's does.
        outer, inner = (jnp.asarray(x) for x in (bwd_plan.outer, bwd_plan.inner))
        starts = _relative.Vector.of(cfg, transposed=True).start(
            outer * cfg.block_k, inner * cfg.block_q, cfg.block_k)
        d_ops = dataclasses.replace(d_ops, score_mod_arrays=_relative.arrays_cotangent(
            cfg, ops, wanted.score_mod_arrays, d_windows, starts))
    if d_bias_wanted:
        like = ops.bias
        assert d_bias is not None and like is not None
        # Per (batch, kv head) and per block wherever the bias broadcasts over a
        # sequence (`_bias_cotangent`): summed over those blocks here.
        d_ops = dataclasses.replace(d_ops, bias=reduce_to(
            "bias", d_bias.sum(axis=(2, 3)), like))
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


def _value_cotangents(cfg: KernelConfig, split: Split, which: tuple[int, ...],
                      found: list[Array], plan: Plan) -> dict[int, Array]:
    """The cotangents of a split score_mod's floating values `which`, in
    `boundary_values`' layout over every group, from the dk/dv kernel's outputs: per
    key block `(b, h, nk, g, bk, lanes)` for a per-key value, else per step `(b, h,
    steps, g, 1, bq)`, added up by the step's query block (or in all, for one per
    batch element and head)."""
    (seq_q, seq_k), bq = cfg.padded_seq, cfg.block_q
    cotangents = {}
    for n, x in zip(which, found, strict=True):
        side = split.boundary[n].side
        b, h, _, g = x.shape[:4]
        if side == "k":
            cotangents[n] = jnp.moveaxis(x[..., 0], 2, 3).reshape(b, h, g, 1, seq_k)
            continue
        rows = x[:, :, :, :, 0, :]  # (b, h, steps, g, bq)
        if side == "bh":
            total = rows.sum(axis=(2, 4))  # (b, h, g)
            cotangents[n] = jnp.zeros((b, h, g, seq_q, 1), x.dtype).at[:, :, :, 0, 0].set(
                total)
            continue
        inner = jnp.broadcast_to(jnp.asarray(plan.inner), rows.shape[:3])
        per_block = jnp.zeros((b, h, seq_q // bq, g, bq), x.dtype)
        bi, hi = jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None]
        per_block = per_block.at[bi, hi, inner].add(rows)
        cotangents[n] = jnp.moveaxis(per_block, 3, 2).reshape(b, h, g, seq_q, 1)
    return cotangents


def _ds(p, dp, delta, t, slope, mask):
    """The logits' cotangent: softmax backward, through the cap and the score_mod (its
    derivative `slope`), zero at masked pairs."""
    return _through(_capped_ds(p, dp, delta, t), slope, mask)


def _capped_ds(p, dp, delta, t):
    """The cotangent of the score_mod's output: softmax backward, through the cap."""
    ds = p * (dp - delta)
    return ds if t is None else ds * (1.0 - t * t)


def _through(ds, slope, mask):
    """`ds` through a derivative `slope` (None: 1), zero at masked pairs."""
    if slope is not None:
        ds = ds * slope
    if mask is not None:
        ds = jnp.where(mask, ds, 0.0)
    return ds


# dk, dv (and dq, fused): per key block, its query blocks (the transposed plan).


def _dkv_call(cfg: KernelConfig, plan: Plan, operands: BlockOperands, u: Units,
              chunk: int, fused: bool, slopes: bool, relative: bool,
              mod_values: tuple[int, ...], q, k, v, d_out, lse, delta, *, interpret: bool):
    b, h, g, seq_q, d = q.shape
    dv = v.shape[-1]
    bq, bk = cfg.block_q, cfg.block_k
    num_k = plan.layout.num_outer
    at = plan.layout.at
    stat = lse.dtype

    def q_map(bi, hi, t, outer, inner, *tables):
        return bi, hi, 0, inner[at(bi, hi, t)], 0

    def row_map(bi, hi, t, outer, inner, *tables):
        return bi, hi, 0, inner[at(bi, hi, t)], 0, 0

    def kv_map(bi, hi, t, outer, inner, *tables):
        return bi, hi, outer[at(bi, hi, t)], 0

    def head_map(bi, hi, t, *tables):
        return bi, hi, 0, 0, 0

    rows = tuple(lane_blocks(x, bq) for x in (lse, delta))  # queries along the lanes
    in_specs = [
        pl.BlockSpec((None, None, g, bq, d), q_map),
        pl.BlockSpec((None, None, bk, d), kv_map),
        pl.BlockSpec((None, None, bk, dv), kv_map),
        pl.BlockSpec((None, None, g, bq, dv), q_map),
        pl.BlockSpec((None, None, g, None, SUBLANES, bq), row_map),
        pl.BlockSpec((None, None, g, None, SUBLANES, bq), row_map),
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
    if slopes:  # per key block, `sum(ds * distance)` over its query rows, per lane
        out_specs.append(pl.BlockSpec((None, None, None, g, 1, chunk),
                                      lambda bi, hi, t, outer, *tables: (
                                          bi, hi, outer[at(bi, hi, t)], 0, 0, 0)))
        outputs.append(((b, h, num_k, g, 1, chunk), jnp.float32))
    if relative:  # per step, the cotangent of its window of the relative vector
        out_specs.append(pl.BlockSpec((None, None, None, g, 1, bk + bq),
                                      lambda bi, hi, t, *tables: (bi, hi, t, 0, 0, 0)))
        outputs.append(((b, h, plan.layout.steps, g, 1, bk + bq), jnp.float32))
        # ... summed from its diagonals' cotangent (`_relative.add_to_diagonals`).
        scratch.append(pltpu.VMEM((g, _relative.MULTIPLE, bk + bq), jnp.float32))
        blocks += 2 * 4 * g * SUBLANES * (bk + bq) + 4 * g * _relative.MULTIPLE * (bk + bq)
    split = operands.splits[0]
    for n in mod_values:  # a split score_mod's value cotangents (`_value_cotangents`)
        assert split is not None
        if split.boundary[n].side == "k":  # per key, over the steps of its block
            out_specs.append(pl.BlockSpec((None, None, None, g, bk, LANES),
                                          lambda bi, hi, t, outer, *tables: (
                                              bi, hi, outer[at(bi, hi, t)], 0, 0, 0)))
            outputs.append(((b, h, num_k, g, bk, LANES), jnp.float32))
            blocks += 2 * 4 * g * bk * LANES
        else:  # per query (or summed), each step its own row
            out_specs.append(pl.BlockSpec((None, None, None, g, 1, bq),
                                          lambda bi, hi, t, *tables: (bi, hi, t, 0, 0, 0)))
            outputs.append(((b, h, plan.layout.steps, g, 1, bq), jnp.float32))
            blocks += 2 * 4 * g * SUBLANES * bq
    kernel = functools.partial(_dkv_kernel, cfg=cfg, operands=operands, u=u, chunk=chunk,
                               layout=plan.layout, listed=plan.listed, fused=fused,
                               slopes=slopes, relative=relative, mod_values=mod_values)
    return planned_call(
        kernel, plan=plan, operands=operands, blocks=(bq, bk), heads=(b, h),
        in_specs=in_specs,
        out_specs=out_specs, outputs=outputs, scratch=scratch, vmem_bytes=blocks,
        name="eqx_flash_backward_fused" if fused else "eqx_flash_backward_dkv",
        interpret=interpret)(q, k, v, d_out, *rows)


def _dkv_kernel(outer_ref, inner_ref, code_ref, *refs, cfg: KernelConfig,
                operands: BlockOperands, u: Units, chunk: int, layout: Layout, listed: bool,
                fused: bool, slopes: bool, relative: bool, mod_values: tuple[int, ...]):
    tables, (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), operand_refs, rest = split_refs(
        refs, operands, 6)
    # The outputs come first, the optional ones last; then the scratch.
    scratch = (3 if fused else 2) + relative
    outputs, rest = list(rest[:-scratch]), list(rest[-scratch:])
    d_diagonals = rest.pop() if relative else None
    d_value_refs = dict(zip(mod_values, [outputs.pop() for _ in mod_values][::-1],
                            strict=True))
    d_window_ref = outputs.pop() if relative else None
    ds_distance_ref = outputs.pop() if slopes else None
    if fused:
        dq_ref, dk_ref, dv_ref, dk_acc, dv_acc, dq_acc = (*outputs, *rest)
    else:
        dk_ref, dv_ref, dk_acc, dv_acc = (*outputs, *rest)
        dq_ref: Any = None
        dq_acc: Any = None
    at = read_step(layout, outer_ref, inner_ref, code_ref)
    bi, hi, j, qb, flag = at.batch, at.head, at.outer, at.inner, at.flag
    g, bq, _ = q_ref.shape
    bk = k_ref.shape[0]
    stat = dk_acc.dtype

    if fused:  # (dq gathers over every step of a head)
        @pl.when(at.t == 0)
        def _init_dq():
            dq_acc[...] = jnp.zeros(dq_acc.shape, stat)

    if d_window_ref is not None:  # every step writes its own window (0 if it has none)
        d_window_ref[...] = jnp.zeros(d_window_ref.shape, d_window_ref.dtype)
    split = operands.splits[0]
    per_key = {n for n in d_value_refs if split is not None and split.boundary[n].side == "k"}
    for n, ref in d_value_refs.items():  # (each step its own row: 0 if it has no block)
        if n not in per_key:
            ref[...] = jnp.zeros(ref.shape, ref.dtype)

    @pl.when(at.first)
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, stat)
        dv_acc[...] = jnp.zeros(dv_acc.shape, stat)
        if ds_distance_ref is not None:
            ds_distance_ref[...] = jnp.zeros(ds_distance_ref.shape, ds_distance_ref.dtype)
        for n in per_key:
            d_value_refs[n][...] = jnp.zeros(d_value_refs[n].shape, d_value_refs[n].dtype)

    def step(positional):
        # (Tables read in the step, under its `pl.when`: inside a user's shard_map,
        # Pallas' interpreter rejects a read of a varying table outside one.)
        coefficients = None
        if operands.alibi is not None:
            coefficients = operands.alibi_coefficients(tables, bi, hi, pl.num_programs(1), g)
        k, v = k_ref[...], v_ref[...]
        dk, dv = dk_acc[...], dv_acc[...]
        if d_diagonals is not None:
            d_diagonals[...] = jnp.zeros(d_diagonals.shape, d_diagonals.dtype)
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
                term = add_terms(term, operands.pair_term(operand_refs, "bias", (bk, chunk),
                                                          group, queries=queries))
                q_start = qb * bq + c * chunk
                term = add_terms(term, operands.relative_term(
                    cfg, operand_refs, "relative", j * bk, q_start, (bk, chunk), g, group))
                indices = operands.global_indices(operand_refs, group, queries=queries)
                tile_mods = operands.tile_mods(operand_refs, queries=queries)
                mod = score_mod(cfg, u, bi=bi, hi=hi, groups=g, q_start=q_start,
                                k_start=j * bk, group=group, indices=indices,
                                tile=tile_mods,
                                derivative="partials" if d_value_refs else True)
                st, t, slope = logits(cfg, u, k, q, stat, term, mod)  # (bk, chunk)
                partials: dict[int, Array] = {}
                if isinstance(slope, ModDerivatives):
                    slope, partials = slope.slope, slope.partials
                mask = operands.mask(cfg, operand_refs, tables, bi, q_start,
                                     j * bk, (bk, chunk), positional, group,
                                     queries=queries)
                if applies_mask_mod(positional, listed):
                    mask = and_masks(mask, apply_mask_mod(cfg, bi, hi, g, q_start, j * bk,
                                                          (bk, chunk), group, indices,
                                                          tile_mods))
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
                d_mod = _capped_ds(p, dp, delta_ref[group, 0:1, queries], t)
                ds = _through(d_mod, slope, mask)
                for n, ref in d_value_refs.items():
                    # The cotangent reaching the score_mod's value n: its output's times
                    # its partial in n.
                    x = _through(d_mod, partials[n], mask)
                    if n in per_key:  # keys are this tile's rows
                        ref[group] += jnp.broadcast_to(jnp.sum(x, axis=1, keepdims=True),
                                                       (bk, LANES))
                    else:
                        ref[group, :, c * chunk:(c + 1) * chunk] += jnp.sum(
                            x, axis=0, keepdims=True)
                if ds_distance_ref is not None:
                    assert distance is not None
                    ds_distance_ref[group] += jnp.sum(ds * distance, axis=0, keepdims=True)
                if d_diagonals is not None:  # its window, `c * chunk` into the step's
                    _relative.add_to_diagonals(d_diagonals, group, c * chunk, ds)
                dk = dk + dot(ds.astype(q.dtype), q, NN, stat)
                if fused:
                    rows = pl.ds(qb * bq + c * chunk, chunk)
                    dq_acc[group, rows, :] += dot(ds.astype(k.dtype), k, TN, stat)
        dk_acc[...] = dk
        dv_acc[...] = dv
        if d_diagonals is not None:
            assert d_window_ref is not None
            for group in range(g):
                d_window_ref[group] = _relative.sum_diagonals(d_diagonals, group)

    by_flag(flag, operands.masks_data, step)

    @pl.when(at.last)
    def _finish():
        # dk of the natural logits `scale * q.k`: the queries carry `u.fold` of it.
        dk = dk_acc[...] * jnp.asarray(cfg.scale / u.fold, stat)
        dk_ref[...] = dk.astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)

    if fused:
        @pl.when(at.t == layout.steps - 1)
        def _finish_dq():
            dq = dq_acc[...] * jnp.asarray(cfg.scale, stat)
            dq_ref[...] = dq.astype(dq_ref.dtype)


# dq alone: per query block, its key blocks (the forward's plan).


def _bias_pair(operands: BlockOperands):
    return next(p for p in operands.pairs if p.name == "bias")


def _bias_cotangent(operands: BlockOperands, cfg: KernelConfig, b: int, h: int,
                    layout: Layout, batch_inner: bool
                    ) -> tuple[tuple[int | None, ...], Any, tuple[int, ...]]:
    """Where the dq kernel writes a bias's cotangent (block shape, index map) and its
    shape: `(b|1, h, nq|1, nk|1, g|1, seq_q|1, seq_k|1)`, a block per step; along a
    sequence the bias broadcasts over, each block's sum on an axis of its own (`nq`,
    `nk`), so that no block is written twice. `batch_inner`: one block for every batch
    element, which the batch-inner grid sums into while it stays in VMEM."""
    pair = _bias_pair(operands)
    (seq_q, seq_k), bq, bk = cfg.padded_seq, cfg.block_q, cfg.block_k
    shape = (1 if batch_inner else b, h, 1 if pair.queries else seq_q // bq,
             1 if pair.keys else seq_k // bk,
             pair.groups, seq_q if pair.queries else 1, seq_k if pair.keys else 1)

    def index_map(bi, hi, t, outer, inner, *tables):
        i, kb = outer[layout.at(bi, hi, t)], inner[layout.at(bi, hi, t)]
        q_at, k_at = (0, i) if pair.queries else (i, 0), (0, kb) if pair.keys else (kb, 0)
        return 0 if batch_inner else bi, hi, q_at[0], k_at[0], 0, q_at[1], k_at[1]

    block = (None, None, None, None, pair.groups, bq if pair.queries else 1,
             bk if pair.keys else 1)
    return block, index_map, shape


def _dq_call(cfg: KernelConfig, plan: Plan, operands: BlockOperands, u: Units,
             d_bias_dtype: Any, q, k, v, d_out, lse, delta, *, interpret: bool):
    """dq and, with `d_bias_dtype` (the bias's dtype; None: not wanted), the bias's
    cotangent (`_bias_cotangent`)."""
    b, h, g, seq_q, d = q.shape
    d_bias_wanted = d_bias_dtype is not None
    dv = v.shape[-1]
    bq, bk = cfg.block_q, cfg.block_k
    at = plan.layout.at
    stat = lse.dtype

    def q_map(bi, hi, t, outer, inner, *tables):
        return bi, hi, 0, outer[at(bi, hi, t)], 0

    def kv_map(bi, hi, t, outer, inner, *tables):
        return bi, hi, inner[at(bi, hi, t)], 0

    def q_of_every_batch_map(bi, hi, t, outer, inner, *tables):
        return 0, hi, 0, outer[at(bi, hi, t)], 0

    columns = tuple(jnp.broadcast_to(x[..., None], (*x.shape, LANES)) for x in (lse, delta))
    in_specs = [
        pl.BlockSpec((None, None, g, bq, d), q_map),
        pl.BlockSpec((None, None, bk, d), kv_map),
        pl.BlockSpec((None, None, bk, dv), kv_map),
        pl.BlockSpec((None, None, g, bq, dv), q_map),
        pl.BlockSpec((None, None, g, bq, LANES), q_map),
        pl.BlockSpec((None, None, g, bq, LANES), q_map),
    ]
    item = q.dtype.itemsize
    rows = g * bq
    batch_inner = d_bias_wanted and _sums_bias_over_batch(operands, plan, b, rows * d, item)
    # Batch-inner: the dq of one query block for every batch element stays in VMEM (its
    # accumulator and output block) while each step runs for the batch in turn.
    copies = b if batch_inner else 1
    blocks = (2 * item * (rows * (d + dv) + bk * (d + dv) + copies * rows * d)
              + 4 * (copies * rows * d + 4 * rows * bk + 4 * rows * LANES))
    if batch_inner:
        out_specs = [pl.BlockSpec((b, None, g, bq, d), q_of_every_batch_map)]
    else:
        out_specs = [pl.BlockSpec((None, None, g, bq, d), q_map)]
    outputs = [(q.shape, q.dtype)]
    scratch = [pltpu.VMEM((b, rows, d) if batch_inner else (rows, d), stat)]
    zeroed: tuple[int, ...] = ()
    d_bias = 0
    if d_bias_wanted:
        block, index_map, shape = _bias_cotangent(operands, cfg, b, h, plan.layout,
                                                  batch_inner)
        pair, size = _bias_pair(operands), int(np.prod([n for n in block if n is not None]))
        # Summed over the batch in VMEM, in the bias's own layout (nothing left to sum
        # outside): written in the bias's dtype from a float32 accumulator, with no float32
        # copy in HBM and no pass to convert it.
        own_dtype = (batch_inner and pair.queries and pair.keys and (pair.heads or h == 1)
                     and jnp.dtype(d_bias_dtype).itemsize < 4)
        d_bias = _ACCUMULATED if own_dtype else _WRITTEN
        out_dtype = jnp.dtype(d_bias_dtype if own_dtype else jnp.float32)
        out_specs.append(pl.BlockSpec(block, index_map))
        outputs.append((shape, out_dtype))
        blocks += 2 * out_dtype.itemsize * size
        if own_dtype:
            scratch.append(pltpu.VMEM(tuple(n for n in block if n is not None), jnp.float32))
            blocks += 4 * size
        # Blocks of pairs the plan never visits (an empty band) stay zero.
        if not plan.visits_every_pair:
            zeroed = (1,)
    kernel = functools.partial(_dq_kernel, cfg=cfg, operands=operands, u=u,
                               layout=plan.layout, listed=plan.listed, zeroed=len(zeroed),
                               batches=b if batch_inner else 0, d_bias=d_bias)
    results = planned_call(
        kernel, plan=plan, operands=operands, blocks=(bq, bk), heads=(b, h),
        in_specs=in_specs, out_specs=out_specs, outputs=outputs,
        scratch=scratch, vmem_bytes=blocks,
        name="eqx_flash_backward_dq", interpret=interpret, zeroed=zeroed,
        batch_inner=batch_inner,
    )(q, k, v, d_out, *columns)
    return results[0], results[1] if d_bias_wanted else None


def _sums_bias_over_batch(operands: BlockOperands, plan: Plan, b: int, dq_block: int,
                          item: int) -> bool:
    """Whether the dq kernel sums a bias's cotangent over the batch in VMEM (a batch-inner
    grid) rather than writing one per batch element, summed afterwards (`b` times the
    bias's size in float32 in HBM): for a bias the batch broadcasts over, a plan the
    same for every batch element, and every batch element's dq of one query block
    (`dq_block` elements; its float32 accumulator and output block) within
    `FUSED_DQ_BYTES`."""
    return (b > 1 and not _bias_pair(operands).batch and plan.layout.lead_b == 1
            and b * dq_block * (4 + 2 * item) <= FUSED_DQ_BYTES)


# How the dq kernel writes a bias's cotangent (`d_bias`): not at all (0), each step's
# straight to its output block, or summed over the batch in a float32 accumulator first.
_WRITTEN, _ACCUMULATED = 1, 2


def _dq_kernel(outer_ref, inner_ref, code_ref, *refs, cfg: KernelConfig,
               operands: BlockOperands, u: Units, layout: Layout, listed: bool, zeroed: int,
               batches: int, d_bias: int):
    tables, (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), operand_refs, rest = split_refs(
        refs, operands, 6)
    rest = list(rest[zeroed:])  # (the zero inputs behind the aliased outputs)
    dq_ref = rest.pop(0)
    d_bias_ref = rest.pop(0) if d_bias else None
    acc_ref = rest.pop(0)
    d_bias_acc = rest.pop(0) if d_bias == _ACCUMULATED else None
    at = read_step(layout, outer_ref, inner_ref, code_ref, batches)
    bi, hi, i, kb, flag = at.batch, at.head, at.outer, at.inner, at.flag
    if batches:  # batch-inner (`_sums_bias_over_batch`): this batch element's dq
        dq_ref, acc_ref = dq_ref.at[bi], acc_ref.at[bi]
    g, bq, d = q_ref.shape
    bk, dv = v_ref.shape
    rows, stat = g * bq, acc_ref.dtype

    @pl.when(at.first)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, stat)

    if d_bias_ref is not None:
        @pl.when(at.first & (flag == 0))
        def _no_keys():  # a query block the plan gives no key block: its block is zero
            d_bias_ref[...] = jnp.zeros(d_bias_ref.shape, d_bias_ref.dtype)

    def step(positional):
        term = None
        if operands.alibi is not None:
            distance = operands.alibi_distance(cfg, operand_refs, i * bq, kb * bk, (1, bq, bk))
            term = per_head_term(operands.alibi_coefficients(
                tables, bi, hi, pl.num_programs(1), g), distance)
        term = add_terms(term, operands.pair_term(operand_refs, "bias", (g, bq, bk)))
        term = add_terms(term, operands.relative_term(cfg, operand_refs, "relative", i * bq,
                                                      kb * bk, (bq, bk), g))
        indices = operands.global_indices(operand_refs)
        tile_mods = operands.tile_mods(operand_refs)
        mod = score_mod(cfg, u, bi=bi, hi=hi, groups=g, q_start=i * bq, k_start=kb * bk,
                        indices=indices, tile=tile_mods)
        sc, t, slope = logits(cfg, u, q_ref[...].reshape(rows, d), k_ref[...], stat, term,
                              mod)
        mask = operands.mask(cfg, operand_refs, tables, bi, i * bq, kb * bk, (1, bq, bk),
                             positional)
        if applies_mask_mod(positional, listed):
            mask = and_masks(mask, apply_mask_mod(cfg, bi, hi, g, i * bq, kb * bk,
                                                  (rows, bk), indices=indices,
                                                  tile=tile_mods))
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
        ds = _ds(p, dp, delta, t, slope, full_mask)
        k = k_ref[...]
        acc_ref[...] += dot(ds.astype(k.dtype), k, NN, stat)
        if d_bias_ref is not None:
            # (`ds` is the cotangent of the natural pre-cap logits, where the bias adds.)
            cotangent = summed_to(ds.reshape(g, bq, bk), d_bias_ref.shape)
            if batches:
                _sum_over_batch(d_bias_ref, d_bias_acc, cotangent, bi, batches)
            else:
                d_bias_ref[...] = cotangent

    by_flag(flag, operands.masks_data, step)

    @pl.when(at.last)
    def _finish():
        dq = acc_ref[...] * jnp.asarray(cfg.scale, stat)
        dq_ref[...] = dq.reshape(g, bq, d).astype(dq_ref.dtype)


def _sum_over_batch(out_ref, acc_ref, x: Array, bi: Array, batches: int) -> None:
    """`x` summed over the batch elements of a batch-inner grid's consecutive steps, into
    the output block they share (it stays in VMEM), or into the float32 `acc_ref` when
    given, written to `out_ref` in its dtype after the last element."""
    target = out_ref if acc_ref is None else acc_ref

    @pl.when(bi == 0)
    def _set():
        target[...] = x

    @pl.when(bi > 0)
    def _add():
        target[...] += x

    if acc_ref is not None:
        @pl.when(bi == batches - 1)
        def _write():
            out_ref[...] = acc_ref[...].astype(out_ref.dtype)
