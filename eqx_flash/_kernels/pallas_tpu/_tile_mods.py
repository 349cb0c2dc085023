"""A `score_mod` and a `mask_mod` on one tile of a Pallas kernel, and which ones the
kernels can run (`uncovered`).

The functions are the user's own, called in the kernel body on one query head's tile at
a time, `(rows, cols)`, with index arrays that broadcast against it: `batch` and `head`
`(1, 1)`, the query and key indices a column and a row (queries along the rows in the
forward, dq and tangent kernels; keys along the rows, `transposed`, in the dk/dv kernel).
An elementwise function of broadcasting arrays (what `_mods.tracing` checks for every
family) gives the same values whatever the tile's shape or orientation.

Mosaic lowers a fixed set of primitives (`ELEMENTWISE`: arithmetic, comparisons,
selects, casts, broadcasts, transcendental functions). A function using nothing else
and reading no arrays is called as it is. One that reads arrays (its PyTree leaves,
closed-over arrays) or applies another primitive by one side's positions only
(`ids[b, q_idx]`, `scales[h]`) runs split (`_split_mods`): those values are computed
outside the kernels, per position, and read per tile (`TileMods`); a score_mod's
derivatives in those values (`ModDerivatives`) give its floating arrays' gradients and
tangents. What is left runs on the pure-JAX kernels, which the family's `covers` says: a
lookup by both positions (a `gather` per pair), except a `RelativeScoreMod`, whose bias,
a function of the offset alone, becomes a term the kernels build (`_relative`).

A `score_mod` acts on the natural logits (after the scale and any bias, before the soft
cap) as in every family: the kernels' logits in base-2 units are converted around it.
Its derivative is one `jax.jvp` along ones on the tile: the function is elementwise in
the scores, so its derivative is too, and the backward and the tangent kernels multiply
by it.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import core
from jaxtyping import Array

from ..._core.config import KernelConfig
from ..._mods.position_bias import RelativeScoreMod
from ..._mods.tracing import ModFn, block_probe, split_mod
from ._relative import module_type as is_relative
from ._split_mods import Split, analyse, evaluate, floating, read_values
from ._tile import ScoreMod, Units, fold_heads

# Primitives every Mosaic lowering of this jax has a rule for, elementwise ones only.
ELEMENTWISE = frozenset({
    "abs", "add", "and", "broadcast_in_dim", "ceil", "clamp", "convert_element_type",
    "copy", "copy_p", "cos", "div", "eq", "exp", "exp2", "expm1", "floor", "ge", "gt",
    "integer_pow", "is_finite", "le", "log", "log1p", "logistic", "lt", "max", "min",
    "mul", "ne", "neg", "not", "or", "pow", "rem", "round", "rsqrt", "select_n",
    "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign", "sin", "sqrt",
    "square", "stop_gradient", "sub", "tanh", "xor",
})
def uncovered(name: str, mod: Callable[..., Any] | None, groups: int, dtype: Any
              ) -> str | None:
    """Why the kernels cannot run `mod` (a `score_mod`, or a `mask_mod` without the
    scores), or None where they can."""
    if mod is None:
        return None
    if name == "score_mod" and isinstance(mod, RelativeScoreMod):
        return _uncovered_relative(mod, groups)
    probe = block_probe(groups, 8, 128, dtype)
    try:
        fn, _, arrays = split_mod(name, mod, probe if name == "score_mod" else probe[1:])
    except Exception:  # noqa: BLE001 - the families' own checks say what is wrong
        return f"a {name} that does not trace on a block"
    split = analyse(name, fn, arrays, groups, 8, 128, dtype, ELEMENTWISE)
    return split if isinstance(split, str) else None


def _uncovered_relative(mod: RelativeScoreMod, groups: int) -> str | None:
    """Why the kernels cannot build `mod`'s bias as a term (`_relative`), or None: its
    `bias` must give a float per (head, offset) pair and close over no traced values
    (they could not be differentiated through the kernels' rules)."""
    head = jax.ShapeDtypeStruct((groups, 1), jnp.int32)
    relative = jax.ShapeDtypeStruct((1, 256), jnp.int32)
    try:
        closed = jax.make_jaxpr(lambda m, h, r: m.bias(h, r))(mod, head, relative)
    except Exception:  # noqa: BLE001 - the families' own checks say what is wrong
        return "a RelativeScoreMod whose bias does not trace on (head, offset) arrays"
    if any(isinstance(c, core.Tracer) for c in closed.consts):
        return "a RelativeScoreMod whose bias closes over traced values"
    (out,) = closed.out_avals if len(closed.out_avals) == 1 else (None,)
    try:
        per_pair = out is not None and jnp.issubdtype(out.dtype, jnp.floating) and (
            jnp.broadcast_shapes(out.shape, (groups, 256)) == (groups, 256))
    except ValueError:
        per_pair = False
    if not per_pair:
        return "a RelativeScoreMod whose bias is not one float per (head, offset) pair"
    return None


class TileMods(NamedTuple):
    """What a tile's `score_mod`/`mask_mod` read besides their indices, for those that
    read arrays: their splits (`_split_mods`; None for one that reads none) and
    `read(group)`, the reader of query head `group`'s boundary values on this tile."""

    score: Split | None
    mask: Split | None
    read: Callable[[int], Callable[[str], Array]]
    tangents: bool = False  # the score_mod's floating values' tangents are operands too


class ModDerivatives(NamedTuple):
    """A split score_mod's derivatives on a tile beyond the one in the scores: in its
    floating boundary values (`partials`, per `_split_mods.floating` index, natural
    units; for their cotangents) or along their tangents (`tangent`, natural)."""

    slope: Array
    partials: dict[int, Array]
    tangent: Array | None


def _function(fn: ModFn, split: Split | None, tile: TileMods | None, head: int
              ) -> tuple[Callable[..., Any], list[Array]]:
    """The function to call on query head `head`'s part of a tile, and the boundary
    values it takes after its arguments: the user's own where it reads no arrays (the
    static half of its split is the whole of it), else its kernel half with the
    boundary values read from the tile's operands."""
    if split is None:
        assert not fn.traced
        return fn.static.value, []
    assert tile is not None
    values = read_values(split, tile.read(head))
    count = len(split.roles)
    return lambda *args: evaluate(split, args[:count], list(args[count:])), values


def _indices(bi: Array, head: Array | int, q_start: Array | int, k_start: Array | int,
             shape: tuple[int, ...], transposed: bool,
             given: tuple[Array, Array] | None = None) -> tuple[Array, ...]:
    """`(batch, head, q_idx, kv_idx)` broadcasting against a tile of `shape`: the tile's
    own indices from its first query and key, or the `given` ones (the ring's global
    indices of its pieces)."""
    rows, cols = shape
    q_axis, k_axis = (1, 0) if transposed else (0, 1)
    q_shape = (1, cols) if transposed else (rows, 1)
    k_shape = (rows, 1) if transposed else (1, cols)
    if given is not None:
        q_idx, k_idx = given[0].reshape(q_shape), given[1].reshape(k_shape)
    else:
        q_idx = q_start + jax.lax.broadcasted_iota(jnp.int32, q_shape, q_axis)
        k_idx = k_start + jax.lax.broadcasted_iota(jnp.int32, k_shape, k_axis)
    batch = jnp.full((1, 1), bi, jnp.int32)
    return batch, jnp.full((1, 1), head, jnp.int32), q_idx, k_idx


def _heads(groups: int, group: int | None) -> list[int]:
    """The query heads of a tile: all `groups` folded into its rows, or the one `group`."""
    return list(range(groups)) if group is None else [group]


def apply_score_mod(cfg: KernelConfig, units: float, s: Array, *, bi: Array, hi: Array,
                    groups: int, q_start: Array | int, k_start: Array | int,
                    group: int | None = None, derivative: bool | str = False,
                    indices: tuple[Array, Array] | None = None,
                    tile: TileMods | None = None) -> tuple[Array, Any]:
    """The `score_mod` on the tile `s` of logits in `units` (natural logits times
    `units`): its value in the same units, and (with `derivative`) its derivative in the
    logits, elementwise. `s` is `(g * n, cols)` with the query heads folded into its rows,
    or, for one query head `group`, `(keys, queries)` (transposed). For a split one with
    floating values, `derivative="partials"` (one query head: the dk/dv kernel) or
    `"tangent"` gives `ModDerivatives` instead of the derivative alone."""
    mods = cfg.mods
    if mods is None or mods.score is None:
        return s, None
    transposed = group is not None
    split = None if tile is None else tile.score
    wanted = [] if split is None else floating(split)

    def on_head(x: Array, h: int) -> tuple[Array, Any]:
        assert mods.score is not None and (tile is not None or split is None)
        score_mod, values = _function(mods.score, split, tile, h)
        idx = _indices(bi, hi * groups + h, q_start, k_start, x.shape, transposed, indices)

        def natural(x: Array, *values: Array) -> Array:
            if units == 1.0:
                return score_mod(x, *idx, *values)
            out = score_mod(x * jnp.asarray(1.0 / units, x.dtype), *idx, *values)
            return out * jnp.asarray(units, x.dtype)

        if not derivative:
            return natural(x, *values), None

        def along(which: list[int], tangents: list[Array]) -> Array:
            """The derivative of `natural` (natural units) along these values' tangents,
            the scores held."""
            def of(*chosen: Array) -> Array:
                return natural(x, *_with(values, which, chosen))

            _, d = jax.jvp(of, tuple(values[n] for n in which), tuple(tangents))
            return d * jnp.asarray(1.0 / units, x.dtype)

        out, slope = jax.jvp(lambda x: natural(x, *values), (x,), (jnp.ones_like(x),))
        if derivative is True or not wanted:
            return out, slope
        if derivative == "partials":
            partials = {n: along([n], [jnp.ones_like(values[n])]) for n in wanted}
            return out, ModDerivatives(slope, partials, None)
        assert tile is not None and split is not None and derivative == "tangent"
        if not tile.tangents:
            return out, ModDerivatives(slope, {}, None)
        d_values = read_values(split, tile.read(h), "_tangent", wanted)
        return out, ModDerivatives(slope, {}, along(wanted, d_values))

    heads = _heads(groups, group)
    n = s.shape[0] // len(heads)
    parts = [on_head(s[i * n:(i + 1) * n] if len(heads) > 1 else s, h)
             for i, h in enumerate(heads)]
    out = fold_heads([p[0] for p in parts])
    found = [p[1] for p in parts if p[1] is not None]
    if not found:
        return out, None
    if not isinstance(found[0], ModDerivatives):
        return out, fold_heads(found)
    tangents = [d.tangent for d in found if d.tangent is not None]
    return out, ModDerivatives(fold_heads([d.slope for d in found]), found[0].partials
                               if len(found) == 1 else {},
                               fold_heads(tangents) if tangents else None)


def _with(values: list[Array], chosen_at: list[int], chosen: tuple[Array, ...]
          ) -> list[Array]:
    """`values` with those at `chosen_at` replaced by `chosen`."""
    found = list(values)
    for n, value in zip(chosen_at, chosen, strict=True):
        found[n] = value
    return found


def apply_mask_mod(cfg: KernelConfig, bi: Array, hi: Array, groups: int,
                   q_start: Array | int, k_start: Array | int, shape: tuple[int, int],
                   group: int | None = None, indices: tuple[Array, Array] | None = None,
                   tile: TileMods | None = None) -> Array | None:
    """Which pairs of a tile the `mask_mod` keeps (None without one): `(g, n, cols)` for
    a folded tile of `shape` `(g * n, cols)` (the layout the kernels' masks broadcast
    in), or `shape` itself, `(keys, queries)`, for one query head `group`."""
    mods = cfg.mods
    if mods is None or mods.mask is None:
        return None
    transposed = group is not None
    rows = shape[0] if transposed else shape[0] // groups

    def on_head(h: int) -> Array:
        assert mods.mask is not None
        mask_mod, values = _function(mods.mask, None if tile is None else tile.mask, tile, h)
        idx = _indices(bi, hi * groups + h, q_start, k_start, (rows, shape[1]), transposed,
                       indices)
        return jnp.broadcast_to(mask_mod(*idx, *values), (rows, shape[1]))

    parts = [on_head(h) for h in _heads(groups, group)]
    if transposed:
        return parts[0]
    if len(parts) == 1:
        return parts[0][None]
    # Stacked as int32 (a leading-axis concatenation of 32-bit tiles), then compared.
    return jnp.stack([p.astype(jnp.int32) for p in parts]) != 0


def score_mod(cfg: KernelConfig, u: Units, *, bi: Array, hi: Array, groups: int,
              q_start: Array | int, k_start: Array | int, group: int | None = None,
              derivative: bool | str = True, indices: tuple[Array, Array] | None = None,
              tile: TileMods | None = None) -> ScoreMod | None:
    """The `score_mod` of one tile as `_tile.logits` takes it, with its derivative where
    asked (the backward and the tangent kernels); None without a score_mod."""
    if cfg.mods is None or cfg.mods.score is None or is_relative(cfg):
        return None
    return functools.partial(apply_score_mod, cfg, u.before_cap, bi=bi, hi=hi, groups=groups,
                             q_start=q_start, k_start=k_start, group=group,
                             derivative=derivative, indices=indices, tile=tile)
