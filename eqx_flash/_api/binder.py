"""The binder: every entry point checks its arguments and binds them into one `Bound`
call here, so the same bad input raises the same exception with the same message
wherever it is passed.

`bind` runs on static properties only (shapes, dtypes, Python values), so it also runs
at trace time under `jax.jit`. Its messages name the argument and show what was
expected. The static options are checked by `_core.options.make_options`; the array
arguments are brought into the internal layout (`_core.shapes`) as the `Operands` fields
they fill, each by the checker of its field's `kind` (`bind_array`).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike

from .._core import operands as operands_
from .._core.operands import Kind, Operands
from .._core.options import AttentionOptions, make_options
from .._core.shapes import Shapes, mask_to_internal, shapes_of
from .._semantics.dropout import seed_from_key


@dataclasses.dataclass(frozen=True)
class Bound:
    """One call's arguments, checked: the static options, the problem's sizes, q, k, v
    and the per-call arrays in the internal layout. `score_mod`, `mask_mod` and
    `block_mask` are kept as given: they are traced at the kernels' block sizes
    (`_mods.tracing.trace_mods`, `_mods.block_mask.block_flags_for`)."""

    options: AttentionOptions
    shapes: Shapes
    q: Array
    k: Array
    v: Array
    operands: Operands
    score_mod: Any = None
    mask_mod: Any = None
    block_mask: Any = None
    return_max_scores: bool = False


def bind(
    entry: str,
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    mask: ArrayLike | None = None,
    *,
    key: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
    block_mask: Any = None,
    return_max_scores: Any = False,
    key_columns: Callable[[], int] | None = None,
    **arguments: Any,
) -> Bound:
    """Check every argument of `entry` (the public function's name, for messages) and
    bind them. Entry points pass their whole signature (`bind(name, **locals())`); an
    argument they do not take keeps its default. `arguments` are the static options
    (`make_options`' keywords) and the per-call arrays by their public names
    (`Operands`' `argument` metadata), so a new one of either needs no change here.

    `key_columns`: gives the length of `bias`'s key axis when it is not `k`'s (the ring:
    a device's rows against every key); called after the options are checked, so that
    the ring reports a bad option before it looks for its mesh axis.
    """
    public = operands_.public_arguments()
    given = {name: arguments.pop(name) for name in public if name in arguments}
    given["mask"] = mask
    options = make_options(**arguments)  # a name that is neither: Python's TypeError
    q, k, v, shapes = check_qkv(q, k, v)
    bias_shapes = shapes if key_columns is None else dataclasses.replace(
        shapes, seq_k=key_columns())
    _check_pairs(given, ("q_segment_ids", "kv_segment_ids"))
    _check_pairs(given, ("q_positions", "kv_positions"))
    fields = {}
    for argument, name in public.items():
        kind, value = operands_.kind_of(name), given.get(argument)
        if kind is None or value is None:
            continue
        target = bias_shapes if argument == "bias" else shapes
        fields[name] = bind_array(kind, argument, value, target)
    key = check_dropout_key(options.dropout_rate, key)
    if key is not None:
        fields["dropout_seed"] = seed_from_key(key)
    for name, mod in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if mod is not None and not callable(mod):
            raise TypeError(f"{name} must be callable; got {name} of type "
                            f"{type(mod).__name__}")
    if not isinstance(return_max_scores, bool | np.bool_):
        raise TypeError(f"return_max_scores must be a bool; got "
                        f"return_max_scores={return_max_scores!r}")
    return Bound(options, shapes, q, k, v, Operands(**fields), score_mod, mask_mod,
                 block_mask, bool(return_max_scores))


def _check_pairs(given: dict[str, Any], pair: tuple[str, str]) -> None:
    """Both arguments of `pair` or neither."""
    first, second = pair
    if (given.get(first) is None) != (given.get(second) is None):
        present, missing = (first, second) if given.get(second) is None else (second, first)
        raise ValueError(f"{first} and {second} must be given together; got {present} but "
                         f"{missing}=None")


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


def bind_array(kind: Kind, name: str, x: ArrayLike, shapes: Shapes) -> Array:
    """Argument `name` checked as its `kind` says (`_core.operands.Kind`) and brought
    into the internal layout."""
    return _BY_KIND[kind](name, x, shapes)


def _as_array(x: ArrayLike) -> Array:
    return jnp.asarray(x) if not isinstance(x, jax.Array) else x


def _boolean_mask(name: str, x: ArrayLike) -> Array:
    x = _as_array(x)
    if not (x.dtype == jnp.bool_ or jnp.issubdtype(x.dtype, jnp.integer)):
        raise TypeError(f"{name} must be boolean (or integer, non-zero attends); "
                        f"got {name}.dtype={x.dtype}")
    return x != 0 if x.dtype != jnp.bool_ else x


_INT32 = np.iinfo(np.int32)


def _integer(name: str, x: ArrayLike) -> Array:
    """Integer ids or positions as int32, which the kernels compute in. A wider dtype
    (int64, uint32, ...) is checked value by value when concrete and refused when traced:
    a value past int32 would wrap silently, and a check on traced values cannot raise
    (an `eqx.error_if` could abort a multi-device program)."""
    dtype = x.dtype if isinstance(x, jax.Array) else np.asarray(x).dtype
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype; got {name}.dtype={dtype}")
    info = np.iinfo(dtype)
    if info.min >= _INT32.min and info.max <= _INT32.max:
        return _as_array(x).astype(jnp.int32)
    if isinstance(x, jax.Array) and not is_concrete(x):
        raise TypeError(
            f"{name} has dtype {dtype}, whose values may not fit int32, and is traced (under "
            f"jax.jit), so its values cannot be checked: pass int32 ({name}.astype(jnp.int32) "
            f"once you know they lie in [{_INT32.min}, {_INT32.max}])")
    values = np.asarray(x)
    if values.size and (values.min() < _INT32.min or values.max() > _INT32.max):
        raise ValueError(
            f"{name} must fit int32, [{_INT32.min}, {_INT32.max}]; got values from "
            f"{values.min()} to {values.max()} ({name}.dtype={dtype})")
    return x.astype(jnp.int32) if isinstance(x, jax.Array) else jnp.asarray(
        values.astype(np.int32))


def _keys(name: str, x: ArrayLike, shapes: Shapes) -> Array:
    return mask_to_internal(_boolean_mask(name, x), shapes, "keys", name)


def _pairs(name: str, x: ArrayLike, shapes: Shapes) -> Array:
    return mask_to_internal(_boolean_mask(name, x), shapes, "pairs", name)


def _query_ids(name: str, x: ArrayLike, shapes: Shapes) -> Array:
    return mask_to_internal(_integer(name, x), shapes, "queries", name)


def _key_ids(name: str, x: ArrayLike, shapes: Shapes) -> Array:
    return mask_to_internal(_integer(name, x), shapes, "keys", name)


def _float_pairs(name: str, x: ArrayLike, shapes: Shapes) -> Array:
    return mask_to_internal(as_float_array(name, x), shapes, "pairs", name)


def _per_head(name: str, x: ArrayLike, shapes: Shapes) -> Array:
    """`(heads,)` or `(*batch, heads)`, the leading axes broadcastable to q's."""
    return _head_values(name, x, shapes, broadcast_heads=False)


def _broadcast_per_head(name: str, x: ArrayLike, shapes: Shapes) -> Array:
    """Broadcastable to `(*batch, heads)`: `()`, `(1,)`, `(heads,)`, `(batch, 1)`, ..."""
    return _head_values(name, x, shapes, broadcast_heads=True)


def _head_values(name: str, x: ArrayLike, shapes: Shapes, broadcast_heads: bool) -> Array:
    arr = as_float_array(name, x)
    lead = shapes.lead_shape if shapes.has_heads_axis else (1,)
    fits = arr.ndim <= len(lead) and all(
        a in (1, b) for a, b in zip(arr.shape[::-1], lead[::-1], strict=False))
    if not broadcast_heads:  # the heads axis itself is required, whole
        fits = fits and arr.ndim > 0 and arr.shape[-1] == lead[-1]
    if not fits:
        expected = (f"broadcastable to (*batch, heads) = {lead}" if broadcast_heads else
                    f"(heads,) or (*batch, heads) with heads = {lead[-1]} and each leading "
                    f"axis 1 or that of (*batch, heads) = {lead}")
        raise ValueError(f"{name} must have shape {expected}; got {name}.shape={arr.shape}")
    if not shapes.has_heads_axis:  # a bare (seq, dim) problem has one head
        return arr.reshape(1, 1, 1, 1, 1)
    return mask_to_internal(arr[..., None, None], shapes, "pairs", name)


def is_concrete(x: Array) -> bool:
    try:
        np.asarray(x)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return False
    return True


def _query_lengths(name: str, x: ArrayLike, shapes: Shapes) -> Array:
    return _lengths(name, x, shapes, shapes.seq_q)


def _key_lengths(name: str, x: ArrayLike, shapes: Shapes) -> Array:
    return _lengths(name, x, shapes, shapes.seq_k)


def _lengths(name: str, x: ArrayLike, shapes: Shapes, seq: int) -> Array:
    """`(*batch,)` (any leading axis 1 or missing) in the layout `(batch|1, 1, 1, 1, 1)`,
    values in `[0, seq]`: a concrete value outside raises; a traced one is clamped into
    `[0, seq]` (as `jax.nn` masks do with `arange(seq) < length`), since no value check
    inside a jitted program may abort it: `eqx.error_if` there, followed by cross-device
    collectives, hangs and then kills a multi-device program."""
    # (NumPy values are read before any conversion: jnp.asarray of an int64 array
    # without jax_enable_x64 would wrap what lies past int32.)
    arr = x if isinstance(x, jax.Array) else np.asarray(x)
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
    message = f"{name} must lie in [0, {seq}] (the sequence length)"
    if isinstance(arr, jax.Array) and not is_concrete(arr):
        arr = jnp.clip(arr, 0, seq).astype(jnp.int32)  # clipped in its own dtype: no wrap
    else:
        concrete = np.asarray(arr)
        if np.any((concrete < 0) | (concrete > seq)):
            raise ValueError(f"{message}; got {name}={concrete.tolist()}")
        arr = arr.astype(jnp.int32) if isinstance(arr, jax.Array) else jnp.asarray(
            concrete.astype(np.int32))
    arr = arr.reshape((1,) * (len(batch) - arr.ndim) + arr.shape)
    if any(n != 1 for n in arr.shape):
        arr = jnp.broadcast_to(arr, batch)
    return arr.reshape(-1 if arr.size > 1 else 1, 1, 1, 1, 1)


_BY_KIND: dict[str, Callable[[str, ArrayLike, Shapes], Array]] = {
    "keys": _keys, "pairs": _pairs, "query_ids": _query_ids, "key_ids": _key_ids,
    "query_lengths": _query_lengths, "key_lengths": _key_lengths,
    "float_pairs": _float_pairs, "per_head": _per_head,
    "broadcast_per_head": _broadcast_per_head,
}


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


def refuse(entry: str, arguments: dict[str, Any], refused: dict[str, str]) -> None:
    """`NotImplementedError` for an argument `entry` does not run, saying what to do
    instead: `refused` maps each such argument to that advice."""
    for name, instead in refused.items():
        if arguments.get(name) is not None:
            raise NotImplementedError(f"{entry} does not support {name}: {instead}")
