"""Argument checks shared by every public entry point, with messages that name the argument.

All checks are on static properties (shapes, dtypes, Python scalars), so they also run,
at trace time, under `jax.jit`.
"""

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike

from ._config import (
    KernelConfig,
    Window,
    check_block_size,
    choose_block,
    default_blocks,
    make_window,
)
from ._layout import Shapes, mask_to_internal, shapes_of
from ._masking import Masks


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


def _mask_like(name: str, x: ArrayLike | None, s: Shapes, kind, integer_only: bool):
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
    return mask_to_internal(x, s, kind, name)


def check_masks(
    s: Shapes,
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
        key_mask=_mask_like("mask", mask, s, "keys", integer_only=False),
        pair_mask=_mask_like("attn_mask", attn_mask, s, "pairs", integer_only=False),
        q_segment_ids=_mask_like("q_segment_ids", q_segment_ids, s, "queries", True),
        kv_segment_ids=_mask_like("kv_segment_ids", kv_segment_ids, s, "keys", True),
    )


def _static_float(name: str, value: Any, positive: bool) -> float:
    """A Python number known at trace time (it decides the compiled program)."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.number | jax.Array):
        raise TypeError(f"{name} must be a real number; got {value!r}")
    try:
        number = float(value)
    except TypeError:  # a traced JAX value: float() cannot concretise it
        raise TypeError(
            f"{name} must be a concrete Python number, not a traced value; got {value!r}"
        ) from None
    if not math.isfinite(number) or (positive and number <= 0):
        expected = "finite and > 0" if positive else "finite"
        raise ValueError(f"{name} must be {expected}; got {name}={value!r}")
    return number


def _check_block(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be a positive int or None; got {name}={value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int or None; got {name}={value!r}")


def check_dropout(dropout_rate: Any, key: Any) -> tuple[float, Array | None]:
    if isinstance(dropout_rate, bool):
        raise TypeError(f"dropout_rate must be a float in [0, 1); got {dropout_rate!r}")
    rate = _static_float("dropout_rate", dropout_rate, positive=False)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1); got dropout_rate={dropout_rate!r}")
    if rate == 0.0:
        return 0.0, None
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
    return rate, key


def make_config(
    s: Shapes,
    *,
    causal: bool,
    window: Any,
    scale: Any,
    softcap: Any,
    block_q: Any,
    block_k: Any,
    dropout_rate: float,
    default_block_q: int | None = None,
    default_block_k: int | None = None,
) -> KernelConfig:
    """Validate the static arguments into a `KernelConfig`. Block sizes default to the
    tuned `_config.default_blocks` unless `default_block_q`/`_k` are given."""
    if not isinstance(causal, bool | np.bool_):
        raise TypeError(f"causal must be a bool; got causal={causal!r}")
    win: Window = make_window(window, bool(causal))
    if scale is None:
        scale = 1.0 / math.sqrt(s.dim)
    else:
        scale = _static_float("scale", scale, positive=False)
    softcap = None if softcap is None else _static_float("softcap", softcap, positive=True)
    _check_block("block_q", block_q)
    _check_block("block_k", block_k)
    block_q = None if block_q is None else int(block_q)
    block_k = None if block_k is None else int(block_k)
    check_block_size("block_q", block_q)
    check_block_size("block_k", block_k)
    tuned_q, tuned_k = default_blocks(win, s.groups)
    default_block_q = tuned_q if default_block_q is None else default_block_q
    default_block_k = tuned_k if default_block_k is None else default_block_k
    return KernelConfig(
        seq_q=s.seq_q,
        seq_k=s.seq_k,
        block_q=choose_block(block_q, default_block_q, s.seq_q),
        block_k=choose_block(block_k, default_block_k, s.seq_k),
        window=win,
        scale=scale,
        softcap=softcap,
        dropout_rate=dropout_rate,
    )
