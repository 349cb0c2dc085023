"""`reverse_only`: a custom-VJP function (the ring) whose forward mode raises a clear error.

A `custom_vjp` function has no forward mode, and JAX's error ("can't apply forward-mode
autodiff (jvp) to a custom_vjp function") does not say which function or what to do.
`reverse_only` wraps one in a `custom_jvp` whose tangent is `_reverse_only_p`: evaluating
or compiling it raises the wrapper's message, and transposing it runs the function's own
backward rule, so `jax.grad` is what it was. A derivative of that gradient would have to
differentiate the backward rule itself (loops JAX cannot reverse): its inputs pass
through `stop_gradient`, guarded (`guard`) by the wrapper's `second_order_message`.
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
from .guard import derivative_guard


def _reverse_only_fail(*args, message, **params):
    del args, params
    raise NotImplementedError(message)


_reverse_only_p = Primitive("eqx_flash_reverse_only")
_reverse_only_p.multiple_results = True
_reverse_only_p.def_impl(_reverse_only_fail)
mlir.register_lowering(
    _reverse_only_p, lambda ctx, *args, **params: _reverse_only_fail(**params)
)


def _reverse_only_abstract_eval(*args, num_in, num_out, message, bwd, res_tree, which,
                                second_order_message):
    del message, bwd, res_tree, which, second_order_message
    return list(args[num_in : num_in + num_out])  # the outputs, after the residuals


def _reverse_only_jvp(primals, tangents, *, message, **params):
    del primals, tangents, params
    raise NotImplementedError(message)


def _reverse_only_transpose(cts, *args, num_in, num_out, message, bwd, res_tree, which,
                            second_order_message):
    del message
    num_res = res_tree.num_leaves
    residuals = jax.tree.unflatten(res_tree, args[:num_res])
    outs = [jax.typeof(x) for x in args[num_in : num_in + len(cts)]]
    cts = [ad.zeros_like_aval(a) if type(ct) is ad.Zero else ct
           for ct, a in zip(cts, outs, strict=True)]
    grads = bwd(*jax.tree.map(jax.lax.stop_gradient, (residuals, cts)))
    chosen = [g for g, w in zip(grads, which, strict=True) if w]
    z = derivative_guard(second_order_message, chosen[0].dtype,
                         *jax.tree.leaves((residuals, cts)))
    chosen = [g + z.astype(g.dtype) for g in chosen]
    return [None] * (num_res + num_out) + chosen


_reverse_only_p.def_abstract_eval(_reverse_only_abstract_eval)
ad.primitive_jvps[_reverse_only_p] = _reverse_only_jvp
ad.primitive_transposes[_reverse_only_p] = _reverse_only_transpose
batching.primitive_batchers[_reverse_only_p] = batch_by_map(_reverse_only_p)


def _flat_cotangents(bwd, static, out_tree, diff_tree, wanted, residuals, cts):
    """The cotangents of the differentiable arguments' leaves, flattened (None where
    `bwd` computed none because nobody asked for it)."""
    grads = bwd(static, residuals, jax.tree.unflatten(out_tree, cts), wanted)
    return diff_tree.flatten_up_to(tuple(grads))


def reverse_only(
    attention: Callable[..., Any],
    residuals: Callable[..., Any],
    bwd: Callable[..., Any],
    message: str,
    num_diff: int,
    second_order_message: str,
) -> Callable[..., Any]:
    """Wrap `attention(static, *args) -> (out, lse)` (its first `num_diff` arguments are
    the differentiable ones, possibly pytrees) so that `jax.jvp` raises `message` and
    reverse mode runs `bwd(static, residuals(static, args, outputs), cotangents,
    wanted)`. `wanted` is the differentiable arguments' structure with a bool per leaf
    (has it a non-zero tangent?), so that `bwd` can skip the cotangents nobody asked for
    (a constant bias costs a reduction per block); `bwd` returns the cotangents of those
    arguments, None where not wanted. A derivative of the gradient raises
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
        out_leaves, out_tree = jax.tree.flatten(outs)
        res_flat, res_tree = jax.tree.flatten(residuals(static, args, outs))
        # Operands: residuals, then the outputs again (for their avals), then tangents.
        flat = [*res_flat, *(jax.lax.stop_gradient(x) for x in out_leaves), *nonzero]

        if not nonzero:
            return outs, jax.tree.map(jnp.zeros_like, outs)
        d_outs = _reverse_only_p.bind(
            *flat, num_in=len(res_flat), num_out=len(out_leaves), message=message,
            bwd=functools.partial(_flat_cotangents, bwd, static, out_tree, tangent_tree,
                                  wanted),
            res_tree=res_tree, which=which, second_order_message=second_order_message,
        )
        return outs, jax.tree.unflatten(out_tree, d_outs)

    return wrapped
