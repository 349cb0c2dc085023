"""A `score_mod` that adds a lookup by the offset `kv_idx - q_idx` alone, recognised as
the `RelativeScoreMod` it is.

FlexAttention's relative-position examples write a learned bias as a plain function:
`score + table[h, clip(kv_idx - q_idx)]`. That is a lookup by both positions, which the
Pallas TPU kernels cannot read per tile. Written as a `RelativeScoreMod` they read it as
a Toeplitz term (`_kernels/pallas_tpu/_relative.py`). `offset_lookup` finds that form
in the function's jaxpr and wraps it (`OffsetLookup`): the same values in every family,
bit for bit, and the Pallas kernels then run it with its arrays' gradient and tangent.

The form, checked on the jaxpr (anything else is left as it is):

- the output is `score + x` (or `x + score`), `x` of the scores' dtype;
- `x` depends on the head and on the positions only through `kv_idx - q_idx` or
  `q_idx - kv_idx`, taken on the positions themselves (broadcast against each other at
  most, every axis in place), and not on the scores or the batch;
- `x` reads an array through a gather (a lookup): a function of the offset computed by
  arithmetic alone runs in the kernels as it is, at no cost per offset;
- the function closes over no traced values.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.extend as jex
import jax.numpy as jnp
from jaxtyping import Array

from .position_bias import RelativeScoreMod
from .tracing import StaticValue, split_mod, sub_jaxprs

_LOOKUPS = frozenset({"gather", "dynamic_slice"})


class OffsetLookup(RelativeScoreMod):
    """A user's `score_mod` of the form `score + x(head, kv_idx - q_idx)` (`offset_lookup`),
    as a `RelativeScoreMod`: `bias` evaluates it on zero scores at query 0. Its arrays
    are leaves (they train), the rest of it static."""

    arrays: Any
    rest: StaticValue = eqx.field(static=True)

    @property
    def mod(self) -> Callable[..., Array]:
        return eqx.combine(self.arrays, self.rest.value)

    def bias(self, head: Array, relative: Array) -> Array:
        shape = jnp.broadcast_shapes(jnp.shape(head), jnp.shape(relative))
        zero = jnp.zeros(shape, jnp.float32)
        return self.mod(zero, jnp.zeros_like(head), head, jnp.zeros_like(relative), relative)

    def __call__(self, score: Array, batch: Array, head: Array, q_idx: Array,
                 kv_idx: Array) -> Array:
        return self.mod(score, batch, head, q_idx, kv_idx)  # (the user's own, as it is)


def offset_lookup(mod: Any, probe: tuple[Any, ...]) -> OffsetLookup | None:
    """`mod` wrapped as an `OffsetLookup` where it has that form on the block `probe`
    (`tracing.block_probe`), else None."""
    if mod is None or isinstance(mod, RelativeScoreMod) or not callable(mod):
        return None
    try:
        fn, closed, arrays = split_mod("score_mod", mod, probe)
    except Exception:  # noqa: BLE001 - the families' own checks say what is wrong
        return None
    if fn.traced or not _has_the_form(closed.jaxpr):  # (traced: closes over tracers)
        return None
    return OffsetLookup(arrays, fn.static)


def _has_the_form(jaxpr: Any) -> bool:
    if len(jaxpr.outvars) != 1 or len(jaxpr.invars) < 5:
        return False
    score, _, head, q_idx, kv_idx = jaxpr.invars[:5]
    deps: dict[Any, frozenset[str]] = {score: frozenset({"s"}), jaxpr.invars[1]:
                                       frozenset({"b"}), head: frozenset({"h"}),
                                       q_idx: frozenset({"q"}), kv_idx: frozenset({"k"})}
    side = {q_idx: "q", kv_idx: "k"}  # the positions and their shape-only copies
    lookups: set[Any] = set()  # the values a lookup reached

    def dep(x: Any) -> frozenset[str]:
        return deps.get(x, frozenset()) if isinstance(x, jex.core.Var) else frozenset()

    for eqn in jaxpr.eqns:
        ins = [x for x in eqn.invars if isinstance(x, jex.core.Var)]
        name = eqn.primitive.name
        if name == "broadcast_in_dim" and ins and ins[0] in side and tuple(
                eqn.params["broadcast_dimensions"]) == tuple(range(_rank(ins[0]))):
            # (a broadcast against the other side's positions, every axis in place: a
            # difference of two such is the pair's offset)
            side[eqn.outvars[0]] = side[ins[0]]
        if (name == "sub" and len(ins) == 2 and all(x in side for x in ins)
                and {side[ins[0]], side[ins[1]]} == {"q", "k"}):
            d = frozenset({"d"})  # the offset, one way or the other
        else:
            d = frozenset().union(*(dep(x) for x in ins))
        looked_up = _reads_by_lookup(eqn) or any(x in lookups for x in ins)
        for out in eqn.outvars:
            deps[out] = d
            if looked_up:
                lookups.add(out)
    out = jaxpr.outvars[0]
    last = next((e for e in reversed(jaxpr.eqns) if out in e.outvars), None)
    if last is None or last.primitive.name != "add":
        return False
    a, b = last.invars
    term = b if a is score else a if b is score else None
    if not isinstance(term, jex.core.Var):
        return False
    dtype = getattr(term.aval, "dtype", None)
    return ("d" in deps[term] and deps[term] <= {"h", "d"} and term in lookups
            and dtype is not None and dtype == getattr(score.aval, "dtype", None))


def _reads_by_lookup(eqn: Any) -> bool:
    if eqn.primitive.name in _LOOKUPS:
        return True
    return any(_reads_by_lookup(e) for sub in sub_jaxprs(eqn.params) for e in sub.eqns)


def _rank(x: Any) -> int:
    return len(getattr(x.aval, "shape", ()))
