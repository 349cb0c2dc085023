"""`flax_attention`: an `attention_fn` for Flax's `nnx.MultiHeadAttention` and
`linen.MultiHeadDotProductAttention`, with the signature and semantics of Flax's own
`dot_product_attention` on eqx_flash's kernels.

Flax's layout is jax.nn's (`[batch..., length, heads, depth]`, a mask `[batch..., heads,
q_length, kv_length]`), so this is the jax.nn front end (`jax_nn.attend_in_jax_nn_layout`)
plus Flax's arguments: dtype promotion, dropout (eqx_flash's, in the kernel), any number
of batch axes. Flax itself is never imported: the module is plain JAX.
"""

import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jaxtyping import Array

from .jax_nn import attend_in_jax_nn_layout


def flax_attention(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    broadcast_dropout: bool = True,
    dropout_rng: Any = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    promote_dtype: Callable[..., Any] | None = None,
    is_causal: bool = False,
    kernels: Any = None,
) -> Array:
    """Flax's `dot_product_attention`, as an `attention_fn`:
    `nnx.MultiHeadAttention(..., attention_fn=eqx_flash.flax_attention)` or
    `linen.MultiHeadDotProductAttention(..., attention_fn=eqx_flash.flax_attention)`.

    **Arguments** (as in Flax):

    - `query` `[batch..., q_length, heads, depth]`, `key`, `value` `[batch..., kv_length,
        kv_heads, depth]`; no batch axes, or any number.
    - `bias`, `mask`: broadcastable to `[batch..., heads, q_length, kv_length]` (a mask is
        True, or non-zero, where attending), e.g. `nnx.make_causal_mask`'s.
    - `dropout_rng`, `dropout_rate`, `deterministic`: dropout on the attention weights,
        applied in the kernel. `broadcast_dropout` is accepted, but eqx_flash draws an
        independent mask per batch element, head, query and key (Flax's default shares it
        over the batch axes): the same rate, another pattern.
    - `dtype`, `promote_dtype`: q, k, v are promoted as Flax does (its `promote_dtype`
        when the module passes it, else to `dtype` or their common dtype).
    - `precision`: accepted and ignored (the kernels accumulate in float32).
    - `module`: what Flax passes with `sow_weights=True`; raises `NotImplementedError`,
        since flash attention never forms the weights.
    - `is_causal`: causal, aligned top-left as Flax (through jax.nn) aligns it.
    - `kernels` (eqx_flash's): the kernel family, as in `flash_attention`; bind it with
        `functools.partial(eqx_flash.flax_attention, kernels=...)`.

    **Returns:** `[batch..., q_length, heads, depth]`. A row with nothing to attend gives 0
    (Flax's own function averages the values there).
    """
    del broadcast_dropout, precision
    if module is not None:
        raise NotImplementedError(
            "flax_attention cannot sow attention weights (sow_weights=True passes module=): "
            "flash attention never forms them; call the module with sow_weights=False, or "
            "use Flax's own dot_product_attention where the weights are needed")
    if promote_dtype is not None:
        query, key, value = promote_dtype((query, key, value), dtype=dtype)
    else:
        target = dtype if dtype is not None else jnp.result_type(query, key, value)
        query, key, value = (jnp.asarray(x, target) for x in (query, key, value))
    rate = 0.0 if deterministic else dropout_rate
    if rate and dropout_rng is None:
        raise ValueError(f"dropout_rng is needed for dropout_rate={dropout_rate} when not "
                         "deterministic")
    batch_shape = query.shape[:-3]
    if len(batch_shape) > 1:  # several batch axes: one, as Flax does for jax.nn
        def flat(x: Any) -> Any:
            if x is None:
                return None
            x = jnp.asarray(x)
            return x.reshape(math.prod(x.shape[:-3]), *x.shape[-3:])

        query, key, value, bias, mask = (flat(x) for x in (query, key, value, bias, mask))
    if mask is not None:
        mask = jnp.asarray(mask).astype(bool)
    out, _ = attend_in_jax_nn_layout(query, key, value, bias, mask, is_causal=is_causal,
                                     dropout_rate=rate, dropout_key=dropout_rng if rate else None,
                                     kernels=kernels)
    return out.reshape(*batch_shape, *out.shape[-3:])
