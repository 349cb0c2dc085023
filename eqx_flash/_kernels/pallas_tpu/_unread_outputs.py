"""A kernel call that does not write the optional results its program never reads.

A `pallas_call` cannot drop an output: its dead-code rule keeps every one, so the
forward kernel would write its lane-replicated lse and max scores (each four times the
bytes of a bf16 output of head dim 128) in a program that reads only the output
(inference, a forward-only benchmark) or only the output and the lse (a gradient).
`unread_outputs_p` wraps such a call: when a compiled program's dead-code elimination
(`jax.jit` runs it at lowering, through `jit`, `custom_jvp`, `cond`, `scan`) finds some of
its optional results unread, its rule rebuilds the call with `written` saying which to
write, and the kernel writes only those. Nothing changes where every result is read, or
in an eager call.

The call is bound only outside a mesh (`_core.compat.unsharded`): under `shard_map` the
results' types would have to carry the inputs' varying axes, which `pallas_call` already
does for itself, so there the call runs as it is, writing every result. So it is where
`run` reads a traced value it was not given (one it closes over: the rebuilt call runs
after that trace has ended).
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.core import ShapedArray, Tracer
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jaxtyping import Array

from ..._core.compat import register_dce_rule, unsharded

# `run(*arrays, written=...)`: the call writing the results `written` marks (a bool per
# result), returned in order.
Run = Callable[..., Sequence[Array]]


def call_writing_read_results(run: Run, arrays: Sequence[Array], results: int,
                              optional: Sequence[int]) -> list[Array]:
    """`run(*arrays, written=(True,) * results)`, as a call whose `optional` results
    are not written where a compiled program never reads them."""
    every = (True,) * results
    if not optional or not all(unsharded(x) for x in arrays):
        return list(run(*arrays, written=every))
    traced = jax.make_jaxpr(functools.partial(run, written=every))(*arrays)
    if any(isinstance(c, Tracer) for c in traced.consts):
        return list(run(*arrays, written=every))
    return unread_outputs_p.bind(*arrays, run=run, written=every,
                                 optional=frozenset(optional),
                                 avals=tuple(traced.out_avals))


unread_outputs_p = Primitive("eqx_flash_unread_outputs")
unread_outputs_p.multiple_results = True


# Parameters: `run`, `written` (a bool per result of the whole call: those it writes and
# returns), `optional` (the results it may leave unwritten), `avals` (every result's type).


def _impl(*arrays, run: Run, written: tuple[bool, ...], **_):
    return list(run(*arrays, written=written))


def _abstract_eval(*_, written: tuple[bool, ...], avals: tuple[Any, ...], **__):
    return [a for a, w in zip(avals, written, strict=True) if w]


def _dce(used: list[bool], eqn: Any) -> tuple[list[bool], Any]:
    """Stop writing the optional results nobody reads (the call has no effects: unread
    altogether, it goes)."""
    if not any(used):
        return [False] * len(eqn.invars), None
    written, optional = eqn.params["written"], eqn.params["optional"]
    indices = [i for i, w in enumerate(written) if w]  # the results the eqn returns
    dropped = {i for i, read in zip(indices, used, strict=True)
               if not read and i in optional}
    if not dropped:
        return [True] * len(eqn.invars), eqn
    outvars = [var for i, var in zip(indices, eqn.outvars, strict=True) if i not in dropped]
    params = dict(eqn.params, written=tuple(w and i not in dropped
                                            for i, w in enumerate(written)))
    return [True] * len(eqn.invars), eqn.replace(outvars=outvars, params=params)


class _Mapped:
    """`run` under `jax.vmap` along `in_axes` (results batched along their first axis)."""

    def __init__(self, run: Run, in_axes: tuple[int | None, ...]):
        self.run, self.in_axes = run, in_axes

    def __call__(self, *arrays, written: tuple[bool, ...]) -> list[Array]:
        return list(jax.vmap(functools.partial(self.run, written=written),
                             in_axes=self.in_axes)(*arrays))


def _batch(arrays, dims, *, run: Run, written: tuple[bool, ...], optional: frozenset[int],
           avals: tuple[Any, ...]):
    mapped = _Mapped(run, tuple(dims))  # (None: not mapped)
    size = next(x.shape[d] for x, d in zip(arrays, dims, strict=True) if d is not None)
    avals = tuple(ShapedArray((size, *a.shape), a.dtype) for a in avals)
    results = unread_outputs_p.bind(*arrays, run=mapped, written=written,
                                    optional=optional, avals=avals)
    return results, [0] * len(results)


unread_outputs_p.def_impl(_impl)
unread_outputs_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(unread_outputs_p, mlir.lower_fun(_impl, multiple_results=True))
batching.primitive_batchers[unread_outputs_p] = _batch
register_dce_rule(unread_outputs_p, _dce)
