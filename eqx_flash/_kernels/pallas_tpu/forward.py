"""The Pallas TPU forward kernel: online softmax over a flat plan of block pairs.

One kernel instance per `(batch, kv head, step)`: the steps walk each query block's
non-empty key blocks from prefetched tables (`_plan.Plan`), so blocks that causal, a
window or a mask_mod's summary empty cost neither a DMA nor a grid step. The query
heads of a kv head are folded into the rows of one tile (GQA without repeating k, v).
The running max, sum and output accumulator live in VMEM scratch across
a query block's steps; masks are computed from iota and the per-key/per-query operands
(`_operands`) inside the kernel, only on the steps the plan marks partial. The finish
follows `_semantics.softmax.finish` exactly: a row that attended nothing gets 0 and -inf.

Reading order: `forward` (layout, tables, `pallas_call`) -> `_kernel` (one grid step) ->
`_step` (one block pair) -> `_finish`.
"""

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array

from ..._core.config import KernelConfig, stat_dtype
from ..._core.operands import Operands
from ..._semantics.masking import window_overlap
from ._call import planned_call, read_step, split_refs, written_refs
from ._operands import BlockOperands, masks_some_pairs, prepare
from ._plan import Layout, Plan, applies_mask_mod, forward_plan
from ._platform import on_tpu_or_interpreted
from ._tile import (
    DEFAULT_TUNING,
    LANES,
    NN,
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
from ._tile_mods import apply_mask_mod, score_mod

_FLOOR = float(jnp.finfo(jnp.float32).min)  # `softmax.start`'s running-max floor


def forward(cfg: KernelConfig, q: Array, k: Array, v: Array, ops: Operands,
            tuning: Tuning = DEFAULT_TUNING) -> tuple[Array, Array, Array]:
    """`(out, lse, max_score)` as the XLA family's `forward`: q `(b, h, g, seq_q_pad, d)`,
    k `(b, h, seq_k_pad, d)`, v `(b, h, seq_k_pad, dv)`, padded to whole blocks of
    `cfg`; out in q's dtype, the statistics `(b, h, g, seq_q_pad)` float32."""
    plan = forward_plan(cfg, ops.block_flags)
    masked = masks_some_pairs(cfg, ops, plan.any_partial)
    u = units(cfg, q.dtype, tuning)
    operands = prepare(cfg, ops, q.shape[:3], v if masked else None, term_units=u.before_cap)
    call = functools.partial(_call, cfg, plan, operands, u, tuning.forward_chunk(cfg),
                             tuning.partial_split(cfg.block_q))
    return on_tpu_or_interpreted(call, prepared_queries(q, u), k, v)


def _call(cfg: KernelConfig, plan: Plan, operands: BlockOperands, u: Units,
          chunk: int, split: int | None, q: Array, k: Array, v: Array, *, interpret: bool
          ) -> tuple[Array, Array, Array]:
    b, h, g, seq_q, d = q.shape
    seq_k, dv = k.shape[2], v.shape[-1]
    bq, bk = cfg.block_q, cfg.block_k
    at = plan.layout.at
    stat = stat_dtype(q.dtype)
    assert seq_q == plan.layout.num_outer * bq and seq_k % bk == 0, (q.shape, k.shape, cfg)

    def q_map(bi, hi, t, outer, inner, *tables):
        return bi, hi, 0, outer[at(bi, hi, t)], 0

    def kv_map(bi, hi, t, outer, inner, *tables):
        return bi, hi, inner[at(bi, hi, t)], 0

    in_specs = [
        pl.BlockSpec((None, None, g, bq, d), q_map),
        pl.BlockSpec((None, None, bk, d), kv_map),
        pl.BlockSpec((None, None, bk, dv), kv_map),
    ]
    out_specs = [
        pl.BlockSpec((None, None, g, bq, dv), q_map),
        pl.BlockSpec((None, None, g, bq, LANES), q_map),  # lse, lane-replicated
        pl.BlockSpec((None, None, g, bq, LANES), q_map),  # max score
    ]
    outputs = [((b, h, g, seq_q, dv), q.dtype), ((b, h, g, seq_q, LANES), stat),
               ((b, h, g, seq_q, LANES), stat)]
    rows = g * bq
    scratch = [pltpu.VMEM((g, bq, LANES), stat), pltpu.VMEM((g, bq, LANES), stat),
               pltpu.VMEM((g, bq, dv), stat)]
    kernel = functools.partial(_kernel, cfg=cfg, operands=operands, u=u, chunk=chunk,
                               split=split, layout=plan.layout, listed=plan.listed)
    out, lse, max_score = planned_call(
        kernel, plan=plan, operands=operands, blocks=(bq, bk), heads=(b, h),
        in_specs=in_specs,
        out_specs=out_specs, outputs=outputs, scratch=scratch,
        vmem_bytes=_vmem_bytes(rows, bk, d, dv, q.dtype), name="eqx_flash_forward",
        interpret=interpret, optional=(1, 2))(q, k, v)
    return out, lse[..., 0], max_score[..., 0]


def _vmem_bytes(rows: int, bk: int, d: int, dv: int, dtype) -> int:
    """VMEM for one step: double-buffered q, k, v and out blocks, the f32 logits and
    weights, the scratch."""
    item = jnp.dtype(dtype).itemsize
    blocks = 2 * item * (rows * d + bk * d + bk * dv + rows * dv) + 2 * 4 * 2 * rows * LANES
    temps = 4 * (3 * rows * bk + rows * (dv + 2 * LANES))
    return blocks + temps


def _kernel(outer_ref, inner_ref, code_ref, *refs, cfg: KernelConfig,
            operands: BlockOperands, u: Units, chunk: int, split: int | None, layout: Layout,
            listed: bool, written: tuple[bool, bool, bool]):
    tables, (q_ref, k_ref, v_ref), operand_refs, rest = split_refs(refs, operands, 3)
    # The lse and max scores are written only where the program reads them (`written`).
    (o_ref, lse_ref, max_ref), (m_scr, l_scr, acc_scr) = written_refs(rest, written)
    at = read_step(layout, outer_ref, inner_ref, code_ref)
    bi, hi, i, kb, flag = at.batch, at.head, at.outer, at.inner, at.flag

    @pl.when(at.first)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, _FLOOR, m_scr.dtype)
        l_scr[...] = jnp.zeros(l_scr.shape, l_scr.dtype)
        acc_scr[...] = jnp.zeros(acc_scr.shape, acc_scr.dtype)

    step = functools.partial(
        _step, cfg=cfg, operands=operands, u=u, chunk=chunk, split=split, q_ref=q_ref,
        k_ref=k_ref, v_ref=v_ref, operand_refs=operand_refs, tables=tables, bi=bi, hi=hi,
        qb=i, kb=kb, m_scr=m_scr, l_scr=l_scr, acc_scr=acc_scr, listed=listed)
    # 2: the block is whole by position (its data masks, if any, still apply);
    # 1: partial (needs the positional mask too); 0: no block at this step.
    if operands.masks_data and split is None:
        # One body: the data masks are evaluated anyway, the band is or-ed in at run time.
        pl.when(flag != 0)(functools.partial(step, positional=None, flag=flag))
    else:
        pl.when(flag == 2)(functools.partial(step, positional=False, flag=flag))
        pl.when(flag == 1)(functools.partial(step, positional=True, flag=flag))

    @pl.when(at.last)
    def _finish():
        _write_finish(u, o_ref, lse_ref, max_ref, m_scr, l_scr, acc_scr)


def _step(*, positional: bool | None, flag, cfg: KernelConfig, operands: BlockOperands,
          u: Units, chunk: int, split: int | None, q_ref, k_ref, v_ref, operand_refs,
          tables, bi, hi, qb, kb, m_scr, l_scr, acc_scr, listed: bool):
    """Take key block `kb` into the running state of query block `qb`, `chunk` keys at
    a time. `positional`: whether the causal/window/padding mask applies (None: decided
    by `flag` at run time, when data masks apply anyway). A partial block with `split`
    is taken in tiles of `split` rows by `chunk` keys, each skipped, computed whole or
    masked by where it lies against the band: the masked half of a diagonal block costs
    nothing and only the tiles the band crosses pay for the mask."""
    bq = q_ref.shape[1]
    bk = k_ref.shape[0]
    band: bool | Array = flag == 1 if positional is None else positional
    bad_block = None
    if operands.checks_values:
        bad_block = operands.block_has_bad_keys(tables, bi, hi, kb, pl.num_programs(1),
                                                cfg.padded_seq[1] // bk)
    tile = functools.partial(
        _tile, cfg=cfg, operands=operands, u=u, q_ref=q_ref, k_ref=k_ref, v_ref=v_ref,
        operand_refs=operand_refs, tables=tables, bi=bi, hi=hi, q_block_start=qb * bq,
        m_scr=m_scr, l_scr=l_scr, acc_scr=acc_scr, bad_block=bad_block,
        with_mask_mod=applies_mask_mod(positional, listed))
    for c in range(bk // chunk):
        keys = pl.ds(c * chunk, chunk)
        k_start = kb * bk + c * chunk
        if positional is not True or split is None:
            tile(r0=0, n=bq, keys=keys, k_start=k_start, band=band)
            continue
        k_last = jnp.minimum(k_start + chunk, cfg.seq_k) - 1
        for r0 in range(0, bq, split):
            p_first = qb * bq + r0 + cfg.offset
            some, every = window_overlap(p_first, p_first + split - 1, k_start, k_last,
                                         cfg.band_window, k_start < cfg.seq_k,
                                         k_start + chunk <= cfg.seq_k)
            sub = functools.partial(tile, r0=r0, n=split, keys=keys, k_start=k_start)
            pl.when(some & every)(functools.partial(sub, band=False))
            pl.when(some & jnp.logical_not(every))(functools.partial(sub, band=True))


def _tile(*, r0: int, n: int, keys, k_start, band: bool | Array, cfg: KernelConfig,
          operands: BlockOperands, u: Units, q_ref, k_ref, v_ref, operand_refs, tables, bi,
          hi, q_block_start, m_scr, l_scr, acc_scr, bad_block, with_mask_mod: bool) -> None:
    """The online-softmax update of rows `[r0, r0 + n)` of every folded query head by
    the `keys` slice of the key block (starting at key `k_start`); `with_mask_mod`: whether
    the `mask_mod` applies (not on a block its summary fills)."""
    g, bq, d = q_ref.shape
    whole_rows = n == bq
    rows = slice(None) if whole_rows else pl.ds(r0, n)
    stat = m_scr.dtype
    q = q_ref[:, rows, :].reshape(g * n, d)
    k = k_ref[keys, :]
    chunk = k.shape[0]
    term = None
    if operands.alibi is not None:
        distance = operands.alibi_distance(cfg, operand_refs, q_block_start + r0, k_start,
                                           (1, n, chunk), keys=keys,
                                           queries=None if whole_rows else rows)
        term = per_head_term(operands.alibi_coefficients(tables, bi, hi, pl.num_programs(1),
                                                         g), distance)
    term = add_terms(term, operands.pair_term(operand_refs, "bias", (g, n, chunk), keys=keys,
                                              queries=None if whole_rows else rows))
    q_start = q_block_start + r0
    term = add_terms(term, operands.relative_term(cfg, operand_refs, "relative", q_start,
                                                  k_start, (n, chunk), g))
    indices = operands.global_indices(operand_refs, keys=keys,
                                      queries=None if whole_rows else rows)
    tile_mods = operands.tile_mods(operand_refs, keys=keys,
                                   queries=None if whole_rows else rows)
    mod = score_mod(cfg, u, bi=bi, hi=hi, groups=g, q_start=q_start, k_start=k_start,
                    derivative=False, indices=indices, tile=tile_mods)
    s, _, _ = logits(cfg, u, q, k, stat, term, mod)  # (g * n, chunk)
    mask = operands.mask(cfg, operand_refs, tables, bi, q_start, k_start,
                         (1, n, chunk), band, keys=keys,
                         queries=None if whole_rows else rows)
    if with_mask_mod:
        mask = and_masks(mask, apply_mask_mod(cfg, bi, hi, g, q_start, k_start,
                                              (g * n, chunk), indices=indices,
                                              tile=tile_mods))
    if mask is not None:
        s = jnp.where(mask, s.reshape(g, n, chunk), -jnp.inf).reshape(g * n, chunk)
    m_prev = m_scr[:, rows, :].reshape(g * n, LANES)
    l_prev = l_scr[:, rows, :].reshape(g * n, LANES)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))  # (g * n, LANES)
    p = u.exp(s - lanes(m_next, chunk))
    alpha = u.exp(m_prev - m_next)
    l_scr[:, rows, :] = (alpha * l_prev + jnp.sum(p, axis=-1, keepdims=True)).reshape(
        g, n, LANES)
    m_scr[:, rows, :] = m_next.reshape(g, n, LANES)
    drop = operands.dropout(tables, bi, hi, pl.num_programs(1), g, q_block_start + r0,
                            k_start, (1, n, chunk))
    p_v = p if drop is None else p * drop  # dropout acts on the weights, not on l
    _accumulate(operands, operand_refs, acc_scr, rows, p_v, alpha, v_ref, keys, mask,
                bad_block, g, n)


def _accumulate(operands, operand_refs, acc_scr, rows, p, alpha, v_ref, keys, mask,
                bad_block, g: int, n: int) -> None:
    """`acc = alpha * acc + p @ v` on `rows` of the accumulator. A masked pair has weight
    0, but 0 * NaN is NaN: in a block holding a value row that is not finite (rare: a
    prefetched table says which), such rows are zeroed for the product and the query
    rows that do attend one are marked, as `_kernels.tile.attended_values` does."""
    stat = acc_scr.dtype
    dv = acc_scr.shape[-1]

    def update(v, reaches=None):
        acc = acc_scr[:, rows, :].reshape(g * n, dv)
        acc = lanes(alpha, dv) * acc + dot(p.astype(v.dtype), v, NN, stat)
        if reaches is not None:
            acc = jnp.where(reaches, jnp.asarray(jnp.nan, stat), acc)
        acc_scr[:, rows, :] = acc.reshape(g, n, dv)

    if mask is None or bad_block is None:
        update(v_ref[keys, :])
        return

    @pl.when(jnp.logical_not(bad_block))
    def _finite():
        update(v_ref[keys, :])

    @pl.when(bad_block)
    def _cleaned():
        v = v_ref[keys, :]
        v = jnp.where(jnp.isfinite(v.astype(jnp.float32)), v, jnp.zeros((), v.dtype))
        bad = operands.bad_keys(operand_refs, keys=keys)
        reaches = jnp.any(mask & bad, axis=-1, keepdims=True)
        update(v, jnp.broadcast_to(reaches, (g, n, 1)).reshape(g * n, 1))


def _write_finish(u: Units, o_ref, lse_ref, max_ref, m_scr, l_scr, acc_scr):
    """`_semantics.softmax.finish` and `max_score` on the scratch, written out (the
    statistics in natural units; the lse and max scores where their refs are given)."""
    g, bq, dv = o_ref.shape
    rows = g * bq  # (the scratch is `(g, bq, .)` here, `(rows, .)` in the tangent kernel)
    m = m_scr[...].reshape(rows, LANES)
    total = l_scr[...].reshape(rows, LANES)
    acc = acc_scr[...].reshape(rows, dv)
    attended = total != 0  # NaN compares unequal: a NaN row stays NaN
    safe = jnp.where(attended, total, 1.0)
    out = jnp.where(lanes(attended, dv), acc * lanes(1.0 / safe, dv), 0.0)
    nonfinite = jnp.logical_not(jnp.all(jnp.isfinite(out), axis=-1, keepdims=True))
    out = jnp.where(nonfinite, jnp.asarray(jnp.nan, out.dtype), out)
    o_ref[...] = out.reshape(g, bq, dv).astype(o_ref.dtype)
    if lse_ref is not None:
        lse = jnp.where(attended, u.to_natural(m + u.log(safe)), -jnp.inf)
        lse_ref[...] = lse.reshape(g, bq, LANES).astype(lse_ref.dtype)
    if max_ref is not None:
        top = jnp.where(total == 0, -jnp.inf, u.to_natural(m))
        max_ref[...] = top.reshape(g, bq, LANES).astype(max_ref.dtype)
