"""Blockwise forward kernel: online softmax over the scheduled block pairs.

Per kv head (`heads.per_head`), an outer scan over query blocks; each query block's
running statistics (`_semantics.softmax.Running`) live in the carry of an inner loop over
its band of key blocks (`loops.over_band`), so no state is written back to a
full-size array between blocks. Inputs are in the internal layout (`_core.shapes`),
padded to whole blocks. No validation here.

Reading order: `forward` -> `_forward_head` (one kv head) -> `_forward_query_block` (one
query block's loop over key blocks) -> `_forward_tile` (one block pair).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array

from ..._core.config import KernelConfig, stat_dtype
from ..._core.operands import Operands
from ..._semantics import softmax
from ..schedule import Bands, Limits, band_ranges, run_limits
from .heads import Head, per_head
from .loops import over_band
from .tile import (
    attended_values,
    dropout_multiplier,
    logits,
    matmul,
    nonfinite_keys,
    rows,
    scaled,
    score_fn,
    score_terms,
    unscan,
    visit,
)


class _ForwardHead(NamedTuple):
    """What every block step of one kv head reads."""

    cfg: KernelConfig
    head: Head
    q: Array  # (groups, seq_q, dim), already `scaled`
    k: Array  # (seq_k, dim)
    v: Array  # (seq_k, dim_v)
    bad_key: Array  # (seq_k,) bool, `tile.nonfinite_keys` of v


def forward(cfg: KernelConfig, q: Array, k: Array, v: Array, ops: Operands
            ) -> tuple[Array, Array, Array]:
    """Returns `out` `(b, h, g, seq_q_padded, dim_v)` in q's dtype, and `lse` and the
    rows' largest attended scores (`softmax.max_score`) `(b, h, g, seq_q_padded)` in the
    statistics dtype (both -inf for rows with no key). The max costs one row of
    statistics per block and is dropped by XLA when unused."""
    kernel = functools.partial(_forward_head, cfg, band_ranges(cfg, by="q"))
    return per_head(kernel, ops, (q, k, v), parallel=cfg.parallel_heads)


def _forward_head(cfg: KernelConfig, bands: Bands, head: Head, arrays: tuple[Array, ...]
                  ) -> tuple[Array, Array, Array]:
    q, k, v = arrays  # (g, seq_q, d), (seq_k, d), (seq_k, dv)
    inputs = _ForwardHead(cfg, head, scaled(cfg, q), k, v, nonfinite_keys(v))
    limits = run_limits(cfg, head.operands, by="q")

    def query_block(_, i):
        return None, _forward_query_block(inputs, bands, limits, i)

    num_q = q.shape[1] // cfg.block_q
    _, results = jax.lax.scan(query_block, None, jnp.arange(num_q, dtype=jnp.int32))
    out, lse, max_score = (unscan(x) for x in results)
    return out, lse, max_score


def _forward_query_block(
    inputs: _ForwardHead, bands: Bands, limits: Limits | None, i: Array
) -> tuple[Array, Array, Array]:
    """`(out, lse, max_score)` of query block `i`, `(groups, block_q, dim_v)` and
    `(groups, block_q)` twice."""
    cfg = inputs.cfg
    q_blk = rows(inputs.q, i * cfg.block_q, cfg.block_q, 1)
    groups = q_blk.shape[0]
    init = softmax.start(q_blk, (groups, cfg.block_q, inputs.v.shape[-1]),
                         stat_dtype(q_blk.dtype))

    def step(state: softmax.Running, j: Array, positional: bool) -> softmax.Running:
        tile = functools.partial(_forward_tile, inputs, q_blk, i * cfg.block_q, j * cfg.block_k)
        return visit(cfg, inputs.head, i, j, positional, tile, state)

    state = over_band(bands, i, step, init, limits)
    out, lse = softmax.finish(*state)
    return out.astype(inputs.q.dtype), lse, softmax.max_score(state.row_max, state.row_sum)


def _forward_tile(
    inputs: _ForwardHead, q_blk: Array, q_start: Array, k_start: Array, mask: Array | None,
    state: softmax.Running,
) -> softmax.Running:
    """Take key block `k_start` into the running state of the query block `q_blk`."""
    cfg, head = inputs.cfg, inputs.head
    stat = state.acc.dtype
    k_blk = rows(inputs.k, k_start, cfg.block_k, 0)
    v_blk = rows(inputs.v, k_start, cfg.block_k, 0)
    add = score_terms(cfg, head, q_start, k_start, stat)
    mod = score_fn(cfg, head, q_start, k_start)
    s, _ = logits(cfg, q_blk, k_blk, add, mod)
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    p, alpha, row_max, row_sum = softmax.rescale(state, s)
    drop = dropout_multiplier(cfg, head, q_start, k_start, stat)
    p_v = p if drop is None else p * drop
    bad_key = rows(inputs.bad_key, k_start, cfg.block_k, 0)
    v_blk, reaches_nonfinite = attended_values(v_blk, mask, bad_key)
    pv = matmul(p_v.astype(inputs.v.dtype), v_blk, "qk,kd->qd", stat)
    acc = softmax.poison(alpha[..., None] * state.acc + pv, reaches_nonfinite)
    return softmax.Running(acc, row_max, row_sum)
