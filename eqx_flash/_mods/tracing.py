"""`score_mod` and `mask_mod`: user functions of the logits and of the positions.

`score_mod(score, batch, head, q_idx, kv_idx) -> score` and `mask_mod(batch, head, q_idx,
kv_idx) -> bool` are elementwise: the kernels call them on one block at a time with int32
index arrays that broadcast against the block, the reference on the whole grid.

The kernels run under custom derivative rules (`_autodiff`), and JAX cannot
differentiate a custom rule with respect to values it closes over. So each function is
split (`split_mod`) into a static, hashable part (`ModFn`, in `KernelConfig.mods`) and
the arrays it reads (its PyTree leaves, and any traced values it closes over, found by
tracing it on one block), which become operands of the call
(`Operands.score_mod_arrays`, ...): the floating ones of `score_mod` are
differentiable, and the backward kernel gets their cotangents from `jax.vjp` of the
`score_mod` on each block (the tangent kernel, from `jax.jvp`).
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
from jax import core
from jaxtyping import Array, Bool, Int

from .._core.compat import pcast_varying, varying_axes
from .._core.operands import Operands

# Primitives that, applied to the scores, mix different elements: a `score_mod` using one
# would see a different block in each kernel step, so its result would depend on blocking.
_MIXING = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "reduce_xor", "argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin",
    "cumlogsumexp", "dot_general", "transpose", "rev", "sort", "conv_general_dilated",
    "reshape", "slice", "dynamic_slice", "dynamic_update_slice", "gather", "scatter",
    "scatter-add", "scatter_add", "concatenate", "pad", "reduce_window_sum",
    "reduce_window_max", "reduce_window_min", "reduce_window", "top_k", "fft", "squeeze",
    "expand_dims", "split",
})


# Arguments to trace a modification with: arrays or `jax.ShapeDtypeStruct`s. (Tuples of
# `Any`: beartype checks a `tuple[X, ...]` by sampling with the global `random` module.)
Probe = tuple[Any, ...]
Shape = tuple[Any, ...]


class StaticValue:
    """Wraps a static value for use in a jit cache key: by equality where it hashes (a
    function, an `eqx.Module` whose arrays were taken out), else by identity."""

    def __init__(self, value: Any):
        self.value = value

    def __hash__(self) -> int:
        try:
            return hash(self.value)
        except TypeError:
            return id(self.value)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StaticValue):
            return False
        if self.value is other.value:
            return True
        try:
            return bool(self.value == other.value) and hash(self) == hash(other)
        except Exception:  # an array compared elementwise, or no __eq__ at all
            return False


@dataclasses.dataclass(frozen=True)
class ModFn:
    """The static part of a `score_mod` or `mask_mod`: `call(args, arrays)` evaluates it
    with the arrays `split_mod` took out of it."""

    static: StaticValue  # eqx.partition's static half, or a `_Traced`
    traced: bool = False

    def call(self, args: Probe, arrays: Any) -> Array:
        if self.traced:
            return self.static.value(args, arrays)
        return eqx.combine(arrays, self.static.value)(*args)


class _Traced:
    """A function traced to a jaxpr whose traced closed-over values (tracers of an outer
    `jit`, `grad`, `vmap` or `shard_map`) were hoisted out as arguments. Specialised to the
    shapes it was traced at, which are the kernels' block shapes (`split_mod`), and to
    the manual mesh axes `varying` its block arguments were traced varying over (inside
    `shard_map(check_vma=True)`: the jaxpr's casts were recorded for those, so the
    arguments are cast to them again before it runs). Hashed by identity."""

    def __init__(self, closed: Any, hoisted: Shape, varying: Shape = ()):
        consts = list(closed.consts)
        for i in hoisted:
            consts[i] = None  # the tracers themselves are not kept
        self.jaxpr, self.consts, self.hoisted = closed.jaxpr, consts, hoisted
        self.varying = varying

    def __call__(self, args: Probe, arrays: Any) -> Array:
        leaves, hoisted = arrays
        consts = list(self.consts)
        for i, value in zip(self.hoisted, hoisted, strict=True):
            consts[i] = value
        fn = jex.core.jaxpr_as_fun(jex.core.ClosedJaxpr(self.jaxpr, consts))
        return fn(*jax.tree.leaves((_vary(args, self.varying), leaves)))[0]


def _vary(args: Probe, axes: Shape) -> Probe:
    """`args`, each cast to vary over the manual mesh `axes` it does not yet vary over."""
    if not axes:
        return args

    def cast(x: Any) -> Any:
        missing = tuple(a for a in axes if a not in varying_axes(x))
        return pcast_varying(x, missing) if missing else x

    return tuple(cast(jnp.asarray(x)) for x in args)


def split_mod(
    name: str, mod: Callable[..., Any], probe: Probe, varying: Shape = ()
) -> tuple[ModFn, Any, Any]:
    """`(static, jaxpr, arrays)` of `mod` traced on `probe` (the kernels' block of
    arguments): the arrays it reads are its PyTree leaves, plus, if it closes over traced
    values, those values."""
    if not callable(mod):
        raise TypeError(f"{name} must be callable; got {name} of type {type(mod).__name__}")
    leaves, static = eqx.partition(mod, eqx.is_array)

    def call(args, leaves):
        return eqx.combine(leaves, static)(*args)

    closed = _trace(name, call, probe, leaves)
    hoisted = tuple(i for i, c in enumerate(closed.consts) if isinstance(c, core.Tracer))
    if not hoisted:
        return ModFn(StaticValue(static)), closed, leaves
    traced = _Traced(closed, hoisted, varying)
    return ModFn(StaticValue(traced), traced=True), closed, (leaves, [closed.consts[i]
                                                                    for i in hoisted])


def _trace(name: str, call: Callable[..., Any], probe: Probe, leaves: Any):
    try:
        return jax.make_jaxpr(call)(probe, leaves)
    except (TypeError, ValueError, IndexError) as e:
        kind = TypeError if isinstance(e, TypeError) else ValueError
        raise kind(
            f"{name} failed on a block of arguments of shapes {[x.shape for x in probe]} "
            f"(elementwise functions of broadcasting arrays are expected): {e}"
        ) from e


def sub_jaxprs(params: dict[str, Any]) -> list[Any]:
    """The jaxprs among a higher-order primitive's parameters (`jit`, `custom_jvp_call`,
    ...)."""
    found = []
    for value in params.values():
        for x in value if isinstance(value, tuple | list) else (value,):
            if isinstance(x, jex.core.ClosedJaxpr):
                found.append(x.jaxpr)
            elif isinstance(x, jex.core.Jaxpr):
                found.append(x)
    return found


def first_mixing(jaxpr: Any, tainted: set, mixes: Callable[[Any, list[bool]], str | None],
                 skip: Sequence[bool] | None = None) -> str | None:
    """The first primitive in `jaxpr` (or in a jaxpr inside it) that `mixes(eqn, hit)`
    names, following the values derived from the `tainted` ones (`hit`: which inputs of
    `eqn` are); the equations `skip` marks (at the top level) pass them on unchecked."""
    for n, eqn in enumerate(jaxpr.eqns):
        hit = [isinstance(v, jex.core.Var) and v in tainted for v in eqn.invars]
        if not any(hit):
            continue
        if skip is None or not skip[n]:
            found = mixes(eqn, hit)
            if found is not None:
                return found
            for sub in sub_jaxprs(eqn.params):
                if len(sub.invars) == len(eqn.invars):
                    inner = {v for v, h in zip(sub.invars, hit, strict=True) if h}
                    found = first_mixing(sub, inner, mixes)
                    if found is not None:
                        return found
        tainted.update(eqn.outvars)
    return None


def _mixing_scores(eqn: Any, hit: list[bool]) -> str | None:
    del hit
    return eqn.primitive.name if eqn.primitive.name in _MIXING else None


def check_score_mod(
    score_mod: Callable[..., Any], probe: Probe, varying: Shape = ()
) -> tuple[ModFn, Any]:
    """Split `score_mod` (`split_mod`: `(static, arrays)`), checking it keeps the shape
    and dtype of the scores and is elementwise in them."""
    fn, closed, arrays = split_mod("score_mod", score_mod, probe, varying)
    s = probe[0]
    (out,) = closed.out_avals if len(closed.out_avals) == 1 else (None,)
    if out is None or out.shape != s.shape:
        shapes = [a.shape for a in closed.out_avals]
        raise ValueError(
            f"score_mod must return an array of the scores' shape {s.shape}; got shapes "
            f"{shapes} for scores of shape {s.shape} (it is called on a block of scores)"
        )
    if out.dtype != s.dtype:
        raise TypeError(
            f"score_mod must return the scores' dtype {s.dtype}; got {out.dtype} (use "
            "`.astype(score.dtype)` on the result)"
        )
    score_var = closed.jaxpr.invars[0]
    mixing = first_mixing(closed.jaxpr, {score_var}, _mixing_scores)
    if mixing is not None:
        raise ValueError(
            f"score_mod must be elementwise in the scores (it is called on one block at a "
            f"time); it applies `{mixing}` to them"
        )
    return fn, arrays


def check_mask_mod(
    mask_mod: Callable[..., Any], probe: Probe, block: Shape, varying: Shape = ()
) -> tuple[ModFn, Any]:
    """Split `mask_mod` (`split_mod`: `(static, arrays)`), checking it returns booleans
    that broadcast to a block of shape `block`."""
    fn, closed, arrays = split_mod("mask_mod", mask_mod, probe, varying)
    avals = closed.out_avals
    if len(avals) != 1 or avals[0].dtype != jnp.bool_:
        got = [str(a.dtype) for a in avals]
        raise TypeError(
            f"mask_mod must return a boolean array (True attends); got dtype {got} (compare, "
            "e.g. `kv_idx <= q_idx`, rather than return numbers)"
        )
    try:
        np.broadcast_shapes(avals[0].shape, block)
    except ValueError:
        raise ValueError(
            f"mask_mod must return an array broadcasting against the block {block}; got "
            f"shape {avals[0].shape}"
        ) from None
    return fn, arrays


@dataclasses.dataclass(frozen=True)
class Mods:
    """Static part of the modifications of one kernel call (in `KernelConfig.mods`)."""

    score: ModFn | None
    mask: ModFn | None
    heads: int  # query heads per batch element, to split the flat head index


def split_arrays(arrays: Any) -> tuple[Any, Any]:
    """`(floating, other)` arrays of a modification: the first get cotangents."""
    return eqx.partition(arrays, eqx.is_inexact_array)


def block_probe(groups: int, block_q: int, block_k: int, dtype: Any, varying: Shape = ()
                ) -> Probe:
    """`(scores, batch, head, q_idx, kv_idx)` as the kernels pass them, abstract; with
    `varying` (inside `shard_map(check_vma=True)`), zeros varying over those manual mesh
    axes, as the kernels' values may."""
    ints = jnp.int32
    probe = (
        jax.ShapeDtypeStruct((groups, block_q, block_k), dtype),
        jax.ShapeDtypeStruct((groups, 1, 1), ints),
        jax.ShapeDtypeStruct((groups, 1, 1), ints),
        jax.ShapeDtypeStruct((1, block_q, 1), ints),
        jax.ShapeDtypeStruct((1, 1, block_k), ints),
    )
    if not varying:
        return probe
    return _vary(tuple(jnp.zeros(x.shape, x.dtype) for x in probe), varying)


def mod_indices(
    mods: Mods, head_ids: Int[Array, "g 1 1"], q_pos: Array, k_pos: Array
) -> tuple[Array, Array, Array, Array]:
    """`(batch, head, q_idx, kv_idx)` of one block from the flat query-head index."""
    return head_ids // mods.heads, head_ids % mods.heads, q_pos, k_pos


def apply_score_mod(mods: Mods, ops: Operands, s: Array, idx: Probe) -> Array:
    """The `score_mod` on one block of scores `s`, with the arrays it reads from `ops`."""
    assert mods.score is not None
    arrays = eqx.combine(ops.score_mod_arrays, ops.score_mod_consts)
    return mods.score.call((s, *idx), arrays)


def apply_mask_mod(
    mods: Mods, ops: Operands, idx: Probe, shape: Shape
) -> Bool[Array, "..."]:
    """The `mask_mod` on one block, broadcast to `shape`."""
    assert mods.mask is not None
    return jnp.broadcast_to(mods.mask.call(idx, ops.mask_mod_arrays), shape)


def varying_axes_of(tree: Any) -> Shape:
    """The manual mesh axes any array leaf of `tree` varies over (inside `shard_map` with
    `check_vma=True`), in a fixed order."""
    axes: set = set()
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            axes |= varying_axes(x)
    return tuple(sorted(axes, key=str))


def grid_indices(
    batch: int, kv_heads: int, groups: int, seq_q: int, seq_k: int
) -> tuple[Array, Array, Array, Array]:
    """`(batch, head, q_idx, kv_idx)` over the internal layout `(b, h, g, seq_q, seq_k)`,
    broadcasting (the reference's and `make_block_mask`'s grid)."""
    b = jnp.arange(batch, dtype=jnp.int32).reshape(-1, 1, 1, 1, 1)
    h = (jnp.arange(kv_heads, dtype=jnp.int32).reshape(-1, 1) * groups
         + jnp.arange(groups, dtype=jnp.int32).reshape(1, -1))
    h = h.reshape(1, kv_heads, groups, 1, 1)
    i = jnp.arange(seq_q, dtype=jnp.int32).reshape(1, 1, 1, -1, 1)
    j = jnp.arange(seq_k, dtype=jnp.int32).reshape(1, 1, 1, 1, -1)
    return b, h, i, j


def trace_mods(
    score_mod: Callable[..., Any] | None, mask_mod: Callable[..., Any] | None, heads: int,
    groups: int, block_q: int, block_k: int, dtype: Any, varying: Shape = (),
) -> tuple[Mods | None, Operands]:
    """Check and split the modifications for the kernels of a call blocked
    `(block_q, block_k)` whose scores have `dtype`: their static part and the operands
    holding the arrays they read (`(None, Operands())` without any). `varying`: the
    manual mesh axes the call's arrays vary over (`varying_axes_of`), inside a
    `shard_map(check_vma=True)`."""
    if score_mod is None and mask_mod is None:
        return None, Operands()
    probe = block_probe(groups, block_q, block_k, dtype, varying)
    score = mask = None
    score_diff = score_const = mask_arrays = None
    if score_mod is not None:
        score, arrays = check_score_mod(score_mod, probe, varying)
        score_diff, score_const = split_arrays(arrays)
    if mask_mod is not None:
        mask, mask_arrays = check_mask_mod(mask_mod, probe[1:], (groups, block_q, block_k),
                                           varying)
    return Mods(score, mask, heads), Operands(
        score_mod_arrays=score_diff, score_mod_consts=score_const, mask_mod_arrays=mask_arrays)


class AtPositions(eqx.Module):
    """A `score_mod` or `mask_mod` called with absolute positions: query `i` at
    `q_offset + i`, key `j` at `kv_positions[j]` (at `j` without them). KV-cache decoding
    attends new queries at the end of the cache (or keys in a rolling buffer), and a
    modification written for the whole sequence must see where they are in it."""

    mod: Callable[..., Any]
    q_offset: Int[Array, ""]
    kv_positions: Int[Array, " seq_k"] | None = None

    def __call__(self, *args: Any) -> Any:
        *rest, q_idx, kv_idx = args
        if self.kv_positions is not None:
            kv_idx = self.kv_positions.at[kv_idx].get(mode="clip")
        return self.mod(*rest, q_idx + self.q_offset, kv_idx)


def with_index_offsets(fn: Any, batch: Any, head: Any, query: Any, with_score: bool) -> Any:
    """A `score_mod` (`with_score`) or `mask_mod` called with its batch, head and query
    indices moved by these offsets: a shard of a sharded call (Ulysses, the all-gather)
    runs the single-device kernels on local indices, and the user's function sees the
    global ones. None stays None."""
    if fn is None:
        return None
    if with_score:
        return lambda s, b, h, i, j: fn(s, b + batch, h + head, i + query, j)
    return lambda b, h, i, j: fn(b + batch, h + head, i + query, j)
