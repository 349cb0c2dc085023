"""The Pallas TPU forward-and-tangent kernel: `jax.jvp` in one pass over the blocks.

The forward's online softmax (`forward`) carries, besides `acc = sum P V`, the tangent's
sums rescaled alike by the running max (the xla family's `tangent.forward_and_tangent`):
with `dS = scale (dQ K^T + Q dK^T)` (through the soft cap's derivative, zero at masked
pairs), `acc_t = sum (P dV + (P dS) V)` and `acc_ds = rowsum(P dS)`; at the end
`d_lse = acc_ds / l` and `d_out = acc_t / l - d_lse * out`. Per block pair: `S`, `dS`
(two products), `P V`, `P dV` and `(P dS) V`. A row that attends nothing gets zero
tangents; a value or value tangent that is not finite reaches exactly the rows that
attend it (a NaN tangent never makes `out` NaN).
"""

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array

from ..._core.config import KernelConfig, stat_dtype
from ..._core.operands import Operands
from ._call import by_flag, planned_call, read_step, split_refs, written_refs
from ._operands import BlockOperands, masks_some_pairs, prepare
from ._plan import Layout, Plan, applies_mask_mod, forward_plan
from ._platform import on_tpu_or_interpreted
from ._tile import (
    DEFAULT_TUNING,
    LANES,
    NN,
    NT,
    Tuning,
    Units,
    add_terms,
    and_masks,
    dot,
    lanes,
    logits,
    per_head_term,
    prepared_queries,
    units,
)
from ._tile_mods import ModDerivatives, apply_mask_mod, score_mod
from .forward import _FLOOR, _vmem_bytes, _write_finish


def forward_and_tangent(cfg: KernelConfig, q: Array, k: Array, v: Array, ops: Operands,
                        dq: Array | None, dk: Array | None, dv: Array | None,
                        d_ops: Operands, tuning: Tuning = DEFAULT_TUNING
                        ) -> tuple[Array, Array, Array, Array, Array]:
    """The family contract's `forward_and_tangent`: `(out, lse, max_score, d_out,
    d_lse)` for tangents `dq`, `dk`, `dv` (None: zero) and `d_ops` (of the operands
    the family covers: ALiBi's slopes, a bias, a `RelativeScoreMod`'s arrays)."""
    plan = forward_plan(cfg, ops.block_flags)
    masked = masks_some_pairs(cfg, ops, plan.any_partial)
    u = units(cfg, q.dtype, tuning)
    operands = prepare(cfg, ops, q.shape[:3], v if masked else None,
                       dv=dv if masked else None, term_units=u.before_cap, d_ops=d_ops)
    has = (dq is not None, dk is not None, dv is not None)
    arrays = [prepared_queries(q, u), k, v] + [x for x in (dq, dk, dv) if x is not None]
    call = functools.partial(_call, cfg, plan, operands, u,
                             tuning.forward_chunk(cfg), has)
    return on_tpu_or_interpreted(call, *arrays)


def _call(cfg: KernelConfig, plan: Plan, operands: BlockOperands, u: Units, chunk: int,
          has: tuple[bool, bool, bool], q, k, v, *tangents, interpret: bool):
    b, h, g, seq_q, d = q.shape
    dv_dim = v.shape[-1]
    bq, bk = cfg.block_q, cfg.block_k
    at = plan.layout.at
    stat = stat_dtype(q.dtype)

    def q_map(bi, hi, t, outer, inner, *tables):
        return bi, hi, 0, outer[at(bi, hi, t)], 0

    def kv_map(bi, hi, t, outer, inner, *tables):
        return bi, hi, inner[at(bi, hi, t)], 0

    tangent_specs = [spec for spec, present in zip(
        (pl.BlockSpec((None, None, g, bq, d), q_map), pl.BlockSpec((None, None, bk, d), kv_map),
         pl.BlockSpec((None, None, bk, dv_dim), kv_map)), has, strict=True) if present]
    in_specs = [
        pl.BlockSpec((None, None, g, bq, d), q_map),
        pl.BlockSpec((None, None, bk, d), kv_map),
        pl.BlockSpec((None, None, bk, dv_dim), kv_map),
        *tangent_specs,
    ]
    rows = g * bq
    out_specs = [pl.BlockSpec((None, None, g, bq, dv_dim), q_map),
                 pl.BlockSpec((None, None, g, bq, LANES), q_map),
                 pl.BlockSpec((None, None, g, bq, LANES), q_map),
                 pl.BlockSpec((None, None, g, bq, dv_dim), q_map),
                 pl.BlockSpec((None, None, g, bq, LANES), q_map)]
    outputs = [((b, h, g, seq_q, dv_dim), q.dtype), ((b, h, g, seq_q, LANES), stat),
               ((b, h, g, seq_q, LANES), stat), ((b, h, g, seq_q, dv_dim), q.dtype),
               ((b, h, g, seq_q, LANES), stat)]
    scratch = [pltpu.VMEM((rows, LANES), stat), pltpu.VMEM((rows, LANES), stat),
               pltpu.VMEM((rows, dv_dim), stat), pltpu.VMEM((rows, dv_dim), stat),
               pltpu.VMEM((rows, LANES), stat)]
    kernel = functools.partial(_kernel, cfg=cfg, operands=operands, u=u, chunk=chunk,
                               layout=plan.layout, listed=plan.listed, has=has)
    out, lse, max_score, d_out, d_lse = planned_call(
        kernel, plan=plan, operands=operands, blocks=(bq, bk), heads=(b, h),
        in_specs=in_specs,
        out_specs=out_specs, outputs=outputs, scratch=scratch,
        vmem_bytes=_vmem_bytes(2 * rows, 2 * bk, d, 2 * dv_dim, q.dtype),
        name="eqx_flash_forward_and_tangent", interpret=interpret,
        optional=(1, 2, 4))(q, k, v, *tangents)
    return out, lse[..., 0], max_score[..., 0], d_out, d_lse[..., 0]


def _kernel(outer_ref, inner_ref, code_ref, *refs, cfg: KernelConfig,
            operands: BlockOperands, u: Units, chunk: int, layout: Layout, listed: bool,
            has: tuple[bool, bool, bool], written: tuple[bool, ...]):
    tables, inputs, operand_refs, rest = split_refs(refs, operands, 3 + sum(has))
    q_ref, k_ref, v_ref = inputs[:3]
    it = iter(inputs[3:])
    dq_ref, dk_ref, dv_ref = (next(it) if present else None for present in has)
    # The statistics and the lse's tangent only where the program reads them (`written`).
    ((o_ref, lse_ref, max_ref, do_ref, dlse_ref),
     (m_scr, l_scr, acc_scr, acc_t_scr, acc_ds_scr)) = written_refs(rest, written)
    assert o_ref is not None and do_ref is not None  # (not optional)
    at = read_step(layout, outer_ref, inner_ref, code_ref)
    bi, hi, i, kb, flag = at.batch, at.head, at.outer, at.inner, at.flag
    g, bq, d = q_ref.shape
    bk = k_ref.shape[0]
    rows, stat = g * bq, m_scr.dtype

    @pl.when(at.first)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, _FLOOR, stat)
        for ref in (l_scr, acc_scr, acc_t_scr, acc_ds_scr):
            ref[...] = jnp.zeros(ref.shape, stat)

    heads = pl.num_programs(1)

    def step(positional):
        # (Tables read in the step, under its `pl.when`: inside a user's shard_map,
        # Pallas' interpreter rejects a read of a varying table outside one.)
        alibi = d_alibi = None
        if operands.alibi is not None:
            alibi = operands.alibi_coefficients(tables, bi, hi, heads, g)
            if "alibi_tangent" in operands.table_names:
                d_alibi = operands.alibi_coefficients(tables, bi, hi, heads, g,
                                                      "alibi_tangent")
        q = q_ref[...].reshape(rows, d)
        dq = None if dq_ref is None else dq_ref[...].reshape(rows, d)
        bad_block = None
        if operands.checks_values:
            bad_block = operands.block_has_bad_keys(tables, bi, hi, kb, heads,
                                                    cfg.padded_seq[1] // bk)
        for c in range(bk // chunk):
            keys = pl.ds(c * chunk, chunk)
            k = k_ref[keys, :]
            score_term = distance = None
            if alibi is not None:
                distance = operands.alibi_distance(cfg, operand_refs, i * bq,
                                                   kb * bk + c * chunk, (1, bq, chunk),
                                                   keys=keys)
                score_term = per_head_term(alibi, distance)
            score_term = add_terms(score_term, operands.pair_term(
                operand_refs, "bias", (g, bq, chunk), keys=keys))
            k_start = kb * bk + c * chunk
            score_term = add_terms(score_term, operands.relative_term(
                cfg, operand_refs, "relative", i * bq, k_start, (bq, chunk), g))
            indices = operands.global_indices(operand_refs, keys=keys)
            tile_mods = operands.tile_mods(operand_refs, keys=keys)
            along = tile_mods is not None and tile_mods.tangents
            mod = score_mod(cfg, u, bi=bi, hi=hi, groups=g, q_start=i * bq, k_start=k_start,
                            indices=indices, tile=tile_mods,
                            derivative="tangent" if along else True)
            sc, t, slope = logits(cfg, u, q, k, stat, score_term, mod)
            mod_tangent = None  # the tangent a split score_mod's arrays give it
            if isinstance(slope, ModDerivatives):
                slope, mod_tangent = slope.slope, slope.tangent
            # dS in natural units: the queries carry `u.fold` of the scale.
            ds = None
            if dq is not None:
                ds = dot(dq, k, NT, stat) * jnp.asarray(cfg.scale, stat)
            if dk_ref is not None:
                term = dot(q, dk_ref[keys, :], NT, stat) * jnp.asarray(cfg.scale / u.fold, stat)
                ds = term if ds is None else ds + term
            if d_alibi is not None:
                assert distance is not None
                ds = add_terms(ds, per_head_term(d_alibi, distance))
            ds = add_terms(ds, operands.pair_term(operand_refs, "bias_tangent",
                                                  (g, bq, chunk), keys=keys))
            ds = add_terms(ds, operands.relative_term(
                cfg, operand_refs, "relative_tangent", i * bq, k_start, (bq, chunk), g))
            if ds is not None and slope is not None:
                ds = ds * slope
            ds = add_terms(ds, mod_tangent)
            if ds is not None and t is not None:
                ds = ds * (1.0 - t * t)
            mask = operands.mask(cfg, operand_refs, tables, bi, i * bq, k_start,
                                 (1, bq, chunk), positional, keys=keys)
            if applies_mask_mod(positional, listed):
                mask = and_masks(mask, apply_mask_mod(cfg, bi, hi, g, i * bq, k_start,
                                                      (rows, chunk), indices=indices,
                                                      tile=tile_mods))
            if mask is not None:
                full = jnp.broadcast_to(mask, (g, bq, chunk)).reshape(rows, chunk)
                sc = jnp.where(full, sc, -jnp.inf)
                if ds is not None:
                    ds = jnp.where(full, ds, 0.0)
            m_prev = m_scr[...]
            m_next = jnp.maximum(m_prev, jnp.max(sc, axis=-1, keepdims=True))
            p = u.exp(sc - lanes(m_next, chunk))
            alpha = u.exp(m_prev - m_next)
            l_scr[...] = alpha * l_scr[...] + jnp.sum(p, axis=-1, keepdims=True)
            m_scr[...] = m_next
            p_ds = None if ds is None else p * ds
            if p_ds is not None:
                acc_ds_scr[...] = alpha * acc_ds_scr[...] + jnp.sum(p_ds, axis=-1,
                                                                    keepdims=True)
            else:
                acc_ds_scr[...] = alpha * acc_ds_scr[...]
            # Dropout acts on the weights of the values, not on l or rowsum(P dS).
            drop = operands.dropout(tables, bi, hi, heads, g, i * bq, kb * bk + c * chunk,
                                    (1, bq, chunk))
            if drop is not None:
                p = p * drop
                p_ds = None if p_ds is None else p_ds * drop
            _accumulate(operands, operand_refs, acc_scr, acc_t_scr, p, p_ds, alpha, v_ref,
                        dv_ref, keys, mask, bad_block, g, bq)

    by_flag(flag, operands.masks_data, step)

    @pl.when(at.last)
    def _finish():
        _write_finish(u, o_ref, lse_ref, max_ref, m_scr, l_scr, acc_scr)
        total = l_scr[...]
        attended = total != 0
        safe = jnp.where(attended, total, 1.0)
        d_lse = jnp.where(attended, acc_ds_scr[...] / safe, 0.0)
        dv_dim = acc_scr.shape[-1]
        out = o_ref[...].reshape(rows, dv_dim).astype(stat)
        d_out = acc_t_scr[...] * lanes(1.0 / safe, dv_dim) - lanes(d_lse, dv_dim) * out
        d_out = jnp.where(lanes(attended, dv_dim), d_out, 0.0)
        do_ref[...] = d_out.reshape(g, bq, dv_dim).astype(do_ref.dtype)
        if dlse_ref is not None:
            dlse_ref[...] = d_lse.reshape(g, bq, LANES).astype(dlse_ref.dtype)


def _accumulate(operands: BlockOperands, operand_refs, acc_scr, acc_t_scr, p, p_ds, alpha,
                v_ref, dv_ref, keys, mask, bad_block, g: int, bq: int) -> None:
    """`acc = alpha acc + P V`, `acc_t = alpha acc_t + P dV + (P dS) V`; in a block
    holding a non-finite value or value tangent (a prefetched table says which), those
    rows are zeroed for the products and the query rows that attend one marked: `acc`
    where the value is not finite, `acc_t` where either is not."""
    stat = acc_scr.dtype
    dv_dim = acc_scr.shape[-1]

    def update(v, d_v, reach_v=None, reach_any=None):
        pv = dot(p.astype(v.dtype), v, NN, stat)
        acc = lanes(alpha, dv_dim) * acc_scr[...] + pv
        acc_t = lanes(alpha, dv_dim) * acc_t_scr[...]
        if d_v is not None:
            acc_t = acc_t + dot(p.astype(d_v.dtype), d_v, NN, stat)
        if p_ds is not None:
            acc_t = acc_t + dot(p_ds.astype(v.dtype), v, NN, stat)
        if reach_v is not None:
            assert reach_any is not None
            acc = jnp.where(reach_v, jnp.asarray(jnp.nan, stat), acc)
            acc_t = jnp.where(reach_any, jnp.asarray(jnp.nan, stat), acc_t)
        acc_scr[...] = acc
        acc_t_scr[...] = acc_t

    def load():
        return v_ref[keys, :], None if dv_ref is None else dv_ref[keys, :]

    if mask is None or bad_block is None:
        update(*load())
        return

    @pl.when(jnp.logical_not(bad_block))
    def _finite():
        update(*load())

    @pl.when(bad_block)
    def _cleaned():
        v, d_v = load()
        v = jnp.where(jnp.isfinite(v.astype(jnp.float32)), v, jnp.zeros((), v.dtype))
        bad_any = bad_v = operands.bad_keys(operand_refs, keys=keys)  # (1, 1, chunk)
        if d_v is not None:
            d_v = jnp.where(jnp.isfinite(d_v.astype(jnp.float32)), d_v,
                            jnp.zeros((), d_v.dtype))
            bad_any = bad_v | operands.bad_keys(operand_refs, keys=keys,
                                                name="bad_tangent_key")

        def reaching(bad):
            reach = jnp.any(mask & bad, axis=-1, keepdims=True)  # (g|1, bq, 1)
            return jnp.broadcast_to(reach, (g, bq, 1)).reshape(g * bq, 1)

        update(v, d_v, reaching(bad_v), reaching(bad_any))
