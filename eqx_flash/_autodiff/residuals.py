"""What the derivative primitives carry, and the two kernels they apply.

`Residuals` is what the derivative rule (`derivatives`) saves from the forward: the
padded internal-layout q, k, v, the forward's `out` and `lse`, and the operands split
into their differentiable and constant parts. Its *differentiable leaves* are those of
`(q, k, v, diff)`; the primitives (`linear`, `second_order`) mark a subset of them with
a tuple of bools (`which`), and take or give arrays for the marked ones only, so zero
tangents and unwanted cotangents cost nothing.

`apply_tangent` (the tangent kernel: the first derivative along marked tangents) and
`apply_backward` (the backward kernel: the transposed first derivative, returning the
marked cotangents) are the two first-order maps; every rule is built from them. The
kernels are those of the family the configuration records (`_kernels.dispatch.family_of`).
"""

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._core.config import KernelConfig
from .._core.operands import Operands, combine, replace
from .._kernels.dispatch import family_of
from .._semantics.softmax import backward_statistics


class Residuals(NamedTuple):
    q: Array
    k: Array
    v: Array
    out: Array
    lse: Array
    diff: Operands  # the differentiable operands (`_core.operands.differentiable_part`)
    const: Operands


def differentiable(res: Residuals) -> tuple[Any, ...]:
    """The differentiable inputs `(q, k, v, diff)`."""
    return res.q, res.k, res.v, res.diff


def differentiable_leaves(res: Residuals) -> list[Any]:
    return jax.tree.leaves(differentiable(res))


def marked(leaves: Sequence[Any], which: Sequence[bool]) -> list[Any]:
    return [x for x, w in zip(leaves, which, strict=True) if w]


def with_differentiable(res: Residuals, which: Sequence[bool], new: Sequence[Any]) -> Residuals:
    """`res` with its marked differentiable leaves replaced by `new`."""
    tree = jax.tree.structure(differentiable(res))
    it = iter(new)
    leaves = [next(it) if w else x
              for x, w in zip(differentiable_leaves(res), which, strict=True)]
    q, k, v, diff = jax.tree.unflatten(tree, leaves)
    return res._replace(q=q, k=k, v=v, diff=diff)


def _zero_tangents_filled(d_arrays: Any, arrays: Any) -> Any:
    """A score_mod's arrays are differentiated together: zeros where a tangent is None,
    or None when all are."""
    if all(t is None for t in jax.tree.leaves(d_arrays, is_leaf=lambda t: t is None)):
        return None
    return jax.tree.map(lambda t, x: t if t is not None or x is None else jnp.zeros_like(x),
                        d_arrays, arrays, is_leaf=lambda t: t is None)


def apply_tangent(cfg: KernelConfig, res: Residuals, which: Sequence[bool],
                  tangents: Sequence[Array]) -> list[Array]:
    """`[d_out, d_lse]` for tangents of the marked differentiable leaves (the others
    zero; the kernel skips what they would cost)."""
    dq, dk, dv, d_diff = _tangent_arguments(res, which, tangents)
    ops = combine(res.diff, res.const)
    return list(family_of(cfg).tangent(cfg, res.q, res.k, res.v, ops, res.out, res.lse, dq,
                                       dk, dv, d_diff))


def apply_forward_and_tangent(cfg: KernelConfig, primals: Residuals, which: Sequence[bool],
                              tangents: Sequence[Array]) -> list[Array]:
    """`[out, lse, max_score, d_out, d_lse]` in one pass (`primals`' `out` and `lse` are
    not read: they are what this computes)."""
    dq, dk, dv, d_diff = _tangent_arguments(primals, which, tangents)
    ops = combine(primals.diff, primals.const)
    return list(family_of(cfg).forward_and_tangent(cfg, primals.q, primals.k, primals.v, ops,
                                                   dq, dk, dv, d_diff))


def _tangent_arguments(res: Residuals, which: Sequence[bool], tangents: Sequence[Array]
                       ) -> tuple[Any, Any, Any, Any]:
    """`(dq, dk, dv, d_diff)` from the tangents of the marked leaves (None where zero)."""
    tree = jax.tree.structure(differentiable(res))
    it = iter(tangents)
    dq, dk, dv, d_diff = jax.tree.unflatten(tree, [next(it) if w else None for w in which])
    if isinstance(d_diff, Operands) and d_diff.score_mod_arrays is not None:
        d_diff = replace(d_diff, score_mod_arrays=_zero_tangents_filled(
            d_diff.score_mod_arrays, res.diff.score_mod_arrays))
    return dq, dk, dv, d_diff


def apply_backward(cfg: KernelConfig, res: Residuals, which: Sequence[bool],
                   cotangents: Sequence[Array]) -> list[Array]:
    """The cotangents of the marked differentiable leaves, for cotangents `(d_out,
    d_lse)` of the outputs."""
    d_out, d_lse = cotangents
    tree = jax.tree.structure(differentiable(res))
    safe_lse, delta = backward_statistics(res.out, res.lse, d_out, d_lse)
    wanted = jax.tree.unflatten(tree, list(which))[3]
    ops = combine(res.diff, res.const)
    grads = family_of(cfg).backward(cfg, res.q, res.k, res.v, ops, safe_lse, delta, d_out,
                                    wanted)
    return marked(tree.flatten_up_to(grads), which)
