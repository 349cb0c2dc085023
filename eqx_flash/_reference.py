"""`plain_attention`: the materialising reference. Obviously correct, never fast.

It builds the whole `(seq_q, seq_k)` logit matrix, so use it on small problems: as the
oracle in tests, and to check other attention implementations against.
"""

import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import PRNGKeyArray, jaxtyped

from ._config import stat_dtype
from ._layout import merge_heads, split_heads
from ._masking import data_mask, dropout_keep, dropout_seed, head_index, positional_mask
from ._types import (
    LSE,
    Key,
    KeyMask,
    KeySegmentIds,
    Output,
    PairMask,
    Query,
    QuerySegmentIds,
    RealNumber,
    Value,
    WindowLike,
)
from ._validation import check_dropout, check_masks, check_qkv, make_config


@jaxtyped(typechecker=beartype)
def plain_attention(
    q: Query,
    k: Key,
    v: Value,
    mask: KeyMask | None = None,
    *,
    attn_mask: PairMask | None = None,
    causal: bool = False,
    window: WindowLike = None,
    q_segment_ids: QuerySegmentIds | None = None,
    kv_segment_ids: KeySegmentIds | None = None,
    scale: RealNumber | None = None,
    softcap: RealNumber | None = None,
    dropout_rate: RealNumber = 0.0,
    key: PRNGKeyArray | None = None,
) -> tuple[Output, LSE]:
    """Reference attention with exactly the semantics of `flash_attention` (which see),
    computed by materialising every logit, in float32 (float64 for float64 inputs)."""
    q, k, v, s = check_qkv(q, k, v)
    masks = check_masks(s, mask, attn_mask, q_segment_ids, kv_segment_ids)
    rate, key = check_dropout(dropout_rate, key)
    cfg = make_config(
        s, causal=causal, window=window, scale=scale, softcap=softcap, block_q=None,
        block_k=None, dropout_rate=rate, default_block_q=s.seq_q, default_block_k=s.seq_k,
    )
    stat = stat_dtype(q.dtype)
    q5, k4, v4 = (x.astype(stat) for x in split_heads(q, k, v, s))
    # Repeat kv heads over their query groups: (b, kv_heads, groups, seq_k, dim).
    k5 = jnp.broadcast_to(k4[:, :, None], (s.batch, s.kv_heads, s.groups, s.seq_k, s.dim))
    v5 = jnp.broadcast_to(v4[:, :, None], (s.batch, s.kv_heads, s.groups, s.seq_k, s.dim_v))

    logits = jnp.einsum("bhgqd,bhgkd->bhgqk", q5, k5) * cfg.scale
    if cfg.softcap is not None:
        logits = cfg.softcap * jnp.tanh(logits / cfg.softcap)

    q_pos = jnp.arange(s.seq_q).reshape(1, 1, 1, -1, 1)
    k_pos = jnp.arange(s.seq_k).reshape(1, 1, 1, 1, -1)
    allowed = positional_mask(q_pos, k_pos, cfg.offset, s.seq_k, cfg.window)
    data = data_mask(masks, 0, 0, s.seq_q, s.seq_k)
    if data is not None:
        allowed = allowed & data
    allowed = jnp.broadcast_to(allowed, logits.shape)

    # Softmax over attended keys only; a row with none gets weights 0 and lse -inf.
    # The double `where` keeps masked entries out of exp, so gradients stay finite.
    logits = jnp.where(allowed, logits, 0.0)
    row_max = jax.lax.stop_gradient(jnp.max(jnp.where(allowed, logits, -jnp.inf), axis=-1))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    unnormalised = jnp.where(allowed, jnp.exp(logits - row_max[..., None]), 0.0)
    total = unnormalised.sum(axis=-1)
    attended = total > 0
    safe_total = jnp.where(attended, total, 1.0)
    weights = unnormalised / safe_total[..., None]
    lse = jnp.where(attended, row_max + jnp.log(safe_total), -jnp.inf)

    if key is not None:
        keep = dropout_keep(
            dropout_seed(key), head_index(s.batch, s.kv_heads, s.groups), q_pos, k_pos, rate
        )
        weights = jnp.where(keep, weights / (1.0 - rate), 0.0)

    out = jnp.einsum("bhgqk,bhgkd->bhgqd", weights, v5).astype(q.dtype)
    return merge_heads(out, lse, s)
