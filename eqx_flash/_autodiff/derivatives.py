"""Forward-mode AD: a blockwise tangent kernel, and the `custom_jvp` wiring that keeps
the hand-written backward for reverse mode.

## The kernel

`tangent` computes `(out, lse, d_out, d_lse)` for tangents `(dq, dk, dv)` in one pass over
the forward's band schedule (`_schedule.band_ranges`, `_block.over_band`), with online
softmax, so nothing of size seq_q x seq_k is stored. Per query row, with `P = softmax(S)`
over the attended keys, `S` the logits as the forward forms them and `M` the dropout
multiplier (`keep / (1 - rate)`, or 1):

    out    = (P * M) V                                  lse = log sum exp S
    dS     = scale (dQ K^T + Q dK^T) + dbias - dslopes |i + offset - j|
             [then through the score_mod's jvp, and times 1 - tanh^2 with a softcap]
    d_lse  = rowsum(P * dS)                             (dropout does not touch lse)
    d_out  = (P * M) dV + (P * M * dS) V - d_lse * out

(`dP = P * (dS - d_lse)` and `out` carries `M`, hence the last term.) The kernel
accumulates `(P*M) V`, `(P*M) dV + (P*M*dS) V`, `rowsum(P*dS)` and `rowsum(P)` from
unnormalised weights `exp(S - running_max)`, rescaled together when the max moves, and
divides once at the end. `dS` is one matmul, `[q, dq] [dk, k]^T`, and `(P*M) [V, dV]`
another: four block products per step against the forward's two. A row with no key
gets `out = 0`, `lse = -inf` and zero tangents. The score terms (`_scores.additive`) are
linear, so their tangent is the same terms of the tangents `head.d_mods`; a score_mod's
is `jax.jvp` of it on the block, along `dS` and the tangents of its arrays. Tangents
that are zero are not materialised: their products are skipped (`_inputs`).

`tangent_given_stats` is the variant the JVP rule runs: the rule has the forward's `out`
and `lse` already (it computes the primal with the forward kernel, see below), so the
weights `P = exp(S - lse)` come out normalised, nothing is rescaled and
`(P*M) V` is not recomputed: per block, `S`, `dS` (one product of twice the depth),
`(P*M) dV` and `(P*M*dS) V`. A jvp therefore costs a forward plus about 2.5 forwards
(measured: `benchmarks/jvp_results.md`). The one-pass kernel would save the separate
forward, but only where no transform needs the primal on its own (plain `jax.jvp`); the
rule cannot tell that case apart reliably (`vmap` and `checkpoint` hide the
linearisation), so it always takes the robust route.

## The wiring (`with_forward_mode`)

JAX lets a function have a custom VJP or a custom JVP, not both. The attention (the
forward kernel) is a `jax.custom_jvp` (symbolic zeros on), and its JVP rule returns

- the primal by calling the `custom_jvp` function itself (so any outer transform re-enters
  this rule), and
- the tangent through `_linear_p`, a primitive that does what
  `jax.custom_derivatives.linear_call(tangent_fn, backward_fn, residuals, tangents)` does
  (plus the batching rule and zero handling linear_call lacks): `tangent_fn` is
  `tangent_given_stats` (linear in the tangents), and its transpose `backward_fn` is
  today's hand-written backward kernel. So `jax.grad`, which
  linearises through this rule and transposes the linear call, runs exactly the old
  forward and backward kernels. The differentiable inputs are q, k, v, the score terms
  (bias, ALiBi slopes) and the score_mod's floating arrays. Only the non-zero tangents
  enter the linear call (a transpose must see every linear operand undefined), so
  gradients with respect to a subset of them work, and the backward kernel accumulates
  the cotangents of a bias or slopes only when they are among them.

Like `linear_call`, the primitive requires its residuals to carry no tangents (its
transpose is a fixed kernel), so they pass through
`stop_gradient`. That is exact for first-order forward and reverse mode and for the
sCM/MeanFlow pattern (`jax.grad` of a loss on the primal output of a `jax.jvp`, with the
tangent output under `stop_gradient`): there the derivative of the tangent with respect to
the residuals is never used. Where it would be used, it would be silently dropped, so it
is not dropped but *poisoned*: one more residual, `z` (of the differentiable inputs, out
and lse), is zero and keeps its derivative, which is `_unsupported_p`, a primitive that
raises a clear error when it is evaluated, compiled or transposed; the linear
primitive's JVP adds that derivative to its output tangents (forward or transposed).
First-order programs contain no trace of it.
JAX's linearisation removes dead code before transposing, so the poison only fires when a
second-order term actually reaches an output: a loss on the tangent output itself,
forward-over-forward (`jacfwd(jacfwd)`), forward-over-reverse (`hessian`) or
reverse-over-reverse. Those raise; the error says to put the tangent under `stop_gradient` or
differentiate `plain_attention` instead.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import core
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jaxtyping import Array

from .._core.config import KernelConfig, stat_dtype
from .._kernels import tile as _block
from .._kernels.backward import backward, prepare
from .._kernels.heads import Head, per_head
from .._kernels.schedule import band_ranges, over_band, run_limits
from .._kernels.split_k import reads_raw_cache
from .._mods.tracing import NO_FLEX, FlexArrays, apply_score
from .._semantics.masking import Masks, valid_rows
from .._semantics.score_terms import ScoreMods

NO_MODS = ScoreMods()

SECOND_ORDER_MESSAGE = (
    "eqx_flash: this needs a second-order derivative of flash attention (a derivative of "
    "its jvp tangent, or of its gradient, with respect to q, k, v, a bias, ALiBi slopes "
    "or a score_mod's arrays), which is not "
    "supported. First-order jax.jvp/jax.linearize/jax.jacfwd/jax.grad work, and so does "
    "jax.grad of a loss on the primal output of a jax.jvp when the tangent output enters "
    "the loss only through jax.lax.stop_gradient (the sCM/MeanFlow pattern). Wrap the "
    "jvp tangent in jax.lax.stop_gradient, or use eqx_flash.plain_attention (which "
    "materialises the logits) where you need higher-order derivatives."
)


# --- the kernel ---------------------------------------------------------------------------


class _Inputs(NamedTuple):
    """What every block step of one kv head reads. Tangents that are zero are absent."""

    cfg: KernelConfig
    seed: Array | None
    head: Head  # with the score terms' tangents in `head.d_mods`
    flex: FlexArrays  # the score_mod's and mask_mod's arrays
    d_score: Any  # tangents of the score_mod's floating arrays (None: zero)
    has_data: bool
    q: Array  # (g, seq_q, d), `scaled`
    qq: Array | None  # against `kk`: qq kk^T = q dk^T + dq k^T (None: dq = dk = 0)
    k: Array  # (seq_k, d)
    kk: Array | None
    vv: Array  # [v, dv] (seq_k, dim_v [+ dim_v]); v alone when dv = 0
    dim_v: int


def _inputs(cfg, seed, has_data, flex, d_score, head, q, k, v, dq, dk, dv) -> _Inputs:
    """`_Inputs` of one kv head; `dq`, `dk`, `dv` are None where zero, which saves the
    products they would enter (`dq` alone: `dq k^T` at depth d rather than 2d)."""
    q = _block.scaled(cfg, q)
    qq = kk = None
    if dq is not None and dk is not None:
        qq = jnp.concatenate([q, _block.scaled(cfg, dq)], axis=-1)
        kk = jnp.concatenate([dk, k], axis=-1)  # so that [q, dq] [dk, k]^T = q dk^T + dq k^T
    elif dq is not None:
        qq, kk = _block.scaled(cfg, dq), k
    elif dk is not None:
        qq, kk = q, dk
    vv = v if dv is None else jnp.concatenate([v, dv], axis=-1)
    return _Inputs(cfg, seed, head, flex, d_score, has_data, q, qq, k, kk, vv, v.shape[-1])


def _score_mod_jvp(inputs: _Inputs, q_start, k_start, ds: Array | None, found: list):
    """The block's `score_mod` as `_block.logits` applies it, leaving the tangent of its
    output (from the logits' tangent `ds` and the tangents of its arrays) in `found`.
    None without a score_mod."""
    cfg = inputs.cfg
    if cfg.flex is None or cfg.flex.score is None:
        return None
    flex_cfg, flex = cfg.flex, inputs.flex
    idx = _block.flex_indices(cfg, inputs.head, q_start, k_start)

    def mod(s: Array) -> Array:
        def apply(s, arrays):
            return apply_score(flex_cfg, flex._replace(score=arrays), s, idx)

        if ds is None and inputs.d_score is None:
            return apply(s, flex.score)
        d_s = jnp.zeros_like(s) if ds is None else jnp.broadcast_to(ds, s.shape)
        if inputs.d_score is None:
            out, d_out = jax.jvp(lambda s: apply(s, flex.score), (s,), (d_s,))
        else:
            out, d_out = jax.jvp(apply, (s, flex.score), (d_s, inputs.d_score))
        found.append(d_out)
        return out

    return mod


def _logits_and_tangent(inputs: _Inputs, blocks, q_start, k_start):
    """The block's logits `s` exactly as the forward computes them (score terms,
    score_mod, softcap) and their tangent `ds` (None: zero)."""
    q_blk, qq_blk, k_blk, kk_blk, _ = blocks
    cfg, head = inputs.cfg, inputs.head
    stat = stat_dtype(q_blk.dtype)
    ds = None
    if qq_blk is not None:
        ds = _block.matmul(qq_blk, kk_blk, "qd,kd->qk", stat)  # q dk^T + dq k^T
        if not _block.folds_scale(qq_blk.dtype):
            ds = ds * jnp.asarray(cfg.scale, stat)
    # The score terms are linear: their tangent is the same terms of the tangents.
    d_add = _block.score_terms(cfg, head._replace(mods=head.d_mods), q_start, k_start, stat)
    if d_add is not None:
        ds = d_add if ds is None else ds + d_add
    add = _block.score_terms(cfg, head, q_start, k_start, stat)
    found: list = []
    mod = _score_mod_jvp(inputs, q_start, k_start, ds, found)
    s, t = _block.logits(cfg, q_blk, k_blk, add, mod)
    if found:
        ds = found[0]
    if t is not None and ds is not None:
        ds = ds * (1.0 - t * t)
    return s, ds


def _weighted(inputs: _Inputs, p: Array, ds: Array) -> Array:
    """`p * ds`. Where `p = 0`, a score_mod's derivative may leave `ds` non-finite (at
    logits it sent to -inf): those entries are zeroed (elsewhere `ds` is finite)."""
    p_ds = p * ds
    if inputs.cfg.flex is None or inputs.cfg.flex.score is None:
        return p_ds
    return jnp.where(p > 0, p_ds, 0.0)


def _step_update(inputs: _Inputs, blocks, q_start, k_start, mask, carry):
    """One (query block, key block) update of the running sums (dq, dk, dv all given)."""
    vv_blk, dim_v = blocks[4], inputs.dim_v
    acc, acc_t, acc_ds, row_max, row_sum = carry
    stat = acc.dtype
    s, ds = _logits_and_tangent(inputs, blocks, q_start, k_start)
    assert ds is not None and vv_blk.shape[-1] == 2 * dim_v
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    new_max = jnp.maximum(row_max, s.max(axis=-1))
    p = jnp.exp(s - new_max[..., None])
    alpha = jnp.exp(row_max - new_max)
    p_ds = _weighted(inputs, p, ds)
    drop = _block.dropout_multiplier(inputs.cfg, inputs.seed, inputs.head, q_start, k_start,
                                     stat)
    if drop is None:
        p_v, p_ds_v = p, p_ds
    else:
        p_v, p_ds_v = p * drop, p_ds * drop
    both = _block.matmul(p_v.astype(vv_blk.dtype), vv_blk, "qk,kd->qd", stat)  # P[V, dV]
    sv = _block.matmul(p_ds_v.astype(vv_blk.dtype), vv_blk[:, :dim_v], "qk,kd->qd", stat)
    a = alpha[..., None]
    return (
        a * acc + both[..., :dim_v],
        a * acc_t + both[..., dim_v:] + sv,
        alpha * acc_ds + p_ds.sum(axis=-1),
        new_max,
        alpha * row_sum + p.sum(axis=-1),
    )


def _band_step(update_fn, inputs: _Inputs, i, q_blks, carry, j, positional):
    """`over_band` step: key block `j` against query block `i` (`q_blks`: its rows of `q`
    and `qq`), updating the carry with `update_fn` (`_step_update` or
    `_given_stats_update`), masked and skipped as the forward masks and skips it."""
    cfg = inputs.cfg
    k_start = j * cfg.block_k
    k_blk = _block.rows(inputs.k, k_start, cfg.block_k, 0)
    kk_blk = None if inputs.kk is None else _block.rows(inputs.kk, k_start, cfg.block_k, 0)
    vv_blk = _block.rows(inputs.vv, k_start, cfg.block_k, 0)
    update = functools.partial(
        update_fn, inputs, (*q_blks, k_blk, kk_blk, vv_blk), i * cfg.block_q, k_start
    )
    return _block.visit(cfg, inputs.head, inputs.flex, i, j, positional, inputs.has_data,
                        update, carry)


def _query_rows(inputs: _Inputs, i) -> tuple[Array, Array | None]:
    """Query block `i`'s rows of `q` and `qq`."""
    bq = inputs.cfg.block_q
    q_blk = _block.rows(inputs.q, i * bq, bq, 1)
    qq_blk = None if inputs.qq is None else _block.rows(inputs.qq, i * bq, bq, 1)
    return q_blk, qq_blk


def _query_block(inputs: _Inputs, bands, limits, _, i):
    """Outputs `(out, lse, d_out, d_lse)` of query block `i` for one kv head."""
    q_blk, qq_blk = _query_rows(inputs, i)
    groups, bq, dim_v = q_blk.shape[0], inputs.cfg.block_q, inputs.dim_v
    stat = stat_dtype(q_blk.dtype)
    floor = jnp.asarray(jnp.finfo(stat).min, stat)
    # `*_like(q_blk)`: under shard_map the state must vary across devices as q does.
    init = (
        jnp.zeros_like(q_blk, stat, shape=(groups, bq, dim_v)),
        jnp.zeros_like(q_blk, stat, shape=(groups, bq, dim_v)),
        jnp.zeros_like(q_blk, stat, shape=(groups, bq)),
        jnp.full_like(q_blk, floor, stat, shape=(groups, bq)),
        jnp.zeros_like(q_blk, stat, shape=(groups, bq)),
    )
    step = functools.partial(_band_step, _step_update, inputs, i, (q_blk, qq_blk))
    acc, acc_t, acc_ds, row_max, row_sum = over_band(bands, i, step, init, limits)
    attended = row_sum > 0
    safe = jnp.where(attended, row_sum, 1.0)
    out = acc / safe[..., None]
    d_lse = acc_ds / safe
    d_out = acc_t / safe[..., None] - d_lse[..., None] * out
    keep = attended[..., None]
    out = jnp.where(keep, out, 0.0)
    d_out = jnp.where(keep, d_out, 0.0)
    d_lse = jnp.where(attended, d_lse, 0.0)
    lse = jnp.where(attended, row_max + jnp.log(safe), -jnp.inf)
    dtype = inputs.q.dtype
    return None, (out.astype(dtype), lse, d_out.astype(dtype), d_lse)


def _present(has: tuple[bool, ...], arrays) -> list[Array | None]:
    """`arrays` (the present ones of several) put back in place, None for the absent."""
    it = iter(arrays)
    return [next(it) if h else None for h in has]


def _head_kernel(cfg, seed, has_data, bands, flex, d_score, has, head: Head, arrays):
    q, k, v, *tangents = arrays  # (g, seq_q, d), (seq_k, d), (seq_k, dv) and tangents
    groups, seq_q_pad = q.shape[0], q.shape[1]
    inputs = _inputs(cfg, seed, has_data, flex, d_score, head, q, k, v,
                     *_present(has, tangents))
    limits = run_limits(cfg, head.masks, by="q")
    block = functools.partial(_query_block, inputs, bands, limits)
    num_q = seq_q_pad // cfg.block_q
    _, results = jax.lax.scan(block, None, jnp.arange(num_q, dtype=jnp.int32))
    # (num_q, g, bq, ...) -> (g, num_q * bq, ...)
    return tuple(
        jnp.moveaxis(x, 0, 1).reshape(groups, seq_q_pad, *x.shape[3:]) for x in results
    )


# --- the same, given the forward's statistics (what the custom_jvp rule uses) ---------------


def _given_stats_update(inputs: _Inputs, blocks, q_start, k_start, mask, carry):
    """`_step_update` with the row's lse known: the weights come out normalised, so
    nothing is rescaled and `out` (known too) is not accumulated."""
    vv_blk, dim_v = blocks[4], inputs.dim_v
    acc_t, acc_ds, lse = carry
    stat = acc_t.dtype
    s, ds = _logits_and_tangent(inputs, blocks, q_start, k_start)
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    p = jnp.exp(s - lse[..., None])
    drop = _block.dropout_multiplier(inputs.cfg, inputs.seed, inputs.head, q_start, k_start,
                                     stat)
    dtype = vv_blk.dtype
    if vv_blk.shape[-1] > dim_v:  # (P*M) dV
        p_v = p if drop is None else p * drop
        acc_t = acc_t + _block.matmul(p_v.astype(dtype), vv_blk[:, dim_v:], "qk,kd->qd", stat)
    if ds is not None:  # (P*M*dS) V and rowsum(P*dS)
        p_ds = _weighted(inputs, p, ds)
        p_ds_v = p_ds if drop is None else p_ds * drop
        acc_t = acc_t + _block.matmul(p_ds_v.astype(dtype), vv_blk[:, :dim_v], "qk,kd->qd",
                                      stat)
        acc_ds = acc_ds + p_ds.sum(axis=-1)
    return acc_t, acc_ds, lse


def _given_stats_query_block(inputs: _Inputs, bands, limits, _, xs):
    """`(d_out, d_lse)` of one query block, given its `out` and `lse`."""
    i, out_blk, lse_blk = xs  # (g, bq, dv), (g, bq)
    q_blk, qq_blk = _query_rows(inputs, i)
    stat = stat_dtype(q_blk.dtype)
    attended = lse_blk > -jnp.inf
    # Rows with no key: any finite lse gives p = 0 (all their logits are -inf).
    lse_blk = jnp.where(attended, lse_blk, 0.0).astype(stat)
    init = (
        jnp.zeros_like(out_blk, stat),
        jnp.zeros_like(lse_blk, stat),
        lse_blk,
    )
    step = functools.partial(_band_step, _given_stats_update, inputs, i, (q_blk, qq_blk))
    acc_t, d_lse, _ = over_band(bands, i, step, init, limits)
    d_out = acc_t - d_lse[..., None] * out_blk.astype(stat)
    d_out = jnp.where(attended[..., None], d_out, 0.0)
    d_lse = jnp.where(attended, d_lse, 0.0)
    return None, (d_out.astype(inputs.q.dtype), d_lse)


def _given_stats_head_kernel(cfg, seed, has_data, bands, flex, d_score, has, head: Head,
                             arrays):
    q, k, v, out, lse, *tangents = arrays
    groups, seq_q_pad = q.shape[0], q.shape[1]
    dim_v = v.shape[-1]
    bq = cfg.block_q
    num_q = seq_q_pad // bq
    inputs = _inputs(cfg, seed, has_data, flex, d_score, head, q, k, v,
                     *_present(has, tangents))
    limits = run_limits(cfg, head.masks, by="q")
    # (g, seq_q, ...) -> (num_q, g, bq, ...): one slice per query block.
    out_blocks = jnp.moveaxis(out.reshape(groups, num_q, bq, dim_v), 1, 0)
    lse_blocks = jnp.moveaxis(lse.reshape(groups, num_q, bq), 1, 0)
    block = functools.partial(_given_stats_query_block, inputs, bands, limits)
    xs = (jnp.arange(num_q, dtype=jnp.int32), out_blocks, lse_blocks)
    _, results = jax.lax.scan(block, None, xs)
    return tuple(
        jnp.moveaxis(x, 0, 1).reshape(groups, seq_q_pad, *x.shape[3:]) for x in results
    )


def tangent_given_stats(
    cfg: KernelConfig,
    q: Array,
    k: Array,
    v: Array,
    out: Array,
    lse: Array,
    masks: Masks,
    seed: Array | None,
    dq: Array | None,
    dk: Array | None,
    dv: Array | None,
    mods: ScoreMods = NO_MODS,
    d_mods: ScoreMods = NO_MODS,
    flex: FlexArrays = NO_FLEX,
    d_score: Any = None,
) -> tuple[Array, Array]:
    """`(d_out, d_lse)` as `tangent` gives them, from the forward's `out` and `lse`: one
    product fewer per block and no rescaling (the custom_jvp rule has both anyway).
    Tangents that are zero may be None (`d_mods`, `d_score`: None leaves), which skips
    the work they would cost. `flex` holds the score_mod's floating arrays in `score`."""
    bands = band_ranges(cfg.seq_q, cfg.seq_k, cfg.block_q, cfg.block_k, cfg.band_window,
                        cfg.offset, by="q")
    has = tuple(t is not None for t in (dq, dk, dv))
    kernel = functools.partial(_given_stats_head_kernel, cfg, seed, not masks.is_empty, bands,
                               flex, d_score, has)
    tangents = tuple(t for t in (dq, dk, dv) if t is not None)
    return per_head(kernel, (masks, mods, d_mods), (q, k, v, out, lse, *tangents))


def tangent(
    cfg: KernelConfig,
    q: Array,
    k: Array,
    v: Array,
    masks: Masks,
    seed: Array | None,
    dq: Array,
    dk: Array,
    dv: Array,
    mods: ScoreMods = NO_MODS,
    d_mods: ScoreMods = NO_MODS,
) -> tuple[Array, Array, Array, Array]:
    """`(out, lse, d_out, d_lse)`: the forward's outputs and their tangents for input
    tangents `(dq, dk, dv)` (and `d_mods` of the score terms `mods`), all in the internal
    layout and padded like `forward`'s."""
    bands = band_ranges(cfg.seq_q, cfg.seq_k, cfg.block_q, cfg.block_k, cfg.band_window,
                        cfg.offset, by="q")
    kernel = functools.partial(_head_kernel, cfg, seed, not masks.is_empty, bands, NO_FLEX,
                               None, (True, True, True))
    return per_head(kernel, (masks, mods, d_mods), (q, k, v, dq, dk, dv))


# --- the poison for second-order terms ------------------------------------------------------


def _unsupported(*args, dtype):
    del args, dtype
    raise NotImplementedError(SECOND_ORDER_MESSAGE)


_unsupported_p = Primitive("eqx_flash_second_order_unsupported")
_unsupported_p.def_impl(_unsupported)
_unsupported_p.def_abstract_eval(
    lambda *args, dtype: core.ShapedArray((), dtype)
)


def _unsupported_lowering(ctx, *args, dtype):
    del ctx, args, dtype
    raise NotImplementedError(SECOND_ORDER_MESSAGE)


def _unsupported_transpose(ct, *args, dtype):
    del dtype
    if type(ct) is ad.Zero:
        return [None] * len(args)
    raise NotImplementedError(SECOND_ORDER_MESSAGE)


def _unsupported_jvp(primals, tangents, *, dtype):
    out = _unsupported_p.bind(*primals, dtype=dtype)
    nonzero = [t for t in tangents if type(t) is not ad.Zero]
    if not nonzero:
        return out, ad.Zero(core.ShapedArray((), dtype))
    return out, _unsupported_p.bind(*nonzero, dtype=dtype)


def _unsupported_batch(args, dims, *, dtype):
    del dims
    return _unsupported_p.bind(*args, dtype=dtype), None


mlir.register_lowering(_unsupported_p, _unsupported_lowering)
ad.primitive_jvps[_unsupported_p] = _unsupported_jvp
ad.primitive_transposes[_unsupported_p] = _unsupported_transpose
batching.primitive_batchers[_unsupported_p] = _unsupported_batch


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _second_order_guard(dtype, *residuals):
    """Zero, whose derivative with respect to `residuals` is `_unsupported_p`."""
    del residuals
    return jnp.zeros((), dtype)


@functools.partial(_second_order_guard.defjvp, symbolic_zeros=True)
def _second_order_guard_jvp(dtype, primals, tangents):
    nonzero = [t for t in tangents if type(t) is not SymbolicZero]
    zero = jnp.zeros((), dtype)
    if not nonzero:
        return zero, zero
    return zero, _unsupported_p.bind(*nonzero, dtype=jnp.dtype(dtype))


# --- the linear primitive: tangent kernel one way, backward kernel the other -------------
#
# What `jax.custom_derivatives.linear_call` does, plus a batching rule (linear_call has
# none, so `jax.jacfwd`, `jax.hessian` and `vmap` of a gradient would fail) and zero
# handling in its JVP. Operands: the residuals `(q, k, v, out, lse, mods, score, masks, flex,
# seed, z)` flattened (`z`: the second-order guard), then the linear inputs. The
# differentiable inputs are `(q, k, v, mods, score)` (`_diff`): the score terms and the
# score_mod's floating arrays are pytrees, and `which` marks the leaves with a non-zero
# tangent. `transposed=False` maps those tangents to `(d_out, d_lse)` with the tangent
# kernel; `transposed=True` maps cotangents `(d_out, d_lse)` to those of the marked leaves
# with the backward kernel. Each is the other's transpose.


def _diff(residuals) -> tuple[Any, ...]:
    """The differentiable inputs `(q, k, v, mods, score)` among the residuals."""
    q, k, v, _, _, mods, score = residuals[:7]
    return q, k, v, mods, score


def _linear_fn(*args, cfg: KernelConfig, which, res_tree, transposed: bool):
    residuals = jax.tree.unflatten(res_tree, args[: res_tree.num_leaves])
    linear = args[res_tree.num_leaves :]
    q, k, v, out, lse, mods, score, masks, flex, seed, _ = residuals  # last: the guard `z`
    flex = flex._replace(score=score)
    diff_tree = jax.tree.structure(_diff(residuals))
    if transposed:
        d_out, d_lse = linear
        safe_lse, delta = prepare(out, lse, d_out, d_lse)
        # Score terms without a tangent (a constant bias or slopes, a frozen score_mod)
        # get no cotangent accumulation in the kernel.
        wanted = jax.tree.unflatten(diff_tree, which)
        mods_wanted = (bool(wanted[3].bias), bool(wanted[3].slopes))
        grads = backward(cfg, q, k, v, mods, safe_lse, delta, d_out, masks, seed, flex,
                         mods_wanted, score_wanted=any(jax.tree.leaves(wanted[4])))
        return [g for g, w in zip(jax.tree.leaves(grads), which, strict=True) if w]
    # Zero tangents stay None: the kernel skips what they would cost. (The score_mod's
    # arrays are differentiated together, with zeros filled in, or not at all.)
    tangents = _present(which, linear)
    dq, dk, dv, d_mods, _ = jax.tree.unflatten(diff_tree, tangents)
    score_leaves, score_tree = jax.tree.flatten(score)
    d_score_leaves = tangents[len(tangents) - len(score_leaves):]
    d_score = None
    if any(t is not None for t in d_score_leaves):
        d_score = jax.tree.unflatten(score_tree, [
            jnp.zeros_like(x) if t is None else t
            for t, x in zip(d_score_leaves, score_leaves, strict=True)
        ])
    return list(tangent_given_stats(cfg, q, k, v, out, lse, masks, seed, dq, dk, dv, mods,
                                    d_mods, flex, d_score))


_linear_p = Primitive("eqx_flash_attention_linear")
_linear_p.multiple_results = True
_linear_p.def_impl(_linear_fn)
mlir.register_lowering(_linear_p, mlir.lower_fun(_linear_fn, multiple_results=True))


def _linear_abstract_eval(*args, cfg, which, res_tree, transposed):
    del cfg
    residuals = jax.tree.unflatten(res_tree, args[: res_tree.num_leaves])
    # The residuals' own avals: same shapes and dtypes, and under shard_map the same
    # varying axes.
    if transposed:
        return [x for x, w in zip(jax.tree.leaves(_diff(residuals)), which, strict=True) if w]
    return list(residuals[3:5])  # out, lse


_linear_p.def_abstract_eval(_linear_abstract_eval)


def _is_zero(t) -> bool:
    return type(t) is ad.Zero or jnp.dtype(t.dtype) == jax.dtypes.float0


def _linear_jvp(primals, tangents, **params):
    num_res = params["res_tree"].num_leaves
    # The residuals pass through stop_gradient, except the last, `z`: zero, with a
    # derivative that raises wherever it is used (see the module docstring).
    if not all(_is_zero(t) for t in tangents[: num_res - 1]):
        raise NotImplementedError(SECOND_ORDER_MESSAGE)
    out = _linear_p.bind(*primals, **params)
    lin_t = tangents[num_res:]
    z_t = tangents[num_res - 1]
    if all(type(t) is ad.Zero for t in lin_t):
        if _is_zero(z_t):
            return out, [ad.Zero(jax.typeof(x).to_tangent_aval()) for x in out]
        out_t = [jnp.zeros_like(x) for x in out]
    else:
        lin_t = [ad.instantiate_zeros(t) for t in lin_t]
        out_t = _linear_p.bind(*primals[:num_res], *lin_t, **params)
    if not _is_zero(z_t):
        out_t = [t + z_t.astype(t.dtype) for t in out_t]
    return out, out_t


def _linear_transpose(cts, *args, **params):
    num_res = params["res_tree"].num_leaves
    residuals, linear = args[:num_res], args[num_res:]
    assert not any(ad.is_undefined_primal(x) for x in residuals)
    if all(type(ct) is ad.Zero for ct in cts):
        return [None] * len(args)
    out_avals = _linear_abstract_eval(
        *(jax.typeof(x) for x in residuals),
        *(x.aval if ad.is_undefined_primal(x) else jax.typeof(x) for x in linear),
        **params,
    )
    cts = [ad.zeros_like_aval(a) if type(ct) is ad.Zero else ct
           for ct, a in zip(cts, out_avals, strict=True)]
    flipped = dict(params, transposed=not params["transposed"])
    lin_cts = _linear_p.bind(*residuals, *cts, **flipped)
    # A linear operand that is a known value (an instantiated zero) gets no cotangent.
    lin_cts = [ct if ad.is_undefined_primal(x) else None
               for ct, x in zip(lin_cts, linear, strict=True)]
    return [None] * num_res + lin_cts


def _batch_by_map(primitive: Primitive) -> Callable[..., Any]:
    """A batching rule that binds `primitive` once per batch element (`lax.map`), so it
    (and its transpose into the hand-written kernels) survives `vmap`: without one, a
    gradient of a `vmap` (`jax.grad` of a loss over `jax.vmap(model)`) fails to batch."""

    def rule(args, dims, **params):
        mapped = [d is not None for d in dims]
        xs = [jnp.moveaxis(x, d, 0) for x, d in zip(args, dims, strict=True) if d is not None]

        def one(xs_i):
            it = iter(xs_i)
            full = [next(it) if m else x for x, m in zip(args, mapped, strict=True)]
            return primitive.bind(*full, **params)

        outs = jax.lax.map(one, xs)
        return outs, [0] * len(outs)

    return rule


ad.primitive_jvps[_linear_p] = _linear_jvp
ad.primitive_transposes[_linear_p] = _linear_transpose
batching.primitive_batchers[_linear_p] = _batch_by_map(_linear_p)


def _linear(cfg: KernelConfig, which, residuals, nonzero) -> list[Array]:
    flat, res_tree = jax.tree.flatten(residuals)
    return _linear_p.bind(
        *flat, *nonzero, cfg=cfg, which=which, res_tree=res_tree, transposed=False
    )


# --- the wiring ---------------------------------------------------------------------------


def _clean_tangents(tangents, primals, masks) -> tuple[Any, ...]:
    """`valid_rows` applied to the tangents of q, k, v (symbolic zeros stay as they are;
    the primals stand in for them, and their results are dropped)."""
    d_q, d_k, d_v = (p if type(t) is SymbolicZero else t
                     for t, p in zip(tangents, primals, strict=True))
    cleaned = valid_rows(d_q, d_k, d_v, masks, primals[0].shape[3], primals[1].shape[2])
    return tuple(t if type(t) is SymbolicZero else c
                 for t, c in zip(tangents, cleaned, strict=True))


def with_forward_mode(attention: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap `attention(cfg, q, k, v, mods, score, masks, flex, seed) -> (out, lse)`
    (`_flash._attention`: the forward kernel on padded internal-layout arrays, whose
    differentiable inputs are q, k, v, the score terms `mods` and the score_mod's floating
    arrays `score`) so that forward mode works too (module docstring)."""

    @functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
    def wrapped(cfg, q, k, v, mods, score, masks, flex, seed):
        return attention(cfg, q, k, v, mods, score, masks, flex, seed)

    @functools.partial(wrapped.defjvp, symbolic_zeros=True)
    def wrapped_jvp(cfg, primals, tangents):
        q, k, v, mods, score, masks, flex, seed = primals
        if reads_raw_cache(cfg, not mods.is_empty):
            # The decoding kernel left the keys and values uncleaned (`_flash._blockwise`);
            # the derivative kernels need them clean, and their tangents alike.
            q, k, v = valid_rows(q, k, v, masks, q.shape[3], k.shape[2])  # padded sizes
            tangents = (*_clean_tangents(tangents[:3], (q, k, v), masks), *tangents[3:])
        out, lse = wrapped(cfg, q, k, v, mods, score, masks, flex, seed)
        leaves = jax.tree.leaves(tangents[:5], is_leaf=lambda t: type(t) is SymbolicZero)
        which = tuple(type(t) is not SymbolicZero for t in leaves)
        nonzero = tuple(t for t, w in zip(leaves, which, strict=True) if w)
        if not nonzero:  # only masks or seed were perturbed: they get no derivative
            return (out, lse), (jnp.zeros_like(out), jnp.zeros_like(lse))
        residuals = jax.tree.map(jax.lax.stop_gradient,
                                 (q, k, v, out, lse, mods, score, masks, flex, seed))
        # Exactly zero; its derivative with respect to the differentiable inputs, out and
        # lse raises. As the last residual it is the one that keeps its derivative
        # (`_linear_jvp`).
        z = _second_order_guard(lse.dtype, *jax.tree.leaves((q, k, v, mods, score)), out,
                                lse)
        d_out, d_lse = _linear(cfg, which, (*residuals, z), nonzero)
        return (out, lse), (d_out, d_lse)

    return wrapped


# --- reverse mode only (the ring) ---------------------------------------------------------
#
# A `custom_vjp` function has no forward mode, and JAX's error ("can't apply forward-mode
# autodiff (jvp) to a custom_vjp function") does not say which function or what to do.
# `reverse_only` wraps one in a `custom_jvp` whose tangent is `_reverse_only_p`: evaluating
# or compiling it raises `message`, and transposing it runs the function's own backward
# rule, so `jax.grad` is what it was.


def _reverse_only_fail(*args, message, **params):
    del args, params
    raise NotImplementedError(message)


_reverse_only_p = Primitive("eqx_flash_reverse_only")
_reverse_only_p.multiple_results = True
_reverse_only_p.def_impl(_reverse_only_fail)
mlir.register_lowering(
    _reverse_only_p, lambda ctx, *args, **params: _reverse_only_fail(**params)
)


def _reverse_only_abstract_eval(*args, num_in, num_out, message, bwd, res_tree, which):
    del message, bwd, res_tree, which
    return list(args[num_in : num_in + num_out])  # the outputs, after the residuals


def _reverse_only_jvp(primals, tangents, *, message, **params):
    del primals, tangents, params
    raise NotImplementedError(message)


def _reverse_only_transpose(cts, *args, num_in, num_out, message, bwd, res_tree, which):
    del message
    num_res = res_tree.num_leaves
    residuals = jax.tree.unflatten(res_tree, args[:num_res])
    outs = [jax.typeof(x) for x in args[num_in : num_in + len(cts)]]
    cts = [ad.zeros_like_aval(a) if type(ct) is ad.Zero else ct
           for ct, a in zip(cts, outs, strict=True)]
    grads = bwd(residuals, cts)
    chosen = [g for g, w in zip(grads, which, strict=True) if w]
    return [None] * (num_res + num_out) + chosen


_reverse_only_p.def_abstract_eval(_reverse_only_abstract_eval)
ad.primitive_jvps[_reverse_only_p] = _reverse_only_jvp
ad.primitive_transposes[_reverse_only_p] = _reverse_only_transpose
batching.primitive_batchers[_reverse_only_p] = _batch_by_map(_reverse_only_p)


def _unflatten_cts(bwd, static, out_tree, num_diff, wanted, residuals, cts):
    """The cotangents of the differentiable arguments, flattened. `wanted` (None, or the
    differentiable arguments' structure with a bool per leaf: has it a non-zero tangent?)
    goes to a `bwd` that can skip the cotangents nobody asked for."""
    cts = jax.tree.unflatten(out_tree, cts)
    grads = (bwd(static, residuals, cts) if wanted is None else
             bwd(static, residuals, cts, wanted=wanted))[:num_diff]
    return jax.tree.leaves(grads)


def reverse_only(
    attention: Callable[..., Any],
    residuals: Callable[..., Any],
    bwd: Callable[..., Any],
    message: str,
    num_diff: int = 3,
    bwd_skips_unwanted: bool = False,
) -> Callable[..., Any]:
    """Wrap `attention(static, *args) -> (out, lse)` (a `custom_vjp` function with
    `nondiff_argnums=(0,)`; its first `num_diff` arguments are the differentiable ones,
    possibly pytrees) so that `jax.jvp` raises `message` and reverse mode runs
    `bwd(static, residuals(static, args, outputs), cotangents)`, whose first `num_diff`
    results are the cotangents of those arguments. With `bwd_skips_unwanted`, `bwd` also
    gets `wanted=`: which of those arguments' leaves have a non-zero tangent (e.g. ALiBi
    slopes or a bias that are constants need no cotangent, which costs a reduction per
    block)."""

    @functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
    def wrapped(static, *args):
        return attention(static, *args)

    @functools.partial(wrapped.defjvp, symbolic_zeros=True)
    def wrapped_jvp(static, args, tangents):
        outs = wrapped(static, *args)
        tangent_leaves, tangent_tree = jax.tree.flatten(
            tangents[:num_diff], is_leaf=lambda t: type(t) is SymbolicZero
        )
        which = tuple(type(t) is not SymbolicZero for t in tangent_leaves)
        wanted = jax.tree.unflatten(tangent_tree, which) if bwd_skips_unwanted else None
        nonzero = [t for t, w in zip(tangent_leaves, which, strict=True) if w]
        out_leaves, out_tree = jax.tree.flatten(outs)
        # No stop_gradient: a derivative of the gradient differentiates `bwd` itself (the
        # transpose calls it on these residuals), as it would the custom_vjp's.
        res_flat, res_tree = jax.tree.flatten(residuals(static, args, outs))
        # Operands: residuals, then the outputs again (for their avals), then tangents.
        flat = [*res_flat, *(jax.lax.stop_gradient(x) for x in out_leaves), *nonzero]

        if not nonzero:
            return outs, jax.tree.map(jnp.zeros_like, outs)
        d_outs = _reverse_only_p.bind(
            *flat, num_in=len(res_flat), num_out=len(out_leaves), message=message,
            bwd=functools.partial(_unflatten_cts, bwd, static, out_tree, num_diff, wanted),
            res_tree=res_tree, which=which,
        )
        return outs, jax.tree.unflatten(out_tree, d_outs)

    return wrapped
