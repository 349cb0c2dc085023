"""Flash-decoding forward: few queries against many keys, the key blocks split into
parallel runs whose partial results are merged by their log-sum-exp.

The regular forward walks a query block's key blocks one after another; with one or a
few queries that is a long chain of tiny products, one core busy. Here the band of each
query block (after the run-time limits: lengths, segment ids) is cut into
`cfg.splits` equal runs of key blocks, `vmap`ped, so every run's products are one
batched product and the work is bound by reading K and V. Each run is the regular
online softmax (`_forward._key_step`); the runs' `(out, lse)` are merged by
`_softmax.merge_all`. Runs follow the valid lengths, so a long, mostly empty cache costs
its valid part. Same inputs and outputs as `_forward.forward`; the backward pass is the
regular `_backward.backward`.
"""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array

from . import _softmax
from ._block import rows, scaled
from ._config import KernelConfig, stat_dtype
from ._forward import _HeadInputs, _key_step
from ._heads import Head, per_head
from ._masking import Masks
from ._schedule import Bands, band_ranges, over_band, run_limits


def decode_forward(
    cfg: KernelConfig, q: Array, k: Array, v: Array, masks: Masks, seed: Array | None
) -> tuple[Array, Array]:
    """`_forward.forward` with each query block's key blocks split into `cfg.splits`
    parallel runs."""
    bands = band_ranges(cfg.seq_q, cfg.seq_k, cfg.block_q, cfg.block_k, cfg.band_window,
                        cfg.offset, by="q")
    kernel = functools.partial(_head, cfg, bands, seed, not masks.is_empty)
    return per_head(kernel, masks, (q, k, v))


def split_limits(lo: Array, hi: Array, splits: int) -> tuple[Array, Array]:
    """`[lo, hi)` per outer block cut into `splits` near-equal runs, `(splits, n_outer)`."""
    s = jnp.arange(splits + 1, dtype=jnp.int32)[:, None]
    ends = lo[None, :] + ((hi - lo)[None, :] * s) // splits
    return ends[:-1], ends[1:]


def _head(
    cfg: KernelConfig, bands: Bands, seed: Array | None, has_data_mask: bool, head: Head,
    arrays: tuple[Array, ...],
) -> tuple[Array, Array]:
    q, k, v = arrays
    groups, seq_q_pad = q.shape[:2]
    inputs = _HeadInputs(cfg, head, seed, has_data_mask, scaled(cfg, q), k, v)
    limits = run_limits(cfg, head.masks, by="q")
    lo, hi = jnp.asarray(bands.lo), jnp.asarray(bands.hi)
    if limits is not None:  # split what is left of the band, so the runs stay balanced
        lo, hi = jnp.maximum(lo, limits[0]), jnp.minimum(hi, limits[1])
        hi = jnp.maximum(hi, lo)
    starts, stops = split_limits(lo, hi, cfg.splits)
    num_q = seq_q_pad // cfg.block_q

    def one_run(start: Array, stop: Array) -> tuple[Array, Array]:
        def query_block(_, i):
            return None, _partial(inputs, bands, (start, stop), i)

        _, (out, lse) = jax.lax.scan(query_block, None, jnp.arange(num_q, dtype=jnp.int32))
        return out, lse  # (num_q, g, bq, dv), (num_q, g, bq)

    outs, lses = jax.vmap(one_run)(starts, stops)
    out, lse = _softmax.merge_all(outs, lses, axis=0)
    out = jnp.moveaxis(out, 0, 1).reshape(groups, seq_q_pad, v.shape[-1])
    lse = jnp.moveaxis(lse, 0, 1).reshape(groups, seq_q_pad)
    return out.astype(q.dtype), lse


def _partial(
    inputs: _HeadInputs, bands: Bands, limits: tuple[Array, Array], i: Array
) -> tuple[Array, Array]:
    """`_forward._query_block` over one run of key blocks, in the statistics dtype (the
    partial results are merged before rounding)."""
    cfg = inputs.cfg
    q_start = i * cfg.block_q
    q_blk = rows(inputs.q, q_start, cfg.block_q, 1)
    groups = q_blk.shape[0]
    init = _softmax.start(q_blk, (groups, cfg.block_q, inputs.v.shape[-1]),
                          stat_dtype(q_blk.dtype))
    step = functools.partial(_key_step, inputs, q_blk, q_start)
    return _softmax.finish(*over_band(bands, i, step, init, limits))
