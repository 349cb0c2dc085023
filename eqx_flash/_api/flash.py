"""Public `flash_attention`: binding, layout, padding and derivative wiring.

The path of one call: `bind` checks every argument and brings the arrays into the
internal layout as one `Operands` bundle (all before tracing); `prepare_kernels` makes
the kernel choice once (`_kernels.dispatch.choose`: the family, block sizes, scale,
split-K, compute dtype) into the `KernelConfig`, traces a `score_mod`/`mask_mod` at
those block sizes and summarises a `mask_mod` per block pair; `_blockwise` (jitted)
splits the heads, cleans rows that never attend, pads to whole blocks and runs the
chosen forward kernel under `with_custom_derivatives` (`_autodiff`), whose tangent is
the tangent kernel and whose transpose, for reverse mode, the backward kernel. The
kernels see only padded arrays in the internal layout (`_kernels.contract`).
"""

import contextlib
import dataclasses
import functools
from typing import Any, cast

import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from .._autodiff.derivatives import with_custom_derivatives
from .._core.checking import checked
from .._core.config import KernelConfig, stat_dtype
from .._core.operands import (
    Operands,
    combine,
    constant_part,
    differentiable_part,
    pad_sequence,
    padded,
    replace,
)
from .._core.shapes import LAYOUT, Shapes, merge_heads, split_heads
from .._core.types import (
    AlibiSlopes,
    Attended,
    Bias,
    BlockSize,
    Flag,
    KernelsName,
    Key,
    KeyMask,
    KeyPositions,
    KeySegmentIds,
    Lengths,
    MaskMod,
    OptionalReal,
    PairMask,
    Query,
    QueryPositions,
    QuerySegmentIds,
    RealNumber,
    ScoreMod,
    Sinks,
    Value,
    WindowLike,
)
from .._kernels.contract import Call
from .._kernels.dispatch import (
    choose,
    coarsens_block_mask,
    forward,
    plans_when_traced,
    reads_block_flags,
)
from .._mods.block_mask import (
    BlockMask,
    KnownSummary,
    block_flags_for,
    coarsened,
    derived_flags,
)
from .._mods.offset_lookup import offset_lookup
from .._mods.position_bias import ALiBi
from .._mods.tracing import block_probe, trace_mods, varying_axes_of
from .._semantics.masking import valid_rows
from .._semantics.softmax import with_sink
from .binder import Bound, bind, bind_array

# The forward kernel the configuration chose (split-K for flash-decoding, else the
# regular one, of the chosen family). Every derivative goes through this rule: forward
# mode runs the tangent kernel, reverse mode its transpose, the backward kernel.
_attention = with_custom_derivatives(forward)


def call_of(bound: Bound, shapes: Shapes | None = None) -> Call:
    """`bound` as the kernel choice sees it (`_kernels.dispatch.choose`), on problem
    `shapes` (default: `bound`'s)."""
    return Call(bound.options, bound.shapes if shapes is None else shapes, bound.q.dtype,
                bound.operands, bound.score_mod, bound.mask_mod,
                None if bound.block_mask is None else (bound.block_mask.block_q,
                                                      bound.block_mask.block_k))


def native_alibi(bound: Bound) -> tuple[Bound, int | None]:
    """`bound` with an `ALiBi` module given as its `score_mod` taken as `alibi_slopes`
    (the same term, `-slopes[head] * |q_idx + offset - kv_idx|`, computed by the kernels
    without a call per block, so every family, the Pallas kernels included, runs it and
    the slopes' gradient is theirs), and the module's `offset` for `KernelConfig
    .alibi_offset`; as it is (and None) where that would not be the same term: with
    `alibi_slopes` given too, with positions (the kernels' ALiBi measures them), or with
    slopes that are not one per query head."""
    module, ops, shapes = bound.score_mod, bound.operands, bound.shapes
    if (type(module) is not ALiBi or ops.alibi_slopes is not None or ops.has_positions
            or getattr(module.slopes, "shape", None) != (shapes.heads,)):
        return bound, None
    slopes = bind_array("per_head", "alibi_slopes", module.slopes, shapes)
    return dataclasses.replace(bound, score_mod=None,
                               operands=replace(ops, alibi_slopes=slopes)), module.offset


def recognised_mods(bound: Bound) -> tuple[Bound, int | None]:
    """`bound` with the score_mods of a known form taken as what they are: an `ALiBi`
    module as the kernels' own ALiBi (`native_alibi`; its offset returned), a lookup by
    the offset `kv_idx - q_idx` as a `RelativeScoreMod` (`_mods.offset_lookup`)."""
    bound, alibi_offset = native_alibi(bound)
    probe = block_probe(bound.shapes.groups, 8, 128, stat_dtype(bound.q.dtype))
    wrapped = offset_lookup(bound.score_mod, probe)
    if wrapped is not None:
        bound = dataclasses.replace(bound, score_mod=wrapped)
    return bound, alibi_offset


def prepare_kernels(bound: Bound) -> tuple[KernelConfig, Operands]:
    """The kernels' configuration for `bound` (the kernel choice, made once:
    `_kernels.dispatch.choose`) and its operands with the modifications' arrays and
    block summary added (`score_mod`/`mask_mod` are traced at the block sizes chosen)."""
    bound, alibi_offset = recognised_mods(bound)
    shapes, ops = bound.shapes, bound.operands
    cfg = choose(call_of(bound), bound.options.kernels)
    if alibi_offset is not None:
        cfg = dataclasses.replace(cfg, alibi_offset=alibi_offset)
    mods, mod_ops = trace_mods(bound.score_mod, bound.mask_mod, shapes.heads, shapes.groups,
                               cfg.block_q, cfg.block_k, stat_dtype(bound.q.dtype),
                               varying_axes_of((bound.q, bound.k, bound.v, ops)))
    ops = combine(ops, mod_ops)
    if bound.block_mask is not None:
        # Checked against the kernels' blocks, or, for a family that reads a summary of
        # smaller blocks coarsened (`covers` and `configure` saw its blocks), its own.
        kernel_blocks = (cfg.block_q, cfg.block_k)
        built = ((bound.block_mask.block_q, bound.block_mask.block_k)
                 if coarsens_block_mask(cfg) else kernel_blocks)
        flags = block_flags_for(bound.block_mask, bound.mask_mod, shapes, *built)
        if built != kernel_blocks:
            flags = coarsened(flags, shapes, *built, *kernel_blocks)
        ops = replace(ops, block_flags=flags)
    elif bound.mask_mod is not None and reads_block_flags(cfg):
        # A family that plans its grid when traced runs only mask_mods of the indices
        # alone (no arrays, none closed over): their summary is evaluated now, known.
        with (jax.ensure_compile_time_eval() if plans_when_traced(cfg)
              else contextlib.nullcontext()):
            ops = replace(ops, block_flags=derived_flags(
                bound.mask_mod, shapes, cfg.block_q, cfg.block_k))
    if plans_when_traced(cfg):
        cfg = dataclasses.replace(cfg, block_summary=KnownSummary.of(ops.block_flags))
    return dataclasses.replace(cfg, mods=mods), ops


def attend(bound: Bound) -> tuple[Array, ...]:
    """`(out, lse)` of a bound call, in the caller's layout, and the max scores after
    them if the call asked (`return_max_scores`). A call with no query rows at all (zero
    heads, or an empty batch) returns the empty results without reaching the kernels
    (`plain_attention` gives the same shapes)."""
    if bound.q.size == 0:
        shapes = bound.shapes
        out = jnp.zeros((*shapes.lead_shape, shapes.seq_q, shapes.dim_v), bound.q.dtype)
        lse = jnp.zeros((*shapes.lead_shape, shapes.seq_q), stat_dtype(bound.q.dtype))
        return (out, lse, lse) if bound.return_max_scores else (out, lse)
    cfg, ops = prepare_kernels(bound)
    return _blockwise(bound.q, bound.k, bound.v, ops, cfg=cfg, shapes=bound.shapes,
                      max_scores=bound.return_max_scores)


@functools.partial(jax.jit, static_argnames=("cfg", "shapes", "max_scores"))
def _blockwise(q, k, v, ops: Operands, *, cfg: KernelConfig, shapes: Shapes,
               max_scores: bool = False):
    dtype = q.dtype
    q, k, v = split_heads(q, k, v, shapes)
    if cfg.split_k:  # only the (few) queries need cleaning (`_kernels.contract`)
        q = valid_rows(q, k, v, ops, cfg.seq_q, cfg.seq_k, keys=False)[0]
    else:
        q, k, v = valid_rows(q, k, v, ops, cfg.seq_q, cfg.seq_k)
    compute = dtype if cfg.compute_dtype is None else cfg.compute_dtype
    seq_q_pad, seq_k_pad = cfg.padded_seq
    q = pad_sequence(q.astype(compute), 3, seq_q_pad)
    k, v = (pad_sequence(x.astype(compute), 2, seq_k_pad) for x in (k, v))
    ops = padded(ops, seq_q_pad, seq_k_pad)
    # `functools.partial(jax.custom_jvp, ...)` hides the return type from type checkers.
    sinks, ops = ops.sinks, replace(ops, sinks=None)
    result = _attention(cfg, q, k, v, differentiable_part(ops), constant_part(ops))
    out, lse, max_score = cast(tuple[Array, Array, Array], result)
    out, lse = with_sink(out[..., : cfg.seq_q, :], lse[..., : cfg.seq_q],
                         None if sinks is None else sinks[..., 0])
    out, lse = merge_heads(out.astype(dtype), lse, shapes)
    if not max_scores:
        return out, lse
    # No gradient flows through the max scores (as FlexAttention's).
    max_score = jax.lax.stop_gradient(max_score[..., : cfg.seq_q])
    return out, lse, max_score.reshape(lse.shape)


@checked(layout=LAYOUT)
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
    q_positions: QueryPositions | None = None,
    kv_positions: KeyPositions | None = None,
    scale: OptionalReal = None,
    softcap: OptionalReal = None,
    block_q: BlockSize = None,
    block_k: BlockSize = None,
    kernels: KernelsName = None,
    dropout_rate: RealNumber = 0.0,
    key: PRNGKeyArray | None = None,
    bias: Bias | None = None,
    alibi_slopes: AlibiSlopes | None = None,
    sinks: Sinks | None = None,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    block_mask: BlockMask | None = None,
    return_max_scores: Flag = False,
) -> Attended:
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
        query attends only to keys with an equal id. Both or neither. Ids and positions
        are int32 in the kernels: a wider integer dtype (int64, uint32) is taken when its
        values are concrete and fit int32, else a `ValueError` names the argument;
        traced under `jax.jit`, where its values cannot be checked, a `TypeError` asks
        for int32.
    - `q_lengths`, `kv_lengths`: integer arrays `(*batch,)` (any leading axis may be 1 or
        missing): the number of valid queries and keys of each batch element, the rest
        being right padding. Keys at or past `kv_lengths` never attend; queries at or past
        `q_lengths` get `out = 0`, `lse = -inf` and zero gradients; `causal` and `window`
        align bottom-right on the valid lengths (`p = i + kv_length - q_length`). Key blocks
        past the lengths are not computed. Padding (and keys the key `mask` hides from every
        query head) may hold NaN or inf: it reaches no output and no gradient. Concrete
        lengths outside `[0, seq]` raise; traced ones (under `jax.jit`) are clamped into
        it, since a runtime check could abort a multi-device program.
    - `q_positions`, `kv_positions`: integer absolute positions `(*batch, [heads,]
        seq_q|seq_k)` of the queries and keys (packed sequences, chunked prefill,
        cross-attention with per-sequence offsets: FlashAttention's varlen, tokamax's
        `q_indices`/`k_indices`). Both or neither. When given, `causal` means
        `kv_pos <= q_pos`, the window is `q_pos - left <= kv_pos <= q_pos + right`, ALiBi
        uses `|q_pos - kv_pos|` (all exact for any int32 positions, near the int32
        limits or further apart than int32 holds), and no bottom-right offset applies
        (positions are absolute; with lengths, the lengths only mark the padding). The
        dtype rule of the segment ids applies. Key blocks that no
        query of a block can see by position are skipped at run time. `score_mod` and
        `mask_mod` keep receiving indices: to use positions there, close over the
        position arrays and index them with `q_idx`/`kv_idx`.
    - `scale`: logit scale, default `1/sqrt(dim)`.
    - `softcap`: if given, logits become `softcap * tanh(logits / softcap)` after scaling.
    - `block_q`, `block_k`: block sizes; default to values tuned for the machine and the
        kernel family.
    - `kernels`: which kernel family runs the call: `None` (default) chooses — the
        Pallas TPU kernels on one TPU where they cover the call, else the pure-JAX
        ones (`eqx_flash.kernel_family` says which and why); `"xla"` the pure-JAX
        kernels (any backend); `"pallas_tpu"` the Pallas kernels (Mosaic on a TPU,
        Pallas' interpreter elsewhere: slow, for tests), a `NotImplementedError`
        naming what they do not cover.
    - `dropout_rate`, `key`: dropout on the attention weights (needs a PRNG `key`).
    - `bias`: additive float bias broadcastable to `(*batch, heads, seq_q, seq_k)`, any
        float dtype; differentiable (its cotangent is reduced over the axes it was
        broadcast along and returned in its own shape and dtype).
    - `alibi_slopes`: `(heads,)` or `(*batch, heads)`: adds `-slope * |i + seq_k - seq_q - j|`
        to the logit of query `i` and key `j` (FlashAttention-2's ALiBi, aligned
        bottom-right like `causal`), computed in the kernel; differentiable.
    - `sinks`: attention sinks (gpt-oss, StreamingLLM), a float array broadcastable to
        `(*batch, heads)`: one logit per head in every row's softmax denominator, so the
        weights are `p_ij = exp(s_ij) / (exp(sink) + sum_j exp(s_ij))` over the final
        scores `s` (the sink is not scaled, soft-capped or masked) and the returned lse is
        `log(exp(sink) + sum_j exp(s_ij))`. A row with nothing to attend gets `out = 0`
        and `lse = sink`. Differentiable (`jax.grad`, `jax.jvp`), its cotangent in its own
        shape and dtype; dropout drops key weights only. The sink is the part `(out = 0,
        lse = sink)` merged into the result by its lse.
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
    - `return_max_scores`: if `True`, also return the largest final score of each row
        over the keys it attends (after scale, bias, ALiBi, `score_mod`, softcap and
        masks; sinks excluded), for QK-clip/MuonClip: `(*batch, heads, seq_q)` in the
        lse's dtype, -inf for a row with nothing to attend. No gradient flows through it
        (as FlexAttention's `AuxRequest(max_scores=True)`); it comes from the forward
        kernel's running max, so it costs nothing extra.

    Order of operations: `s = scale * q.k + bias + alibi`, then `score_mod`, then
    `softcap`, then every mask (`mask`, `attn_mask`, `mask_mod`, causal, window, segment
    ids, lengths); dropout after the softmax. A row that a `mask_mod` empties, or whose
    `score_mod` scores are all -inf, gets `out = 0`, `lse = -inf` and zero gradients.

    **Returns:**

    `(out, lse)`, or `(out, lse, max_scores)` with `return_max_scores`: `out`
    `(*batch, heads, seq_q, dim_v)` in q's dtype and the log-sum-exp
    of the attended logits `(*batch, heads, seq_q)` in float32 (float64 for float64
    inputs). A query with no key to attend gets `out = 0` and `lse = -inf`. Zero heads
    or an empty batch give the empty `out` and `lse` of those shapes; a zero-length
    sequence (`seq_q = 0` or `seq_k = 0`) or head dim raises a `ValueError` naming it.

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
    bound = bind("flash_attention", **locals())  # every argument, checked in one place
    return attend(bound)


@checked(layout=LAYOUT)
def causal_flash_attention(
    q: Query, k: Key, v: Value, mask: KeyMask | None = None, **kwargs: Any
) -> Attended:
    """`flash_attention(q, k, v, mask, causal=True, **kwargs)`."""
    if "causal" in kwargs:
        raise TypeError(
            "causal_flash_attention is always causal: do not pass causal "
            f"(got causal={kwargs['causal']!r})"
        )
    return flash_attention(q, k, v, mask, causal=True, **kwargs)
