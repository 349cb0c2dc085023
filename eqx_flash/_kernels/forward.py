"""Blockwise forward kernel: online softmax over the scheduled block pairs.

Per kv head (`_heads.per_head`), an outer scan over query blocks; each query block's
running statistics (`_softmax.Running`) live in the carry of an inner loop over its band
of key blocks (`_schedule.over_band`), so no state is written back to a full-size array
between blocks. Inputs are in the internal layout (`_shapes`), padded to whole blocks.
No validation here.

Reading order: `forward` -> `_head` (one kv head) -> `_query_block` (one query block's
loop over key blocks) -> `_key_step` (one block pair).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._core.config import KernelConfig, stat_dtype
from .._kernels.heads import Head, per_head
from .._kernels.schedule import Bands, Limits, band_ranges, over_band, run_limits
from .._kernels.tile import (
    dropout_multiplier,
    logits,
    matmul,
    rows,
    scaled,
    score_fn,
    score_terms,
    visit,
)
from .._mods.tracing import NO_FLEX, FlexArrays
from .._semantics import softmax as _softmax
from .._semantics.masking import Masks
from .._semantics.score_terms import ScoreMods


class _HeadInputs(NamedTuple):
    """What every block step of one kv head reads."""

    cfg: KernelConfig
    head: Head
    seed: Array | None
    has_data_mask: bool
    flex: FlexArrays  # the score_mod's and mask_mod's arrays
    q: Array  # (groups, seq_q, dim), already `scaled`
    k: Array  # (seq_k, dim)
    v: Array  # (seq_k, dim_v)


def forward(
    cfg: KernelConfig, q: Array, k: Array, v: Array, mods: ScoreMods, masks: Masks,
    seed: Array | None,
    flex: FlexArrays = NO_FLEX,
) -> tuple[Array, Array]:
    """Returns `out` `(b, h, g, seq_q_padded, dim_v)` in q's dtype and `lse`
    `(b, h, g, seq_q_padded)` in the statistics dtype (-inf for rows with no key)."""
    bands = band_ranges(cfg.seq_q, cfg.seq_k, cfg.block_q, cfg.block_k, cfg.band_window,
                        cfg.offset, by="q")
    kernel = functools.partial(_head, cfg, bands, seed, not masks.is_empty, flex)
    return per_head(kernel, (masks, mods), (q, k, v))


def _head(
    cfg: KernelConfig, bands: Bands, seed: Array | None, has_data_mask: bool,
    flex: FlexArrays, head: Head, arrays: tuple[Array, ...],
) -> tuple[Array, Array]:
    q, k, v = arrays  # (g, seq_q, d), (seq_k, d), (seq_k, dv)
    groups, seq_q_pad = q.shape[:2]
    inputs = _HeadInputs(cfg, head, seed, has_data_mask, flex, scaled(cfg, q), k, v)
    limits = run_limits(cfg, head.masks, by="q")

    def query_block(_, i):
        return None, _query_block(inputs, bands, limits, i)

    num_q = seq_q_pad // cfg.block_q
    _, (out, lse) = jax.lax.scan(query_block, None, jnp.arange(num_q, dtype=jnp.int32))
    # (num_q, g, bq, ...) -> (g, num_q * bq, ...)
    out = jnp.moveaxis(out, 0, 1).reshape(groups, seq_q_pad, v.shape[-1])
    lse = jnp.moveaxis(lse, 0, 1).reshape(groups, seq_q_pad)
    return out, lse


def _query_block(
    inputs: _HeadInputs, bands: Bands, limits: Limits | None, i: Array
) -> tuple[Array, Array]:
    """`(out, lse)` of query block `i`, `(groups, block_q, dim_v)` and `(groups, block_q)`."""
    cfg = inputs.cfg
    q_start = i * cfg.block_q
    q_blk = rows(inputs.q, q_start, cfg.block_q, 1)
    groups = q_blk.shape[0]
    init = _softmax.start(q_blk, (groups, cfg.block_q, inputs.v.shape[-1]),
                          stat_dtype(q_blk.dtype))
    step = functools.partial(_key_step, inputs, q_blk, i)
    out, lse = _softmax.finish(*over_band(bands, i, step, init, limits))
    return out.astype(inputs.q.dtype), lse


def _key_step(
    inputs: _HeadInputs, q_blk: Array, i: Array, state: _softmax.Running, j: Array,
    positional: bool,
) -> _softmax.Running:
    """Take key block `j` into the running state of query block `i`."""
    cfg = inputs.cfg
    update = functools.partial(_update, inputs, q_blk, i * cfg.block_q, j * cfg.block_k)
    return visit(cfg, inputs.head, inputs.flex, i, j, positional, inputs.has_data_mask,
                 update, state)


def _update(
    inputs: _HeadInputs, q_blk: Array, q_start: Array, k_start: Array, mask: Array | None,
    state: _softmax.Running,
) -> _softmax.Running:
    cfg = inputs.cfg
    stat = state.acc.dtype
    k_blk = rows(inputs.k, k_start, cfg.block_k, 0)
    v_blk = rows(inputs.v, k_start, cfg.block_k, 0)
    add = score_terms(cfg, inputs.head, q_start, k_start, stat)
    mod = score_fn(cfg, inputs.head, inputs.flex, q_start, k_start)
    s, _ = logits(cfg, q_blk, k_blk, add, mod)
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    p, alpha, row_max, row_sum = _softmax.rescale(state, s)
    drop = dropout_multiplier(cfg, inputs.seed, inputs.head, q_start, k_start, stat)
    p_v = p if drop is None else p * drop
    pv = matmul(p_v.astype(inputs.v.dtype), v_blk, "qk,kd->qd", stat)
    return _softmax.Running(alpha[..., None] * state.acc + pv, row_max, row_sum)
