"""Checks of the array arguments shared by every entry point, with messages that name
the argument (the static options are checked by `_options.make_options`).

All checks are on static properties (shapes, dtypes), so they also run, at trace time,
under `jax.jit`.
"""

from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike

from .._core.shapes import Shapes, mask_to_internal, shapes_of
from .._semantics.masking import Masks
from .._semantics.score_terms import ScoreMods


def as_float_array(name: str, x: ArrayLike) -> Array:
    x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must have a floating dtype; got {name}.dtype={x.dtype}")
    return x


def check_qkv(q: ArrayLike, k: ArrayLike, v: ArrayLike) -> tuple[Array, Array, Array, Shapes]:
    q, k, v = as_float_array("q", q), as_float_array("k", k), as_float_array("v", v)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            "q, k and v must share one floating dtype; "
            f"got q.dtype={q.dtype}, k.dtype={k.dtype}, v.dtype={v.dtype}"
        )
    return q, k, v, shapes_of(q, k, v)


def _mask_like(name: str, x: ArrayLike | None, shapes: Shapes, kind, integer_only: bool):
    if x is None:
        return None
    x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
    if integer_only:
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name} must have an integer dtype; got {name}.dtype={x.dtype}")
        x = x.astype(jnp.int32)
    else:
        if not (x.dtype == jnp.bool_ or jnp.issubdtype(x.dtype, jnp.integer)):
            raise TypeError(
                f"{name} must be boolean (or integer, non-zero attends); "
                f"got {name}.dtype={x.dtype}"
            )
        x = x != 0 if x.dtype != jnp.bool_ else x
    return mask_to_internal(x, shapes, kind, name)


def check_masks(
    shapes: Shapes,
    mask: ArrayLike | None,
    attn_mask: ArrayLike | None,
    q_segment_ids: ArrayLike | None,
    kv_segment_ids: ArrayLike | None,
) -> Masks:
    if (q_segment_ids is None) != (kv_segment_ids is None):
        given, missing = ("q_segment_ids", "kv_segment_ids")
        if q_segment_ids is None:
            given, missing = missing, given
        raise ValueError(
            "q_segment_ids and kv_segment_ids must be given together; "
            f"got {given} but {missing}=None"
        )
    return Masks(
        key_mask=_mask_like("mask", mask, shapes, "keys", integer_only=False),
        pair_mask=_mask_like("attn_mask", attn_mask, shapes, "pairs", integer_only=False),
        q_segment_ids=_mask_like("q_segment_ids", q_segment_ids, shapes, "queries", True),
        kv_segment_ids=_mask_like("kv_segment_ids", kv_segment_ids, shapes, "keys", True),
    )


def check_score_mods(
    shapes: Shapes, bias: ArrayLike | None, alibi_slopes: ArrayLike | None
) -> ScoreMods:
    """Bias and ALiBi slopes in the internal layout (floating, broadcastable to q's heads
    and the logits)."""
    if bias is not None:
        bias = as_float_array("bias", bias)
        bias = mask_to_internal(bias, shapes, "pairs", "bias")
    if alibi_slopes is not None:
        slopes = as_float_array("alibi_slopes", alibi_slopes)
        lead = shapes.lead_shape if shapes.has_heads_axis else (1,)
        if slopes.ndim == 0 or slopes.ndim > len(lead) or any(
            a not in (1, b) for a, b in zip(slopes.shape[::-1], lead[::-1], strict=False)
        ) or slopes.shape[-1] != lead[-1]:
            raise ValueError(
                f"alibi_slopes must have shape (heads,) or (*batch, heads) broadcastable to "
                f"{lead}; got alibi_slopes.shape={slopes.shape}"
            )
        if shapes.has_heads_axis:
            alibi_slopes = mask_to_internal(slopes[..., None, None], shapes, "pairs",
                                            "alibi_slopes")
        else:  # a bare (seq, dim) problem has one head
            alibi_slopes = slopes.reshape(1, 1, 1, 1, 1)
    return ScoreMods(bias, alibi_slopes)


def is_concrete(x: Array) -> bool:
    try:
        np.asarray(x)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return False
    return True


def _lengths(name: str, x: ArrayLike | None, shapes: Shapes, seq: int) -> Array | None:
    """One lengths argument `(*batch,)` in the internal layout `(batch|1, 1, 1, 1, 1)`."""
    if x is None:
        return None
    arr: Array = jnp.asarray(x) if not isinstance(x, jax.Array) else x
    if not jnp.issubdtype(arr.dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype; got {name}.dtype={arr.dtype}")
    batch = shapes.batch_shape
    if arr.ndim > len(batch) or any(
        a not in (1, b) for a, b in zip(arr.shape[::-1], batch[::-1], strict=False)
    ):
        raise ValueError(
            f"{name} must have shape (*batch,) = {batch} (any leading axis may be 1 or "
            f"missing), one length per batch element; got {name}.shape={arr.shape}"
        )
    arr = arr.astype(jnp.int32)
    message = f"{name} must lie in [0, {seq}] (the sequence length)"
    if not is_concrete(arr):
        arr = cast(Array, eqx.error_if(arr, (arr < 0) | (arr > seq), message))
    else:
        concrete = np.asarray(arr)
        if np.any((concrete < 0) | (concrete > seq)):
            raise ValueError(f"{message}; got {name}={concrete.tolist()}")
    arr = arr.reshape((1,) * (len(batch) - arr.ndim) + arr.shape)
    if any(n != 1 for n in arr.shape):
        arr = jnp.broadcast_to(arr, batch)
    return arr.reshape(-1 if arr.size > 1 else 1, 1, 1, 1, 1)


def check_lengths(
    shapes: Shapes, masks: Masks, q_lengths: ArrayLike | None, kv_lengths: ArrayLike | None
) -> Masks:
    """`masks` with the valid lengths added (checked: integer, `(*batch,)` broadcasting
    against q's batch axes, values in `[0, seq]`; the value check is `eqx.error_if` under
    `jax.jit`, an eager `ValueError` otherwise)."""
    return masks._replace(
        q_lengths=_lengths("q_lengths", q_lengths, shapes, shapes.seq_q),
        kv_lengths=_lengths("kv_lengths", kv_lengths, shapes, shapes.seq_k),
    )


def check_dropout_key(rate: float, key: Any) -> Array | None:
    """The PRNG key that dropout at the (validated) `rate` needs; None without dropout."""
    if rate == 0.0:
        return None
    if key is None:
        raise ValueError(
            f"dropout_rate={rate} > 0 needs a PRNG key: pass key=jax.random.key(...); "
            "got key=None"
        )
    if not isinstance(key, jax.Array):
        raise TypeError(f"key must be a JAX PRNG key; got key of type {type(key).__name__}")
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.dtype == jnp.uint32 and key.shape == (2,):
            key = jax.random.wrap_key_data(key)  # a legacy jax.random.PRNGKey
        else:
            raise TypeError(
                f"key must be a single PRNG key from jax.random.key; got key.dtype={key.dtype}, "
                f"key.shape={key.shape}"
            )
    if key.shape != ():
        raise ValueError(f"key must be a single (scalar) PRNG key; got key.shape={key.shape}")
    return key
