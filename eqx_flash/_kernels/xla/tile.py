"""What the kernels compute on one tile, a (query block, key block) pair: its logits,
which of its pairs attend, and its dropout multiplier.

What an operand means is `_semantics`'s, evaluated on the tile's operand values
(`_core.operands.block`) and positions (`tile_positions`).

A query block is `(groups, block_q, ...)`: the query heads of one kv head folded into the
rows (see `heads`). The backward kernel works on transposed blocks
`(block_k, groups * block_q)`; `transposed` brings any per-block array into that form.
"""

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array

from ..._core.compat import varying_axes
from ..._core.config import KernelConfig, stat_dtype
from ..._core.operands import Operands, block
from ..._mods.tracing import apply_mask_mod, apply_score_mod, mod_indices
from ..._semantics import masking
from ..._semantics.dropout import dropout_keep
from ..._semantics.score_terms import additive, block_indices
from .heads import Head


def rows(x: Array, start: Array, size: int, axis: int) -> Array:
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def folds_scale(dtype: jnp.dtype) -> bool:
    """Whether the scale is folded into q (one pass over q instead of one per logit).

    Only for float32/float64: in bfloat16/float16, `q * scale` would round every query
    and shift the lse by up to one low-precision step, so those scale the float32 logits.
    """
    return jnp.dtype(dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64))


def scaled(cfg: KernelConfig, q: Array) -> Array:
    """q ready for `logits`: multiplied by the scale where `folds_scale` says so."""
    return q * jnp.asarray(cfg.scale, q.dtype) if folds_scale(q.dtype) else q


def matmul(a: Array, b: Array, spec: str, dtype: jnp.dtype) -> Array:
    """One block product with the query groups folded into the rows: `a` is
    `(groups, block_q, x)` and `b` 2-d; one 2-d dot, the fastest form on CPU."""
    groups, rows_ = a.shape[:2]
    out = jnp.einsum(spec, a.reshape(groups * rows_, a.shape[2]), b,
                     preferred_element_type=dtype)
    return out.reshape(groups, rows_, out.shape[-1])


ScoreFn = Callable[[Array], Array]


def logits(
    cfg: KernelConfig, q_blk: Array, k_blk: Array, add: Array | None,
    mod: ScoreFn | None = None,
) -> tuple[Array, Array | None]:
    """Logits `(groups, block_q, block_k)` in the statistics dtype, from queries passed
    through `scaled` (so the scale is applied once, wherever `scaled` put it), plus the
    score terms `add` (`score_terms`), through the `score_mod` `mod`, then soft-capped.

    Returns `(s, tanh)`: the capped logits and, with a softcap, the tanh the backward
    pass needs for the cap's derivative.
    """
    stat = stat_dtype(q_blk.dtype)
    s = matmul(q_blk, k_blk, "qd,kd->qk", stat)
    return _scale_and_cap(cfg, s, q_blk.dtype, add, mod)


def logits_t(
    cfg: KernelConfig, k_blk: Array, q_rows: Array, q_cols: Array, add_t: Array | None,
    mod_t: ScoreFn | None = None,
) -> tuple[Array, Array | None]:
    """`logits` transposed, `(block_k, groups * block_q)`, from a key block `(block_k, d)`
    and the query block as rows `(groups * block_q, d)` and transposed
    `(d, groups * block_q)`; `add_t` is `transposed`, `mod_t` works on this layout."""
    stat = stat_dtype(q_cols.dtype)
    s = matmul_t(k_blk, q_rows, q_cols, stat)
    return _scale_and_cap(cfg, s, q_cols.dtype, add_t, mod_t)


# XLA's CPU dot picks its kernel, and with it the order it sums over `d`, by the shapes of
# the product: `(rows, bk)` and its transpose `(bk, rows)` can round differently. With a
# key block this narrow, the untransposed product is the more accurate one (0.7 against
# 1.6 ulp on average, at `bk = 8`) and it is the one the forward's softmax used.
NARROW_BLOCK_K = 64


def matmul_t(a: Array, b_rows: Array, b_cols: Array, dtype: jnp.dtype) -> Array:
    """`a @ b_cols`, `(block_k, groups * block_q)`, for a key-side block `a` `(block_k, x)`
    and a query-side block given both as rows `(groups * block_q, x)` and as `b_cols`.

    A key block narrower than `NARROW_BLOCK_K` is multiplied as the forward multiplies it,
    `b_rows @ a^T`, and transposed (a barrier stops XLA from folding the transpose back
    into the product): the backward's `exp(s - lse)` then rounds as the forward's softmax
    did, and `dp` as `plain_attention`'s. A narrow block is cheap to transpose.
    """
    if a.shape[0] >= NARROW_BLOCK_K or a.dtype != jnp.dtype(dtype):
        return jnp.matmul(a, b_cols, preferred_element_type=dtype)
    rows = jnp.einsum("qd,kd->qk", b_rows, a, preferred_element_type=dtype)
    return jax.lax.optimization_barrier(rows).T


def _scale_and_cap(
    cfg: KernelConfig, s: Array, dtype: jnp.dtype, add: Array | None, mod: ScoreFn | None
) -> tuple[Array, Array | None]:
    stat = s.dtype
    if not folds_scale(dtype):
        s = s * jnp.asarray(cfg.scale, stat)
    if add is not None:
        s = s + add
    if mod is not None:
        s = mod(s)
    if cfg.softcap is None:
        return s, None
    cap = jnp.asarray(cfg.softcap, stat)
    t = jnp.tanh(s * (1.0 / cap))
    return cap * t, t


def tile_positions(cfg: KernelConfig, q_start: Array, k_start: Array) -> tuple[Array, Array]:
    """Query and key positions of one block, shaped to broadcast against `(g, q, k)`."""
    q_pos = q_start + jnp.arange(cfg.block_q, dtype=jnp.int32).reshape(1, -1, 1)
    k_pos = k_start + jnp.arange(cfg.block_k, dtype=jnp.int32).reshape(1, 1, -1)
    return q_pos, k_pos


def score_terms(
    cfg: KernelConfig, head: Head, q_start: Array, k_start: Array, dtype: jnp.dtype,
    ops: Operands | None = None,
) -> Array | None:
    """The score terms of one block (`_semantics.score_terms`), `(groups|1, block_q|1,
    block_k|1)` (None: none), of `ops` (default: the head's)."""
    ops = head.operands if ops is None else ops
    if not ops.has_score_terms:
        return None
    q_pos, k_pos = tile_positions(cfg, q_start, k_start)
    return additive(tile_operands(cfg, ops, q_start, k_start), q_pos, k_pos, cfg.score_offset,
                    dtype)


def tile_operands(cfg: KernelConfig, ops: Operands, q_start: Array, k_start: Array
                  ) -> Operands:
    """The values of one head's operands `ops` on the tile at `(q_start, k_start)`."""
    return block(ops, q_start, k_start, cfg.block_q, cfg.block_k)


def allowed(
    cfg: KernelConfig, ops: Operands, q_start: Array, k_start: Array, positional: bool
) -> Array | None:
    """Which pairs of the block attend, `(groups|1, block_q|1, block_k)` (None: all):
    `_semantics.masking.allowed` on the tile."""
    q_pos, k_pos = tile_positions(cfg, q_start, k_start)  # unused ones cost nothing once traced
    return masking.allowed(cfg, tile_operands(cfg, ops, q_start, k_start), q_pos, k_pos,
                           positional)


def tile_mod_indices(
    cfg: KernelConfig, head: Head, q_start: Array, k_start: Array
) -> tuple[Array, Array, Array, Array]:
    """`(batch, head, q_idx, kv_idx)` of one block for `score_mod`/`mask_mod`, shaped
    `(g, 1, 1)`, `(g, 1, 1)`, `(1, bq, 1)`, `(1, 1, bk)` (`_mods.tracing.block_probe`)."""
    assert cfg.mods is not None
    q_pos, k_pos = tile_positions(cfg, q_start, k_start)
    q_idx, k_idx = block_indices(tile_operands(cfg, head.operands, q_start, k_start), q_pos,
                                 k_pos)
    return mod_indices(cfg.mods, head.head_ids, q_idx, k_idx)


def score_fn(cfg: KernelConfig, head: Head, q_start: Array, k_start: Array) -> ScoreFn | None:
    """The block's `score_mod` as a function of its logits `(g, bq, bk)` (None: none)."""
    if cfg.mods is None or cfg.mods.score is None:
        return None
    idx = tile_mod_indices(cfg, head, q_start, k_start)
    mods, ops = cfg.mods, head.operands
    return lambda s: apply_score_mod(mods, ops, s, idx)


def visit(
    cfg: KernelConfig, head: Head, qb: Array, kb: Array, masked: bool,
    compute: Callable[[Array | None, Any], Any], carry: Any,
    orient: Callable[[Array | None], Array | None] = lambda m: m,
) -> Any:
    """`compute(mask, carry)` for block pair `(qb, kb)` with its mask (`allowed`, and the
    `mask_mod`'s), put in the kernel's layout by `orient`; skipped when a data mask
    empties it.

    `masked` is `loops.over_band`'s: False for a block that the schedule knows to be
    whole, by position and, with block flags, by the `mask_mod` too (then the `mask_mod`
    is not evaluated). Without block flags (the ring's kernels) the `mask_mod` is
    evaluated on every block, and a block it empties is skipped.
    """
    q_start, k_start = qb * cfg.block_q, kb * cfg.block_k
    ops = head.operands
    has_data_mask = ops.has_data_mask
    base = allowed(cfg, ops, q_start, k_start, masked)

    def without_mod(c):
        mask = orient(base)
        return skip_if_empty(mask, has_data_mask, functools.partial(compute, mask), c)

    if cfg.mods is None or cfg.mods.mask is None:
        return without_mod(carry)
    listed = ops.block_flags is not None  # the schedule skipped empty blocks
    if listed and not masked:
        return without_mod(carry)
    idx = tile_mod_indices(cfg, head, q_start, k_start)
    mod = apply_mask_mod(cfg.mods, ops, idx, (head.head_ids.shape[0], cfg.block_q, cfg.block_k))
    if not listed and cfg.seq_q % cfg.block_q:  # padding rows (discarded) must not keep
        local_q = tile_positions(cfg, q_start, k_start)[0]  # a block the mask_mod empties
        mod = mod & (local_q < cfg.seq_q)
    mask = orient(mod if base is None else base & mod)
    return skip_if_empty(mask, has_data_mask or not listed, functools.partial(compute, mask),
                         carry)


def dropout_multiplier(
    cfg: KernelConfig, head: Head, q_start: Array, k_start: Array, dtype: jnp.dtype,
) -> Array | None:
    """`keep / (1 - rate)` for one block, `(groups, block_q, block_k)` (None without
    dropout)."""
    seed = head.operands.dropout_seed
    if seed is None or cfg.dropout_rate == 0.0:
        return None
    q_pos, k_pos = tile_positions(cfg, q_start, k_start)
    keep = dropout_keep(seed, head.head_ids, q_pos, k_pos, cfg.dropout_rate)
    return jnp.where(keep, jnp.asarray(1.0 / (1.0 - cfg.dropout_rate), dtype),
                     jnp.asarray(0.0, dtype))


def nonfinite_keys(v: Array) -> Array:
    """Bool `(..., seq_k)`: the keys whose value row holds a NaN or an infinity."""
    return ~jnp.all(jnp.isfinite(v), axis=-1)


def attended_values(v_blk: Array, mask: Array | None, bad_key: Array | None = None,
                    lanes: int = 1) -> tuple[Array, Array | None]:
    """The value block for `p @ v` in a block with masked pairs, and which of its rows
    attend a non-finite value (`bad_key`: `nonfinite_keys` of the block, computed here
    if not given), `(groups|1,
    block_q|1)` (None: no mask); with `lanes` (split-K: the block is `lanes` blocks side
    by side), `(lanes, groups|1, block_q|1)`.

    A masked pair has weight 0, but `0 * NaN` is NaN, and the product would carry a NaN
    (or inf) value to every row of the block, the ones that do not attend it included.
    So non-finite value rows are zeroed for the product and the rows that do attend one
    are marked (`softmax.poison`): the NaN reaches exactly the rows that attend it. In a
    block without masked pairs every row attends every key, and the product itself
    carries it. A block of finite values (the usual case) skips all of it."""
    if mask is None:
        return v_blk, None
    lead = (1,) * (mask.ndim - 1)
    if mask.shape[:-1] == lead:  # one row pattern (a decoding query): the keys it sees
        seen = mask.reshape(-1, 1)  # are exactly the attended ones, and no row is spared
        return jnp.where(seen, v_blk, jnp.zeros((), v_blk.dtype)), None
    if bad_key is None:
        bad_key = nonfinite_keys(v_blk)
    rows_shape = mask.shape[:-1] if lanes == 1 else (lanes, *mask.shape[:-1])

    def clean(v_blk: Array) -> tuple[Array, Array]:
        if lanes == 1:
            reaches = jnp.any(mask & bad_key.reshape(*lead, -1), axis=-1)
        else:
            by_lane = (mask.reshape(*mask.shape[:-1], lanes, -1)
                       & bad_key.reshape(*lead, lanes, -1))
            reaches = jnp.moveaxis(jnp.any(by_lane, axis=-1), -1, 0)
        return jnp.where(bad_key[:, None], jnp.zeros((), v_blk.dtype), v_blk), reaches

    def as_is(v_blk: Array) -> tuple[Array, Array]:
        # Built from the mask and bad_key, so that under shard_map it varies as `clean`'s.
        none = jnp.zeros_like(mask[..., 0]) & bad_key[0]
        return v_blk, jnp.broadcast_to(none, rows_shape)

    if lanes > 1:  # flash-decoding reads each round once, in place: a cond would copy it
        return clean(v_blk)
    if varying_axes(mask) or varying_axes(v_blk):
        # Under `shard_map(check_vma=True)` on several devices, a cond on a varying
        # predicate fails to type-check (jax 0.10: "pvary is a invariant->variant
        # collective"): always clean there.
        return clean(v_blk)
    return jax.lax.cond(jnp.any(bad_key), clean, as_is, v_blk)


def transposed(x: Array | None, groups: int, block_q: int) -> Array | None:
    """A per-block array `(groups|1, block_q|1, block_k|1)` in the layout of the
    transposed logits, `(block_k|1, groups * block_q|1)`, broadcasting where it did."""
    if x is None:
        return None
    x = jnp.moveaxis(x, -1, 0)  # (block_k|1, groups|1, block_q|1)
    if x.shape[1:] == (1, 1):
        return x.reshape(x.shape[0], 1)
    x = jnp.broadcast_to(x, (x.shape[0], groups, block_q))
    return x.reshape(x.shape[0], groups * block_q)


def skip_if_empty(
    mask: Array | None, has_data_mask: bool, compute: Callable[[Any], Any], carry: Any
) -> Any:
    """`compute(carry)`, unless the data masks empty the block (then `carry` unchanged).

    Causal and window emptiness is handled statically by the schedule; this catches
    blocks emptied by padding masks and segment ids at run time.
    """
    if mask is None or not has_data_mask:
        return compute(carry)
    nonempty = jnp.any(mask)
    if varying_axes(nonempty):
        # Under `shard_map(check_vma=True)` on several devices (where heads are vmapped),
        # batching a cond on a varying predicate fails to type-check (jax 0.10: "lt
        # requires varying manual axes to match"). A batched cond computes both branches
        # and selects anyway: do that directly.
        new = compute(carry)
        return jax.tree.map(lambda n, c: jnp.where(nonempty, n, c), new, carry)
    return jax.lax.cond(nonempty, compute, lambda c: c, carry)


def unscan(x: Array) -> Array:
    """Per-query-block results stacked by a scan over query blocks, `(num_q, groups,
    block_q, ...)`, back as rows `(groups, num_q * block_q, ...)`."""
    num, groups, block = x.shape[:3]
    return jnp.moveaxis(x, 0, 1).reshape(groups, num * block, *x.shape[3:])
