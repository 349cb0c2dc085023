"""`custom_linear`: a custom-VJP function (the ring) given a forward mode of its own.

JAX lets a function have a custom VJP or a custom JVP, not both. `custom_linear` wraps a
function with a hand-written backward in a `custom_jvp` whose tangent is `_linear_p`:
evaluating it runs the wrapper's `tangent` rule, and transposing it runs the function's
own backward rule, so `jax.grad` is what it was.

A derivative of either rule along the residuals would be second order: the residuals pass
through `stop_gradient`, guarded (`guard`) by the wrapper's `second_order_message`, so a
second-order term raises it instead of going silently missing.
"""

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from .batching import batch_by_map
from .guard import add_guard_tangent, derivative_guard, is_zero_tangent


def _run_linear(*args, num_in, num_out, bwd, res_tree, which, second_order_message, tangent):
    """The tangents of the outputs for the non-zero input tangents (after the residuals
    and the outputs)."""
    del bwd, which, second_order_message
    residuals, _ = jax.tree.unflatten(res_tree, args[:num_in])
    return tangent(residuals, list(args[num_in + num_out :]))


_linear_p = Primitive("eqx_flash_custom_linear")
_linear_p.multiple_results = True
_linear_p.def_impl(_run_linear)
mlir.register_lowering(_linear_p, mlir.lower_fun(_run_linear, multiple_results=True))


def _abstract_eval(*args, num_in, num_out, **params):
    del params
    return list(args[num_in : num_in + num_out])  # the outputs, after the residuals


def _jvp(primals, tangents, **params):
    num_in, num_out = params["num_in"], params["num_out"]
    out = _linear_p.bind(*primals, **params)
    # Residuals and outputs passed through stop_gradient, except the guard `z`, the last
    # residual: its tangent is the second-order term.
    if not all(is_zero_tangent(t) for t in tangents[: num_in - 1]):
        raise NotImplementedError(params["second_order_message"])
    lin_t = tangents[num_in + num_out :]
    z_t = tangents[num_in - 1]
    if all(type(t) is ad.Zero for t in lin_t):
        if is_zero_tangent(z_t):
            return out, [ad.Zero(jax.typeof(x).to_tangent_aval()) for x in out]
        out_t = [jnp.zeros_like(x) for x in out]
    else:  # linear in its linear inputs
        out_t = _linear_p.bind(*primals[: num_in + num_out], *map(ad.instantiate_zeros, lin_t),
                               **params)
    return out, add_guard_tangent(out_t, z_t)


def _transpose(cts, *args, num_in, num_out, bwd, res_tree, which, second_order_message,
               tangent):
    del tangent
    residuals, z = jax.tree.unflatten(res_tree, args[:num_in])
    outs = [jax.typeof(x) for x in args[num_in : num_in + len(cts)]]
    cts = [ad.zeros_like_aval(a) if type(ct) is ad.Zero else ct
           for ct, a in zip(cts, outs, strict=True)]
    grads = bwd(residuals, [jax.lax.stop_gradient(ct) for ct in cts])
    chosen = [g for g, w in zip(grads, which, strict=True) if w]
    # The cotangents may depend on the inputs too (a gradient of a gradient).
    z = z + derivative_guard(second_order_message, chosen[0].dtype, *cts)
    chosen = [g + z.astype(g.dtype) for g in chosen]
    return [None] * (num_in + num_out) + chosen


_linear_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[_linear_p] = _jvp
ad.primitive_transposes[_linear_p] = _transpose
batching.primitive_batchers[_linear_p] = batch_by_map(_linear_p)


def _flat_cotangents(bwd, static, out_tree, diff_tree, wanted, residuals, cts):
    """The cotangents of the differentiable arguments' leaves, flattened (None where
    `bwd` computed none because nobody asked for it)."""
    grads = bwd(static, residuals, jax.tree.unflatten(out_tree, cts), wanted)
    return diff_tree.flatten_up_to(tuple(grads))


def _flat_tangents(tangent, static, diff_tree, which, residuals, nonzero):
    """The outputs' tangents, flattened, for the non-zero tangents `nonzero` of the
    differentiable arguments' leaves `which` marks (None for the others)."""
    it = iter(nonzero)
    tangents = jax.tree.unflatten(diff_tree, [next(it) if w else None for w in which])
    return jax.tree.leaves(tangent(static, residuals, tangents))


def custom_linear(
    attention: Callable[..., Any],
    residuals: Callable[..., Any],
    bwd: Callable[..., Any],
    tangent: Callable[..., Any],
    num_diff: int,
    second_order_message: str,
) -> Callable[..., Any]:
    """Wrap `attention(static, *args) -> outputs` (its first `num_diff` arguments are the
    differentiable ones, possibly pytrees) so that reverse mode runs `bwd(static,
    residuals(static, args, outputs), cotangents, wanted)` and forward mode
    `tangent(static, residuals, tangents)` (the outputs' tangents; `tangents` shaped as
    the differentiable arguments, None where zero).
    `wanted` is the differentiable arguments' structure with a bool per leaf (has it a
    non-zero tangent?), so that `bwd` can skip the cotangents nobody asked for (a
    constant bias costs a reduction per block); `bwd` returns the cotangents of those
    arguments, None where not wanted. A second-order derivative raises
    `second_order_message`."""

    @functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
    def wrapped(static, *args):
        return attention(static, *args)

    @functools.partial(wrapped.defjvp, symbolic_zeros=True)
    def wrapped_jvp(static, args, tangents):
        outs = wrapped(static, *args)
        tangent_leaves, tangent_tree = jax.tree.flatten(
            tangents[:num_diff], is_leaf=lambda t: type(t) is SymbolicZero
        )
        which = tuple(type(t) is not SymbolicZero for t in tangent_leaves)
        wanted = jax.tree.unflatten(tangent_tree, which)
        nonzero = [t for t, w in zip(tangent_leaves, which, strict=True) if w]
        if not nonzero:
            return outs, jax.tree.map(jnp.zeros_like, outs)
        out_leaves, out_tree = jax.tree.flatten(outs)
        saved = jax.tree.map(jax.lax.stop_gradient, residuals(static, args, outs))
        # Zero, with a derivative that raises: the second-order term dropped above.
        z = derivative_guard(second_order_message, out_leaves[0].dtype,
                             *jax.tree.leaves(args[:num_diff]))
        res_flat, res_tree = jax.tree.flatten((saved, z))
        # Operands: residuals, then the outputs again (for their avals), then tangents.
        flat = [*res_flat, *(jax.lax.stop_gradient(x) for x in out_leaves), *nonzero]
        d_outs = _linear_p.bind(
            *flat, num_in=len(res_flat), num_out=len(out_leaves),
            bwd=functools.partial(_flat_cotangents, bwd, static, out_tree, tangent_tree,
                                  wanted),
            res_tree=res_tree, which=which, second_order_message=second_order_message,
            tangent=functools.partial(_flat_tangents, tangent, static, tangent_tree, which),
        )
        return outs, jax.tree.unflatten(out_tree, d_outs)

    return wrapped
