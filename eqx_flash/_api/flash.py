"""Public `flash_attention`: validation, layout, padding and derivative wiring.

The path of one call: `make_options` checks the static options and `check_qkv` /
`check_masks` the arrays (all before tracing); `kernel_config` resolves block sizes and
scale; `_blockwise` (jitted) brings q, k, v and masks into the internal layout and pads
them to whole blocks; `_attention_ad` runs `_forward.forward` under a `custom_jvp`
(`_tangent.with_forward_mode`) whose tangent kernel transposes into the pure
`_backward.backward` for reverse mode.
The kernels see only padded arrays in the internal layout; this module is the only place
that knows about the public shapes.
"""

import dataclasses
import functools
from typing import Any, cast

import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, PRNGKeyArray, jaxtyped

from .._api.binder import (
    check_dropout_key,
    check_lengths,
    check_masks,
    check_qkv,
    check_score_mods,
)
from .._autodiff.derivatives import with_forward_mode
from .._core.config import KernelConfig, decode_config, kernel_config, kernel_dtype, stat_dtype
from .._core.options import make_options
from .._core.shapes import Shapes, merge_heads, split_heads
from .._core.types import (
    LSE,
    AlibiSlopes,
    Bias,
    BlockSize,
    Flag,
    Key,
    KeyMask,
    KeySegmentIds,
    Lengths,
    MaskMod,
    OptionalReal,
    Output,
    PairMask,
    Query,
    QuerySegmentIds,
    RealNumber,
    ScoreMod,
    Value,
    WindowLike,
)
from .._kernels.forward import forward
from .._kernels.split_k import decode_forward, reads_raw_cache
from .._mods.block_mask import BlockMask, block_flags_for, derived_flags
from .._mods.tracing import NO_FLEX, FlexArrays
from .._mods.tracing import prepare as prepare_mods
from .._semantics.masking import Masks, dropout_seed, valid_rows
from .._semantics.score_terms import ScoreMods


def _forward(cfg: KernelConfig, q, k, v, mods: ScoreMods, masks: Masks, seed,
             flex: FlexArrays = NO_FLEX):
    """The forward kernel for `cfg`: flash-decoding when `cfg.splits > 1`
    (`_config.decode_splits`) and there are no score terms, else the regular one."""
    if reads_raw_cache(cfg, not mods.is_empty):
        return decode_forward(cfg, q, k, v, masks, seed)
    return forward(cfg, q, k, v, mods, masks, seed, flex)


# `score` is the score_mod's floating arrays (differentiable); `flex` its other arrays and
# the mask_mod's, with `flex.score` left None.
def _attention(cfg: KernelConfig, q, k, v, mods: ScoreMods, score, masks: Masks,
               flex: FlexArrays, seed):
    return _forward(cfg, q, k, v, mods, masks, seed, flex._replace(score=score))


# Every derivative goes through this custom_jvp (`_tangent`): its tangent is the tangent
# kernel, and its transpose (reverse mode) the backward kernel, `_backward.backward`.
_attention_ad = with_forward_mode(_attention)


def _pad_axis(x: Array | None, axis: int, size: int) -> Array | None:
    if x is None or x.shape[axis] in (1, size):
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


@functools.partial(jax.jit, static_argnames=("cfg", "shapes"))
def _blockwise(
    q, k, v, mods: ScoreMods, masks: Masks, seed, score, flex: FlexArrays, *,
    cfg: KernelConfig, shapes: Shapes,
):
    dtype = q.dtype
    compute = kernel_dtype(dtype)
    q, k, v = split_heads(q, k, v, shapes)
    if reads_raw_cache(cfg, not mods.is_empty):  # only the (few) queries need cleaning
        q = valid_rows(q, k, v, masks, cfg.seq_q, cfg.seq_k, keys=False)[0]
    else:
        q, k, v = valid_rows(q, k, v, masks, cfg.seq_q, cfg.seq_k)
    q, k, v = (x.astype(compute) for x in (q, k, v))
    seq_q_pad = -(-cfg.seq_q // cfg.block_q) * cfg.block_q
    seq_k_pad = -(-cfg.seq_k // cfg.block_k) * cfg.block_k
    q = _pad_axis(q, 3, seq_q_pad)
    k, v = _pad_axis(k, 2, seq_k_pad), _pad_axis(v, 2, seq_k_pad)
    flags = masks.block_flags  # per block already
    masks, mods = jax.tree.map(
        lambda m: _pad_axis(_pad_axis(m, -2, seq_q_pad), -1, seq_k_pad),
        (masks._replace(block_flags=None), mods),
    )
    masks = masks._replace(block_flags=flags)
    # `functools.partial(jax.custom_jvp, ...)` hides the return type from type checkers.
    result = _attention_ad(cfg, q, k, v, mods, score, masks, flex, seed)
    out, lse = cast(tuple[Array, Array], result)
    return merge_heads(out[..., : cfg.seq_q, :].astype(dtype), lse[..., : cfg.seq_q], shapes)


@jaxtyped(typechecker=beartype)
def flash_attention(
    q: Query,
    k: Key,
    v: Value,
    mask: KeyMask | None = None,
    *,
    attn_mask: PairMask | None = None,
    causal: Flag = False,
    window: WindowLike = None,
    q_segment_ids: QuerySegmentIds | None = None,
    kv_segment_ids: KeySegmentIds | None = None,
    q_lengths: Lengths | None = None,
    kv_lengths: Lengths | None = None,
    scale: OptionalReal = None,
    softcap: OptionalReal = None,
    block_q: BlockSize = None,
    block_k: BlockSize = None,
    dropout_rate: RealNumber = 0.0,
    key: PRNGKeyArray | None = None,
    bias: Bias | None = None,
    alibi_slopes: AlibiSlopes | None = None,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    block_mask: BlockMask | None = None,
) -> tuple[Output, LSE]:
    """Exact attention in blocks, with memory linear in the sequence length.

    **Arguments:**

    - `q`: queries `(*batch, heads, seq_q, dim)`; any number of leading axes, none too.
    - `k`: keys `(*batch, kv_heads, seq_k, dim)`; `kv_heads` divides `heads` (GQA/MQA).
    - `v`: values `(*batch, kv_heads, seq_k, dim_v)`.
    - `mask`: key-padding mask `(*batch, [heads,] seq_k)`, bool or integer (non-zero
        attends); the heads axis may be left out, seed style.
    - `attn_mask`: dense bool mask broadcastable to `(*batch, heads, seq_q, seq_k)`.
    - `causal`: query `i` attends to keys `j <= i + seq_k - seq_q` (bottom-right aligned).
    - `window`: `(left, right)` or `w` for `(w, w)`: query `i` sees keys
        `p - left <= j <= p + right` with `p = i + seq_k - seq_q`; `None` is unbounded.
    - `q_segment_ids`, `kv_segment_ids`: integer ids `(*batch, [heads,] seq_q|seq_k)`; a
        query attends only to keys with an equal id. Both or neither.
    - `q_lengths`, `kv_lengths`: integer arrays `(*batch,)` (any leading axis may be 1 or
        missing): the number of valid queries and keys of each batch element, the rest
        being right padding. Keys at or past `kv_lengths` never attend; queries at or past
        `q_lengths` get `out = 0`, `lse = -inf` and zero gradients; `causal` and `window`
        align bottom-right on the valid lengths (`p = i + kv_length - q_length`). Key blocks
        past the lengths are not computed. Padding (and keys the key `mask` hides from every
        query head) may hold NaN or inf: it reaches no output and no gradient.
    - `scale`: logit scale, default `1/sqrt(dim)`.
    - `softcap`: if given, logits become `softcap * tanh(logits / softcap)` after scaling.
    - `block_q`, `block_k`: block sizes; default to values tuned for CPU.
    - `dropout_rate`, `key`: dropout on the attention weights (needs a PRNG `key`).
    - `bias`: additive float bias broadcastable to `(*batch, heads, seq_q, seq_k)`, any
        float dtype; differentiable (its cotangent is reduced over the axes it was
        broadcast along and returned in its own shape and dtype).
    - `alibi_slopes`: `(heads,)` or `(*batch, heads)`: adds `-slope * |i + seq_k - seq_q
        - j|` to the logit of query `i` and key `j` (FlashAttention-2's ALiBi, aligned
        bottom-right like `causal`), computed in the kernel; differentiable.
    - `score_mod`: `score_mod(score, batch, head, q_idx, kv_idx) -> score`, elementwise
        (FlexAttention's): `batch` is the flat row-major index over q's leading batch
        axes, `head` the query head, `q_idx`/`kv_idx` the positions in q and k. The
        kernels call it on one block of float32 (float64) scores at a time, with int32
        index arrays that broadcast against it; it must keep the block's shape and dtype.
        A plain function, a closure over arrays, or a PyTree such as an `eqx.Module`
        (`eqx_flash.ALiBi`, `eqx_flash.RelativePositionBias`): gradients flow to q, k, v
        through its derivative, and to its floating arrays (leaves and closed-over
        traced arrays), accumulated block by block.
    - `mask_mod`: `mask_mod(batch, head, q_idx, kv_idx) -> bool`, elementwise, True
        attends; ANDed with every other mask. Blocks it empties are never computed, and
        blocks it fills skip evaluating it: without a `block_mask`, the call summarises
        it per block pair first (one evaluation over the grid, block by block, memory
        O(number of blocks)), over the batch and head axes only if it depends on them.
    - `block_mask`: `eqx_flash.make_block_mask(mask_mod, ...)` for this call's sizes and
        block sizes (else `ValueError`), given with the same `mask_mod`: that summary,
        built once and reused across calls.

    Order of operations: `s = scale * q.k + bias + alibi`, then `score_mod`, then
    `softcap`, then every mask (`mask`, `attn_mask`, `mask_mod`, causal, window, segment
    ids, lengths); dropout after the softmax. A row that a `mask_mod` empties, or whose
    `score_mod` scores are all -inf, gets `out = 0`, `lse = -inf` and zero gradients.

    **Returns:**

    `(out, lse)`: `out` `(*batch, heads, seq_q, dim_v)` in q's dtype and the log-sum-exp
    of the attended logits `(*batch, heads, seq_q)` in float32 (float64 for float64
    inputs). A query with no key to attend gets `out = 0` and `lse = -inf`.

    **Raises:**

    `TypeError` or `ValueError` naming the offending argument, at call time (while
    tracing under `jax.jit`): the axis names above are checked across arguments by
    jaxtyping and beartype, and the rest (dtypes, broadcasting, head grouping, scalar
    ranges) by explicit checks that also run when jaxtyping is switched off. The
    options (`causal` to `dropout_rate`) raise `TypeError` for a value of the wrong
    type and `ValueError` for one out of range, with the same message from every
    entry point.
    JAX and NumPy arrays are accepted.
    """
    options = make_options(
        causal=causal, window=window, scale=scale, softcap=softcap, block_q=block_q,
        block_k=block_k, dropout_rate=dropout_rate,
    )
    q, k, v, shapes = check_qkv(q, k, v)
    masks = check_masks(shapes, mask, attn_mask, q_segment_ids, kv_segment_ids)
    mods = check_score_mods(shapes, bias, alibi_slopes)
    masks = check_lengths(shapes, masks, q_lengths, kv_lengths)
    key = check_dropout_key(options.dropout_rate, key)
    cfg = kernel_config(options, shapes)
    cfg = dataclasses.replace(cfg, lengths=masks.has_lengths)
    flex_cfg, flex = prepare_mods(score_mod, mask_mod, shapes.heads, shapes.groups,
                                  cfg.block_q, cfg.block_k, stat_dtype(q.dtype))
    if block_mask is not None:
        masks = masks._replace(block_flags=block_flags_for(
            block_mask, mask_mod, shapes, cfg.block_q, cfg.block_k))
    elif mask_mod is not None:
        masks = masks._replace(block_flags=derived_flags(
            mask_mod, shapes, cfg.block_q, cfg.block_k))
    if flex_cfg is None:
        cfg = decode_config(cfg)
    else:  # the regular kernels, at the block sizes the modifications were traced at
        cfg = dataclasses.replace(cfg, flex=flex_cfg)
    seed = None if key is None else dropout_seed(key)
    return _blockwise(q, k, v, mods, masks, seed, flex.score, flex._replace(score=None),
                      cfg=cfg, shapes=shapes)


@jaxtyped(typechecker=beartype)
def causal_flash_attention(
    q: Query, k: Key, v: Value, mask: KeyMask | None = None, **kwargs: Any
) -> tuple[Output, LSE]:
    """`flash_attention(q, k, v, mask, causal=True, **kwargs)`."""
    if "causal" in kwargs:
        raise TypeError(
            "causal_flash_attention is always causal: do not pass causal "
            f"(got causal={kwargs['causal']!r})"
        )
    return flash_attention(q, k, v, mask, causal=True, **kwargs)
