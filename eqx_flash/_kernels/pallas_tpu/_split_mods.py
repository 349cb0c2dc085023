"""A `score_mod`/`mask_mod` that reads arrays by position, split in two for the Pallas
kernels: what depends on one side's positions only (`ids[b, q_idx]`, `lengths[b]`,
`scales[h]`) is computed outside the kernels, once per position, and read per tile like
segment ids; the kernel evaluates the rest, elementwise, on the tile.

`analyse` traces the function on a block (`Split`): every equation whose value depends
on the scores, or on both the query and the key position, must run in the kernel and
so be one Mosaic lowers (`_tile_mods`' elementwise set); an equation that depends on
one side (or neither) runs in the kernel where it can (lowerable, its inputs there),
else outside (a table lookup, a gather over an array). The values crossing from outside
into the kernel are the split's `Boundary`s: per query (`"q"`), per key (`"k"`) or per
batch element and head (`"bh"`). `boundary_values` evaluates them over every position
(the outside equations, vmapped over batch, kv heads and blocks; differentiable in the
arrays, so a score_mod's floating arrays get their gradients from the values'
cotangents, which the backward kernel sums), `side_operands` lays them out as the
kernels' operands, and `evaluate` runs the kernel's equations of the same jaxpr on a
tile, shape-generic (`_generic`).

Only what positions determine is split: a value that mixes positions (a reduction or
a cumulative sum over queries, a gather from an array indexed by them) is not one value
per position, and such a function stays on the pure-JAX kernels.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ..._mods.tracing import ModFn, first_mixing, sub_jaxprs

# Primitives that keep a value per position when a position-dependent value passes
# through them (besides elementwise ones): shape bookkeeping, and a gather whose
# indices (not its operand) depend on positions.
_PER_POSITION = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims",
                           "convert_element_type", "copy", "copy_p"})
# Shape-keeping primitives that run along an axis, combining positions.
_ALONG_AXES = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "rev",
                         "sort", "transpose", "dynamic_slice", "dynamic_update_slice",
                         "scatter", "scatter-add", "scatter_add", "dot_general",
                         "conv_general_dilated", "argsort", "top_k", "fft"})
_NESTED = frozenset({"jit", "pjit", "closed_call", "custom_jvp_call", "custom_vjp_call",
                     "custom_vjp_call_jaxpr", "remat", "checkpoint"})


@dataclasses.dataclass(frozen=True)
class Boundary:
    """A value computed outside the kernels and read per tile: `side` "q" (one per
    query), "k" (one per key) or "bh" (one per batch element and query head)."""

    side: str
    dtype: Any
    batch: bool = True  # whether it varies over batch elements
    head: bool = True  # ... and over query heads


@dataclasses.dataclass(frozen=True, eq=False)
class Split:
    """A function the kernels run split (`analyse`): its jaxpr on a block, which of its
    equations the kernel runs, and what crosses into the kernel (`boundary`, at the
    variables `points`)."""

    name: str  # "score_mod" or "mask_mod": the side operands' prefix
    closed: Any  # its ClosedJaxpr on a block: `(roles..., array leaves...)`
    in_kernel: tuple[bool, ...]
    one_sided: tuple[bool, ...]  # neither the scores nor both positions: computable outside
    points: tuple[Any, ...]
    boundary: tuple[Boundary, ...]

    @property
    def roles(self) -> tuple[str, ...]:
        return _roles(self.name)

    def side_name(self, n: int) -> str:
        return f"{self.name}_{n}"


def _roles(name: str) -> tuple[str, ...]:
    return ("s", "b", "h", "q", "k") if name == "score_mod" else ("b", "h", "q", "k")


def _trace(fn: ModFn, args: tuple[Any, ...], arrays: Any) -> Any:
    return jax.make_jaxpr(lambda args, arrays: fn.call(args, arrays))(args, arrays)


def _lowerable(eqn: Any, elementwise: frozenset[str]) -> bool:
    name = eqn.primitive.name
    if name in _NESTED:
        return all(_lowerable(e, elementwise) for sub in sub_jaxprs(eqn.params)
                   for e in sub.eqns)
    return name in elementwise


# Primitives that look an array up (or build its index) by both positions: the reason a
# mod is not covered then says how the kernels can run the same lookup.
_LOOKUPS = frozenset({"gather", "concatenate", "dynamic_slice"})


def _classify(closed: Any, roles: tuple[str, ...], elementwise: frozenset[str]
              ) -> tuple[list[bool], list[Any], dict[Any, frozenset[str]]] | str:
    """Which equations run in the kernel, the boundary variables in order, and each
    variable's dependencies (roles); or why the function cannot be split."""
    jaxpr = closed.jaxpr
    dep: dict[Any, frozenset[str]] = {}
    available: set[Any] = set()
    for v, role in zip(jaxpr.invars, roles, strict=False):
        dep[v] = frozenset({role})
        available.add(v)
    for v in [*jaxpr.invars[len(roles):], *jaxpr.constvars]:
        dep[v] = frozenset()
    in_kernel, boundary = [], []

    def needs(x: Any) -> None:
        if isinstance(x, jex.core.Var) and x not in available:
            boundary.append(x)
            available.add(x)

    for eqn in jaxpr.eqns:
        d = frozenset().union(*(dep[x] for x in eqn.invars if isinstance(x, jex.core.Var)))
        for o in eqn.outvars:
            dep[o] = d
        lowerable = _lowerable(eqn, elementwise)
        if "s" in d or {"q", "k"} <= d:
            if not lowerable:
                reason = (f"applies `{eqn.primitive.name}` to the scores or to both "
                          "positions (Mosaic runs elementwise functions)")
                if "s" not in d and eqn.primitive.name in _LOOKUPS:
                    reason += (": an array looked up per pair runs in the kernels as "
                               "`bias=`, and one looked up by `kv_idx - q_idx` alone as a "
                               "RelativeScoreMod or as `score + table[h, f(kv_idx - q_idx)]` "
                               "(a soft cap on top as `softcap=`)")
                return reason
        elif not (lowerable and all(not isinstance(x, jex.core.Var) or x in available
                                    for x in eqn.invars)):
            in_kernel.append(False)
            continue
        for x in eqn.invars:
            needs(x)
        available.update(eqn.outvars)
        in_kernel.append(True)
    for x in jaxpr.outvars:
        needs(x)
    return in_kernel, boundary, dep


def _mixes_positions(eqn: Any, hit: list[bool]) -> str | None:
    """`eqn`, if it combines different positions of a position-dependent input (`hit`),
    so that its result is no longer one value per position: one that keeps its shape
    but runs along an axis (`_ALONG_AXES`), a gather from such a value (a gather at such
    indices keeps one value per index), a concatenation of more than single components,
    or any other that changes a tainted input's shape (nested jaxprs: their equations,
    by `first_mixing`)."""
    name = eqn.primitive.name
    if name in _NESTED:
        return None
    if name in _ALONG_AXES or (name == "gather" and hit[0]):
        return name
    if name == "concatenate":
        axis = eqn.params["dimension"]
        return name if any(x.aval.shape[axis] != 1 for x in eqn.invars) else None
    if name not in _PER_POSITION and name != "gather":
        shape = tuple(eqn.outvars[0].aval.shape)
        if any(h and not _broadcasts_to(tuple(x.aval.shape), shape)
               for x, h in zip(eqn.invars, hit, strict=True)):
            return name
    return None


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether an elementwise result of `target` keeps one value per position of an
    input of `shape` (same rank, every axis equal or broadcast from 1)."""
    return len(shape) == len(target) and all(a in (b, 1) for a, b in zip(shape, target,
                                                                          strict=True))


def _block_probe(roles: tuple[str, ...], groups: int, block_q: int, block_k: int,
                 dtype: Any) -> tuple[Any, ...]:
    shapes = {"s": ((groups, block_q, block_k), dtype), "b": ((groups, 1, 1), jnp.int32),
              "h": ((groups, 1, 1), jnp.int32), "q": ((1, block_q, 1), jnp.int32),
              "k": ((1, 1, block_k), jnp.int32)}
    return tuple(jax.ShapeDtypeStruct(*shapes[r]) for r in roles)


def analyse(name: str, fn: ModFn, arrays: Any, groups: int, block_q: int, block_k: int,
            dtype: Any, elementwise: frozenset[str]) -> Split | str:
    """`fn` (reading `arrays`) split for blocks of `(block_q, block_k)`, or why it
    cannot be."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
                            arrays)
    roles = _roles(name)
    try:
        closed = _trace(fn, _block_probe(roles, groups, block_q, block_k, dtype), abstract)
    except Exception:  # noqa: BLE001 - the families' own checks say what is wrong
        return f"a {name} that does not trace on a block"
    classified = _classify(closed, roles, elementwise)
    if isinstance(classified, str):
        return f"a {name} that {classified}"
    in_kernel, boundary, dep = classified
    positions = {v for v, r in zip(closed.jaxpr.invars, roles, strict=False)
                 if r in ("q", "k")}
    # (Only what runs outside is computed per block: the kernel's equations see tiles.)
    mixed = first_mixing(closed.jaxpr, positions, _mixes_positions, in_kernel)
    if mixed is not None and boundary:
        return f"a {name} whose arrays are read through `{mixed}` of positions"
    found = []
    for v in boundary:
        side = "q" if "q" in dep[v] else "k" if "k" in dep[v] else "bh"
        target = {"q": (groups, block_q, 1), "k": (groups, 1, block_k),
                  "bh": (groups, 1, 1)}[side]
        shape = tuple(v.aval.shape)
        try:
            fits = np.broadcast_shapes(shape, target) == target and len(shape) <= 3
        except ValueError:
            fits = False
        per_position = side == "bh" or (len(shape) == 3 and shape[1:] == target[1:])
        if not (fits and per_position):
            return (f"a {name} whose value read from its arrays has shape {shape} on a "
                    f"block (one per {'query' if side == 'q' else 'key'} is expected)")
        found.append(Boundary(side, jnp.dtype(v.aval.dtype), "b" in dep[v], "h" in dep[v]))
    one_sided = tuple(not eqn.outvars or not ("s" in dep[eqn.outvars[0]]
                                               or {"q", "k"} <= dep[eqn.outvars[0]])
                      for eqn in closed.jaxpr.eqns)
    return Split(name, closed, tuple(in_kernel), one_sided, tuple(boundary), tuple(found))


def _run(eqn: Any, env: dict[Any, Any]) -> None:
    """Bind one equation to the values in `env`, recording its outputs there."""
    ins = [x.val if isinstance(x, jex.core.Literal) else env[x] for x in eqn.invars]
    params = eqn.params
    get_bind_params = getattr(eqn.primitive, "get_bind_params", None)
    if get_bind_params is not None:
        got = get_bind_params(params)
        if isinstance(got, tuple):  # older jax: (sub-functions, params)
            subfuns, params = got
            ins = [*subfuns, *ins]
        else:
            params = got
    out = eqn.primitive.bind(*ins, **params)
    env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out],
                   strict=True))


def _as_int32(x: Array) -> Array:
    """A boundary value as the int32 a side operand holds (floats by their bits)."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    if x.dtype == jnp.uint32:
        return jax.lax.bitcast_convert_type(x, jnp.int32)
    return x.astype(jnp.int32)


def _from_int32(x: Array, dtype: Any) -> Array:
    if jnp.issubdtype(dtype, jnp.floating):
        return jax.lax.bitcast_convert_type(x, jnp.float32).astype(dtype)
    if jnp.dtype(dtype) == jnp.uint32:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if jnp.dtype(dtype) == jnp.bool_:
        return x != 0
    return x.astype(dtype)


def boundary_values(split: Split, arrays: Any, heads: tuple[int, ...],
                    padded_seq: tuple[int, int], blocks: tuple[int, int], dtype: Any,
                    indices: tuple[Array, Array] | None = None) -> list[Array]:
    """Every boundary value over every position, in its own dtype (differentiable in
    the arrays), in the GRID layout of a per-query `(b, h, g|1, seq_q, 1)` or per-key
    `(b, h, g|1, 1, seq_k)` operand (a "bh" value as a per-query one). `blocks`: those
    `split` was analysed at; `indices`: the positions' indices in the whole sequence
    (the ring's pieces: `Operands.q_index`/`kv_index`), else their own."""
    b, h, g = heads
    (seq_q, seq_k), (bq, bk) = padded_seq, blocks
    closed, boundary = split.closed, split.points
    leaves = jax.tree.leaves(arrays)
    if indices is None:
        q_idx, k_idx = (jnp.arange(n, dtype=jnp.int32) for n in (seq_q, seq_k))
    else:
        q_idx, k_idx = (x.reshape(-1).astype(jnp.int32) for x in indices)
    q_blocks, k_blocks = q_idx.reshape(-1, bq), k_idx.reshape(-1, bk)

    def outside(bi: Array, hi: Array, q_pos: Array, k_pos: Array) -> list[Array]:
        """The boundary values of the block pair at positions `(q_pos, k_pos)` of kv
        head `(bi, hi)`."""
        values = {"s": jnp.zeros((g, bq, bk), dtype),
                  "b": jnp.full((g, 1, 1), bi, jnp.int32),
                  "h": (hi * g + jnp.arange(g, dtype=jnp.int32)).reshape(g, 1, 1),
                  "q": q_pos.reshape(1, bq, 1), "k": k_pos.reshape(1, 1, bk)}
        env: dict[Any, Any] = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(closed.jaxpr.invars, [values[r] for r in split.roles] + leaves,
                       strict=True))
        for eqn, computable in zip(closed.jaxpr.eqns, split.one_sided, strict=True):
            if computable:
                _run(eqn, env)
        return [env[v] for v in boundary]

    def over(q_pos: Array, k_pos: Array) -> list[Array]:
        """Over the blocks of `q_pos` `(n, bq)` and `k_pos` `(n, bk)`, pairwise."""
        fn = jax.vmap(jax.vmap(jax.vmap(outside, (None, None, 0, 0)), (None, 0, None, None)),
                      (0, None, None, None))
        return fn(jnp.arange(b, dtype=jnp.int32), jnp.arange(h, dtype=jnp.int32), q_pos, k_pos)

    # (The other side at its first block: the values of one side do not depend on it.)
    by_query = over(q_blocks, jnp.broadcast_to(k_blocks[:1], (len(q_blocks), bk))) if any(
        x.side != "k" for x in split.boundary) else None
    by_key = over(jnp.broadcast_to(q_blocks[:1], (len(k_blocks), bq)), k_blocks) if any(
        x.side == "k" for x in split.boundary) else None
    found = []
    for n, (x, point) in enumerate(zip(split.boundary, boundary, strict=True)):
        if x.side == "k":
            assert by_key is not None
            v = jnp.broadcast_to(by_key[n], (b, h, seq_k // bk, *point.aval.shape))
            found.append(jnp.moveaxis(v, 2, 3).reshape(b, h, v.shape[3], 1, seq_k))
            continue
        assert by_query is not None
        v = jnp.broadcast_to(by_query[n], (b, h, seq_q // bq, *point.aval.shape))
        if x.side == "bh":
            found.append(_bh_over_queries(v, b, h, seq_q))
        else:
            found.append(jnp.moveaxis(v, 2, 3).reshape(b, h, v.shape[3], seq_q, 1))
    return found


def side_operands(split: Split, values: list[Array], suffix: str = ""
                  ) -> list[tuple[str, Array, bool]]:
    """`boundary_values` (or their tangents, `suffix="_tangent"`) as the kernels' side
    operands: `(name, int32 array, per query)`, kept once along the axes a value does
    not vary over."""
    return [(split.side_name(n) + suffix, _as_int32(_shared(v, x)), x.side != "k")
            for n, (x, v) in enumerate(zip(split.boundary, values, strict=True))]


def tangent_operands(split: Split, tangents: dict[int, Array]
                     ) -> list[tuple[str, Array, bool]]:
    """The tangents of floating boundary values (by index) as side operands."""
    return [(split.side_name(n) + "_tangent", _as_int32(_shared(v, split.boundary[n])),
             split.boundary[n].side != "k") for n, v in sorted(tangents.items())]


def floating(split: Split) -> list[int]:
    """The boundary values that carry gradients (the floating ones)."""
    return [n for n, x in enumerate(split.boundary) if jnp.issubdtype(x.dtype, jnp.floating)]


def _shared(v: Array, x: Boundary) -> Array:
    """`v` `(b, h, g|1, ...)` kept once along the axes `x` does not vary over (an
    operand broadcasts there: the kernels read it at index 0)."""
    if not x.batch:
        v = v[:1]
    if not x.head:
        v = v[:, :1, :1]
    return v


def _bh_over_queries(v: Array, b: int, h: int, seq_q: int) -> Array:
    """A per-(batch, head) value `(b, h, nq, *shape)` (broadcasting against `(g, 1, 1)`)
    as a per-query operand `(b, h, g|1, seq_q, 1)`."""
    first = v[:, :, 0]  # the same in every query block
    per_head = first.reshape(b, h, -1)  # (b, h, g|1)
    return jnp.broadcast_to(per_head[..., None, None], (*per_head.shape, seq_q, 1))


def read_values(split: Split, read: Callable[[str], Array], suffix: str = "",
                which: list[int] | None = None) -> list[Array]:
    """The boundary values on a tile (`read(name)`: an operand's row or column there),
    each with a leading axis of 1 for the block's groups (one element for a "bh" one),
    in its own dtype; `which`: those at these indices only; `suffix="_tangent"`: their
    tangents (floating ones only)."""
    values = []
    for n, (point, x) in enumerate(zip(split.points, split.boundary, strict=True)):
        if which is not None and n not in which:
            continue
        value = _from_int32(read(split.side_name(n) + suffix), x.dtype)
        rank = len(point.aval.shape)
        if x.side == "bh":  # the same over the tile: one element
            value = value.reshape(-1)[:1].reshape((1,) * rank)
        else:
            value = value[None]
        values.append(value.astype(point.aval.dtype))
    return values


def evaluate(split: Split, args: tuple[Array, ...], values: list[Array]) -> Array:
    """The function on a tile: `args` its arguments there, 2-D and broadcasting (scores,
    batch, head, query and key indices, queries along either axis), `values` its
    boundary values there (`read_values`). The kernel's equations of the block's jaxpr
    run on them, shape-generic (`_generic`): every value of the tile gets a leading axis
    of 1 for the block's groups, and broadcasts stand for the block's explicit ones."""
    jaxpr = split.closed.jaxpr
    env: dict[Any, Any] = {v: x[None] for v, x in zip(jaxpr.invars, args, strict=False)}
    env.update(zip(split.points, values, strict=True))
    for eqn, run in zip(jaxpr.eqns, split.in_kernel, strict=True):
        if run:
            _generic(eqn, env)
    (out,) = jaxpr.outvars
    result = out.val if isinstance(out, jex.core.Literal) else env[out]
    shape = np.broadcast_shapes(*(jnp.shape(x) for x in args))
    return jnp.broadcast_to(jnp.asarray(result), (1, *shape))[0]


def _generic(eqn: Any, env: dict[Any, Any]) -> None:
    """One elementwise equation on values of any broadcasting shapes: a broadcast keeps
    its operand (placing its axes), nested jaxprs run equation by equation, anything
    else runs on its operands broadcast to one shape."""
    ins = [x.val if isinstance(x, jex.core.Literal) else env[x] for x in eqn.invars]
    name = eqn.primitive.name
    if name == "broadcast_in_dim":
        x, rank = ins[0], len(eqn.params["shape"])
        if jnp.ndim(x) != rank:
            shape = [1] * rank
            for axis, d in zip(eqn.params["broadcast_dimensions"], jnp.shape(x), strict=True):
                shape[axis] = d
            x = jnp.reshape(x, shape)
        outs = [x]
    elif name in _NESTED:
        closed = next(p for p in eqn.params.values()
                      if isinstance(p, jex.core.ClosedJaxpr)
                      and len(p.jaxpr.invars) == len(ins))
        inner: dict[Any, Any] = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
        inner.update(zip(closed.jaxpr.invars, ins, strict=True))
        for sub in closed.jaxpr.eqns:
            _generic(sub, inner)
        outs = [x.val if isinstance(x, jex.core.Literal) else inner[x]
                for x in closed.jaxpr.outvars]
    else:
        arrays = [x for x in ins if jnp.ndim(x) > 0]
        if len(arrays) > 1:
            shape = np.broadcast_shapes(*(jnp.shape(x) for x in arrays))
            ins = [jnp.broadcast_to(x, shape) if jnp.ndim(x) > 0 else x for x in ins]
        params = dict(eqn.params)
        if "shape" in params:  # (a primitive taking its result's shape: not elementwise)
            raise NotImplementedError(f"`{name}` in a split mod's kernel part")
        out = eqn.primitive.bind(*ins, **params)
        outs = out if eqn.primitive.multiple_results else [out]
    env.update(zip(eqn.outvars, outs, strict=True))
