"""`dot_product_attention`: `jax.nn.dot_product_attention`'s signature, layout and
semantics on eqx_flash's kernels, converted at this edge.

jax.nn puts the sequence before the heads (`[batch,] seq, heads, dim`) and aligns
`is_causal` and `local_window_size` top-left (query `i` against key `i`), where eqx_flash
aligns them bottom-right (query `i` against key `i + seq_k - seq_q`). The two agree when
the lengths are equal, so an aligned call with unequal lengths is padded at the end to
equal ones: queries (their rows dropped afterwards) when there are more keys, keys
(which nothing attends) when there are more queries. Its sequence lengths only mask (they
do not move the diagonal), so they become segment ids, not `q_lengths`/`kv_lengths`
(which would re-align causal on the valid lengths).
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike

from .._api.binder import is_concrete
from .._api.flash import flash_attention
from .._core.types import Flag, KernelsName, OptionalReal

# Segment ids: valid tokens share 0; a padded query's id and a padded key's id differ
# from it and from each other, so padding attends nothing and is attended by nothing.
_VALID, _PADDED_QUERY, _PADDED_KEY = 0, -1, -2

_IMPLEMENTATIONS = (None, "eqx_flash", "xla", "cudnn")


def dot_product_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    scale: OptionalReal | Array = None,
    is_causal: Flag = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Any = None,
    return_residual: Flag = False,
    kernels: KernelsName = None,
) -> Array | tuple[Array, Array]:
    """A drop-in replacement for `jax.nn.dot_product_attention`: the same arguments,
    layout, broadcasting and return values, computed by eqx_flash's blockwise kernels
    (memory linear in the sequence, exact gradients).

    **Arguments** (as in `jax.nn.dot_product_attention`):

    - `query` `(B, T, N, H)` or unbatched `(T, N, H)`; `key`, `value` `(B, S, K, H)` or
        `(S, K, H)`, `K` dividing `N` (grouped-query attention). One dtype for all three.
    - `bias`: added to the logits, broadcastable to `(B, N, T, S)` (or `(N, T, S)`).
    - `mask`: bool, broadcastable to `(B, N, T, S)` (or `(N, T, S)`); True attends.
    - `scale`: logit scale, default `1 / sqrt(H)`; a traced one (a learned temperature
        under `jit`) scales the queries, and its gradient flows.
    - `is_causal`: query `i` attends keys `j <= i`, aligned **top-left** as in jax.nn
        (eqx_flash's own `causal` aligns bottom-right; they agree when `T == S`).
    - `query_seq_lengths`, `key_value_seq_lengths`: int32 `(B,)`: rows at or past the
        query length output 0, keys at or past the key length are not attended. They
        mask only; the causal diagonal does not move.
    - `local_window_size`: `(left, right)` or `w` for `(w, w)`: query `i` attends keys
        `i - left <= j <= i + right` (top-left, as in jax.nn).
    - `implementation`: `None` or `"eqx_flash"` runs eqx_flash; `"xla"` or `"cudnn"`
        hands the call to `jax.nn.dot_product_attention` unchanged (to compare in one
        place).
    - `return_residual`: also return the log-sum-exp `(B, T, N)` (or `(T, N)`), in the
        inputs' dtype, without gradient, as jax.nn does.
    - `kernels` (eqx_flash's, not jax.nn's): the kernel family, as in `flash_attention`.

    **Returns:** the output, shaped like `query`; with `return_residual`, `(output, lse)`.

    **Differences from jax.nn**, where it does something no caller wants: a query row with
    no key to attend (all masked, but within its length) gives 0 and lse `-inf`; jax.nn
    averages every value there (its masked logits are a large finite negative number) and
    returns that number plus `log(S)` as the lse.
    """
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {_IMPLEMENTATIONS}; got "
                         f"implementation={implementation!r}")
    if implementation in ("xla", "cudnn"):
        if kernels is not None:
            raise ValueError(f"kernels={kernels!r} picks eqx_flash's kernels, but "
                             f"implementation={implementation!r} hands the call to jax.nn")
        handed_over: Any = jax.nn.dot_product_attention  # its overloads need literal flags
        return handed_over(
            query, key, value, bias, mask, scale=scale, is_causal=is_causal,
            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=local_window_size, implementation=implementation,
            return_residual=return_residual)
    if not isinstance(return_residual, bool):
        raise TypeError(f"return_residual must be a bool; got return_residual={return_residual!r}")
    out, lse = attend_in_jax_nn_layout(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, kernels=kernels)
    if not return_residual:
        return out
    return out, jax.lax.stop_gradient(lse.astype(jnp.asarray(key).dtype))


def attend_in_jax_nn_layout(
    query: ArrayLike, key: ArrayLike, value: ArrayLike, bias: ArrayLike | None,
    mask: ArrayLike | None, *, scale: Any = None, is_causal: Any = False,
    query_seq_lengths: ArrayLike | None = None, key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: Any = None, dropout_rate: Any = 0.0, dropout_key: Any = None,
    kernels: Any = None,
) -> tuple[Array, Array]:
    """`(out, lse)` of `dot_product_attention` (which see), plus eqx_flash's dropout on
    the weights (the Flax front end's): the lse in jax.nn's layout and float32."""
    q, k, v = (jnp.asarray(x) for x in (query, key, value))
    if q.ndim not in (3, 4) or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(
            "query, key and value must all be (B, T|S, N|K, H) or all unbatched (T|S, N|K, H); "
            f"got query.shape={q.shape}, key.shape={k.shape}, value.shape={v.shape}")
    unbatched = q.ndim == 3
    if unbatched:
        q, k, v = q[None], k[None], v[None]
    if k.shape[:-1] != v.shape[:-1]:  # (its depth may differ, as Flax allows)
        raise ValueError(f"value must have key's (B, S, K) = {k.shape[:-1]}; got value.shape="
                         f"{v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"query must be (B, T, N, H) with key's B={k.shape[0]} and "
                         f"H={k.shape[-1]}; got query.shape={q.shape}, key.shape={k.shape}")
    if not isinstance(is_causal, bool | np.bool_):
        raise TypeError(f"is_causal must be a bool; got is_causal={is_causal!r}")
    is_causal = bool(is_causal)
    static_scale = scale
    if isinstance(scale, jax.Array) and not is_concrete(scale):
        # A traced scale (a learned temperature) cannot be the kernels' static one: it
        # scales the queries instead (one rounding of q more in low precision).
        if scale.shape != () or not jnp.issubdtype(scale.dtype, jnp.floating):
            raise TypeError(f"scale must be a real scalar; got a traced scale of shape "
                            f"{scale.shape} and dtype {scale.dtype}")
        wide = jnp.promote_types(q.dtype, jnp.float32)
        q, static_scale = (q.astype(wide) * scale.astype(wide)).astype(q.dtype), 1.0
    batch, seq_q, _, _ = q.shape
    seq_k = k.shape[1]
    bias_4d, mask_4d = (None if x is None else _as_4d(name, x)
                        for name, x in (("bias", bias), ("mask", mask)))
    if mask_4d is not None and mask_4d.dtype != jnp.bool_:
        raise TypeError(f"mask must be a bool array (an additive mask goes in bias); got "
                        f"mask.dtype={mask_4d.dtype}")
    window = ((local_window_size, local_window_size) if isinstance(local_window_size, int)
              else None if local_window_size is None
              else (local_window_size[0], local_window_size[1]))

    # Equal lengths, so that the bottom-right diagonal is the top-left one.
    aligned = is_causal or window is not None
    extra_q = seq_k - seq_q if aligned and seq_k > seq_q else 0
    extra_k = seq_q - seq_k if aligned and seq_q > seq_k else 0
    q_ids = kv_ids = None  # segment ids go in pairs: both, or neither when nothing is padded
    if (query_seq_lengths is not None or key_value_seq_lengths is not None or extra_q
            or extra_k):
        q_ids = _segment_ids("query_seq_lengths", query_seq_lengths, batch, seq_q, extra_q,
                             _PADDED_QUERY)
        kv_ids = _segment_ids("key_value_seq_lengths", key_value_seq_lengths, batch, seq_k,
                              extra_k, _PADDED_KEY)
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # (B, heads, seq, H)
    q = _pad(q, 2, extra_q)
    k, v = _pad(k, 2, extra_k), _pad(v, 2, extra_k)
    bias_4d, mask_4d = (None if x is None else _pad(_pad(x, 2, extra_q, True), 3, extra_k, True)
                        for x in (bias_4d, mask_4d))
    out, lse = flash_attention(
        q, k, v, attn_mask=mask_4d, bias=bias_4d, scale=static_scale, causal=is_causal,
        window=window,
        q_segment_ids=q_ids, kv_segment_ids=kv_ids, dropout_rate=dropout_rate,
        key=dropout_key, kernels=kernels,
    )
    out = jnp.swapaxes(out[:, :, :seq_q], 1, 2)  # back to (B, T, N, H)
    lse = jnp.swapaxes(lse[:, :, :seq_q], 1, 2)
    if unbatched:
        out, lse = out[0], lse[0]
    return out, lse


def _as_4d(name: str, x: ArrayLike) -> Array:
    """jax.nn's `bias`/`mask`: up to 4-d, leading axes of 1 added (its `_ensure_4d`; an
    unbatched call's `(N, T, S)` gains the batch axis of one)."""
    x = jnp.asarray(x)
    if x.ndim > 4:
        raise ValueError(f"{name} must have at most 4 axes (B, N, T, S); got {name}.shape="
                         f"{x.shape}")
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _segment_ids(name: str, lengths: ArrayLike | None, batch: int, seq: int, extra: int,
                 padded_id: int) -> Array:
    """Ids `(B, seq + extra)`: `_VALID` below the length (all of `seq` if None),
    `padded_id` from it on and in the `extra` positions added for alignment."""
    valid = jnp.full((batch,), seq, jnp.int32)
    if lengths is not None:
        arr = jnp.asarray(lengths)
        if arr.shape != (batch,) or not jnp.issubdtype(arr.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array of shape ({batch},); got "
                             f"{name}.shape={arr.shape}, {name}.dtype={arr.dtype}")
        valid = jnp.minimum(arr.astype(jnp.int32), seq)
    positions = jnp.arange(seq + extra, dtype=jnp.int32)[None, :]
    return jnp.where(positions < valid[:, None], _VALID, padded_id).astype(jnp.int32)


def _pad(x: Any, axis: int, extra: int, broadcasting: bool = False) -> Any:
    """`x` with `extra` zeros (False) appended along `axis`; for a `broadcasting` array
    (a bias or mask), not where that axis has size 1."""
    if not extra or (broadcasting and x.shape[axis] == 1):
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)
