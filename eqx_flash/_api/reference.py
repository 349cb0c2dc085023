"""`plain_attention`: the materialising reference. Obviously correct, never fast.

It builds the whole `(seq_q, seq_k)` logit matrix, so use it on small problems: as the
oracle in tests, and to check other attention implementations against.
"""

import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray

from .._core.checking import checked
from .._core.config import stat_dtype
from .._core.options import Window
from .._core.shapes import LAYOUT, merge_heads, split_heads
from .._core.types import (
    AlibiSlopes,
    Attended,
    Bias,
    Flag,
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
from .._mods.block_mask import BlockMask, block_flags_for
from .._mods.tracing import block_probe, check_mask_mod, check_score_mod, grid_indices
from .._semantics.dropout import dropout_keep, flat_head_index
from .._semantics.masking import (
    data_mask,
    length_mask,
    length_window,
    lengths_or,
    position_mask,
    positional_mask,
    valid_rows,
)
from .._semantics.score_terms import additive
from .._semantics.softmax import finish, max_score, poison, with_sink
from .binder import bind


@checked(layout=LAYOUT)
def plain_attention(
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
    """Reference attention with exactly the semantics of `flash_attention` (which see,
    also for `bias`, `alibi_slopes`, `sinks`, `score_mod`, `mask_mod`, `block_mask` and
    `return_max_scores`),
    computed by materialising every logit, in float32 (float64 for float64 inputs).

    `score_mod` and `mask_mod` are called once, on the whole grid: the scores are
    `(batch, kv_heads, groups, seq_q, seq_k)` (`batch` flattened, query head
    `kv_head * groups + group`) and the index arrays broadcast against them. A
    `block_mask` is checked against the call's sizes, then not needed."""
    bound = bind("plain_attention", **locals())  # every argument, checked in one place
    options, shapes, ops = bound.options, bound.shapes, bound.operands
    q, k, v = bound.q, bound.k, bound.v
    stat = stat_dtype(q.dtype)
    b, h, g = shapes.batch, shapes.kv_heads, shapes.groups
    q5, k4, v4 = valid_rows(*split_heads(q, k, v, shapes), ops, shapes.seq_q, shapes.seq_k)
    q5, k4, v4 = (x.astype(stat) for x in (q5, k4, v4))
    # Repeat kv heads over their query groups: (b, kv_heads, groups, seq_k, dim).
    k5 = jnp.broadcast_to(k4[:, :, None], (b, h, g, shapes.seq_k, shapes.dim))
    v5 = jnp.broadcast_to(v4[:, :, None], (b, h, g, shapes.seq_k, shapes.dim_v))

    logits = jnp.einsum("bhgqd,bhgkd->bhgqk", q5, k5) * options.scale_for(shapes.dim)
    q_pos = jnp.arange(shapes.seq_q, dtype=jnp.int32).reshape(1, 1, 1, -1, 1)
    k_pos = jnp.arange(shapes.seq_k, dtype=jnp.int32).reshape(1, 1, 1, 1, -1)
    add = additive(ops, q_pos, k_pos, shapes.seq_k - shapes.seq_q, stat)  # the whole grid
    if add is not None:
        logits = logits + add
    grid = grid_indices(b, h, g, shapes.seq_q, shapes.seq_k)
    if score_mod is not None:
        check_score_mod(score_mod, block_probe(g, 2, 3, stat))  # the kernels' checks
        logits = score_mod(logits, *grid)
    if options.softcap is not None:
        logits = options.softcap * jnp.tanh(logits / options.softcap)

    if ops.has_lengths:  # the window aligns on the valid lengths (or on the positions)
        q_len, kv_len = lengths_or(ops, shapes.seq_q, shapes.seq_k)
        allowed = length_mask(q_pos, k_pos, q_len, kv_len, length_window(ops, options.window))
    else:  # with positions the window is theirs (below): here only the key range
        allowed = positional_mask(q_pos, k_pos, shapes.seq_k - shapes.seq_q, shapes.seq_k,
                                  Window() if ops.has_positions else options.window)
    for extra in (position_mask(ops, options.window), data_mask(ops)):
        if extra is not None:
            allowed = allowed & extra
    if block_mask is not None:  # checked as the kernels check it, then not needed
        block_flags_for(block_mask, mask_mod, shapes, block_mask.block_q, block_mask.block_k)
    if mask_mod is not None:
        check_mask_mod(mask_mod, block_probe(g, 2, 3, stat)[1:], (g, 2, 3))
        allowed = allowed & mask_mod(*grid)
    allowed = jnp.broadcast_to(allowed, logits.shape)

    # Softmax over attended keys only. Masked logits are replaced by the row's max before
    # `exp` and their weights by 0, so no -inf or NaN is ever formed (`jax.debug_infs`
    # stays quiet) and gradients stay finite; a row with no key gets 0 and lse -inf.
    floor = jnp.finfo(stat).min
    row_max = jnp.max(jnp.where(allowed, logits, floor), axis=-1, keepdims=True)
    # At least the floor: a row whose attended logits are all -inf (a -inf bias or
    # score_mod) would otherwise form -inf - -inf = NaN, poisoning every gradient.
    row_max = jax.lax.stop_gradient(jnp.maximum(row_max, floor))
    unnormalised = jnp.where(allowed, jnp.exp(jnp.where(allowed, logits, row_max) - row_max), 0.0)
    if ops.dropout_seed is not None:
        rate = options.dropout_rate
        heads = flat_head_index(jnp.arange(b, dtype=jnp.int32)[:, None],
                                jnp.arange(h, dtype=jnp.int32)[None, :], h, g)
        keep = dropout_keep(ops.dropout_seed, heads, q_pos, k_pos, rate)
        weights_v = jnp.where(keep, unnormalised / (1.0 - rate), 0.0)
    else:
        weights_v = unnormalised
    # A non-finite value reaches exactly the rows that attend its key (`finish` makes
    # their output NaN); with a weight of 0 elsewhere, 0 * NaN would reach them all.
    finite_v = jnp.isfinite(v5)
    acc = jnp.einsum("bhgqk,bhgkd->bhgqd", weights_v, jnp.where(finite_v, v5, 0.0))
    reaches = jnp.any(allowed & ~jnp.all(finite_v, axis=-1)[..., None, :], axis=-1)
    acc = poison(acc, reaches)
    row_sum = unnormalised.sum(axis=-1)
    out, lse = finish(acc, row_max[..., 0], row_sum)
    out, lse = with_sink(out, lse, None if ops.sinks is None else ops.sinks[..., 0])
    out, lse = merge_heads(out.astype(q.dtype), lse, shapes)
    if not bound.return_max_scores:
        return out, lse
    # The max over the unclamped attended logits (a row of -inf scores keeps -inf).
    top = jnp.max(jnp.where(allowed, logits, -jnp.inf), axis=-1)
    top = jax.lax.stop_gradient(max_score(top, row_sum))
    return out, lse, top.reshape(lse.shape)
