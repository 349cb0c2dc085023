"""`FlashMultiheadAttention.decode`: attention of new tokens against a `KVCache`, linear
(attend to the valid prefix by length) or rolling (attend to the buffer by absolute
position)."""

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._api.flash import flash_attention
from .._core.options import make_options
from .._mods.tracing import AtPositions
from .cache import KVCache
from .module_call import process, project, static_options


def decode_with_cache(layer: Any, x: Array, cache: KVCache, process_heads: Any
                      ) -> tuple[Array, KVCache]:
    """`layer.decode(x, cache, process_heads=process_heads)` (which see) of a
    `FlashMultiheadAttention` `layer` (not imported here: it imports this module)."""
    expected = (layer.num_kv_heads, layer.qk_size, layer.vo_size)
    got = (cache.k.shape[0], cache.k.shape[2], cache.v.shape[2])
    if got != expected:
        raise ValueError(
            f"cache must have (kv_heads, dim, dim_v) = {expected} for this layer; got "
            f"cache.k.shape={cache.k.shape}, cache.v.shape={cache.v.shape}"
        )
    if x.shape[-1] != layer.query_size:
        raise ValueError(f"x must have shape (n, {layer.query_size}); got x.shape={x.shape}")
    n = x.shape[0]
    if cache.window is not None:
        _check_rolling(layer, cache)
    if n == 0:  # no new tokens: empty out, the cache unchanged
        return jnp.zeros((0, layer.output_size), x.dtype), cache
    with jax.named_scope("eqx_flash.FlashMultiheadAttention.decode"):
        q = project(layer.query_proj, x, layer.num_heads)
        k = project(layer.key_proj, x, layer.num_kv_heads)
        v = project(layer.value_proj, x, layer.num_kv_heads)
        positions = cache.length + jnp.arange(n, dtype=jnp.int32)
        if process_heads is not None:
            q, k, v = process(process_heads, q, k, v, positions)
        q, k, v = (jnp.swapaxes(x_, 0, 1) for x_ in (q, k, v))
        # Attention runs in the cache's dtype: the new k, v are written in it and q is
        # cast to it (a few rows), rather than the whole cache cast up to q's dtype each
        # step; the kernels accumulate in float32 either way. Out returns in q's dtype.
        out_dtype = q.dtype
        q = q.astype(cache.k.dtype)
        k, v = k.astype(cache.k.dtype), v.astype(cache.v.dtype)
        blocks: dict[str, Any] = dict(block_q=layer.block_q, block_k=layer.block_k,
                                      softcap=layer.softcap, sinks=layer.sinks)
        if cache.window is None:
            # Write first, then attend to the valid prefix: causal/window align on it.
            mods = _mods_at(layer, positions[0], None)
            cache = cache.append(k, v)
            heads, _ = flash_attention(q, cache.k, cache.v, kv_lengths=cache.length,
                                       causal=layer.causal, window=layer.window, **blocks,
                                       **mods)
            # A cache run past `max_len` on several devices (see `KVCache.append`).
            heads = jnp.where(cache.length > cache.size, jnp.nan, heads)
        else:  # (a rolling cache: checked above)
            # Attend to the buffer and the new tokens by absolute position (causal and
            # the window measured on them, key blocks out of reach skipped), then write.
            key_pos = jnp.concatenate([cache.positions(), positions])
            written = key_pos >= 0
            # A slot never written holds whatever the buffer was made with (NaN from a
            # donated or uninitialised buffer): masking it is not enough (0 * NaN in
            # p @ v), so its keys and values are zeroed; fused into the concatenation.
            def attended(buffer: Array, new: Array) -> Array:
                both = jnp.concatenate([buffer, new], axis=1)
                return jnp.where(written[None, :, None], both, jnp.zeros((), both.dtype))

            heads, _ = flash_attention(
                q, attended(cache.k, k), attended(cache.v, v), written,
                q_positions=positions, kv_positions=key_pos, causal=layer.causal,
                window=layer.window, **blocks,
                **_mods_at(layer, positions[0], jnp.maximum(key_pos, 0)),
            )
            cache = cache.append(k, v)
        attn = jnp.swapaxes(heads, 0, 1).reshape(n, -1).astype(out_dtype)
        return jax.vmap(layer.output_proj)(attn), cache


def _check_rolling(layer: Any, cache: KVCache) -> None:
    """A `ValueError` unless the layer's window fits a rolling `cache`."""
    window = make_options(**static_options(layer)).window
    if window.right != 0 or window.left is None or window.left >= cache.size:
        raise ValueError(
            f"a rolling cache of {cache.size} entries needs a causal layer whose "
            f"window reaches back at most {cache.size - 1} tokens; got "
            f"causal={layer.causal}, window={layer.window!r}"
        )


def _mods_at(layer: Any, q_offset: Array, kv_positions: Array | None) -> dict[str, Any]:
    """The layer's `score_mod`/`mask_mod` at the tokens' absolute positions
    (`AtPositions`): as `layer(x_all, ...)` would call them for these rows."""
    return {name: None if mod is None else AtPositions(mod, q_offset, kv_positions)
            for name, mod in (("score_mod", layer.score_mod), ("mask_mod", layer.mask_mod))}
