"""The linear primitive: the tangent kernel one way, the backward kernel the other.

`linear_p` does what `jax.custom_derivatives.linear_call(tangent_fn, backward_fn,
residuals, tangents)` does, plus a batching rule (linear_call has none, so `jax.jacfwd`,
`jax.hessian` and `vmap` of a gradient would fail), zero handling, and a JVP rule with
respect to its residuals (linear_call requires they carry no tangent).

Operands: the `Residuals` flattened, then the linear inputs. `which` marks the
differentiable leaves with a non-zero tangent. `transposed=False` maps those tangents to
`(d_out, d_lse)` with the tangent kernel; `transposed=True` maps cotangents `(d_out,
d_lse)` to those of the marked leaves with the backward kernel, which accumulates only
those (a constant bias or frozen score_mod costs nothing). Each is the other's transpose.

Its JVP along the differentiable residuals is the second-order primitive
(`second_order`): the saved `out` and `lse` are functions of those, and their own
tangents (`T(x; w)`) are handed to it only to save recomputing them. The constant
operands have no floating leaves, hence no tangents.
"""

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jaxtyping import Array

from .._core.config import KernelConfig
from .batching import batch_by_map
from .guard import THIRD_ORDER_MESSAGE, derivative_guard, is_zero_tangent
from .residuals import (
    Residuals,
    apply_backward,
    apply_tangent,
    differentiable_leaves,
    marked,
)
from .second_order import second_order


def _linear_fn(*args, cfg: KernelConfig, which, res_tree, transposed: bool):
    res = jax.tree.unflatten(res_tree, args[: res_tree.num_leaves])
    linear = args[res_tree.num_leaves :]
    if transposed:
        return apply_backward(cfg, res, which, linear)
    return apply_tangent(cfg, res, which, linear)


linear_p = Primitive("eqx_flash_attention_linear")
linear_p.multiple_results = True
linear_p.def_impl(_linear_fn)
mlir.register_lowering(linear_p, mlir.lower_fun(_linear_fn, multiple_results=True))


def _linear_abstract_eval(*args, cfg, which, res_tree, transposed):
    del cfg
    res = jax.tree.unflatten(res_tree, args[: res_tree.num_leaves])
    # The residuals' own avals: same shapes and dtypes, and under shard_map the same
    # varying axes.
    if transposed:
        return marked(differentiable_leaves(res), which)
    return [res.out, res.lse]


linear_p.def_abstract_eval(_linear_abstract_eval)


def _linear_jvp(primals, tangents, *, cfg, which, res_tree, transposed):
    params = dict(cfg=cfg, which=which, res_tree=res_tree, transposed=transposed)
    n = res_tree.num_leaves
    out = linear_p.bind(*primals, **params)
    terms = []
    lin, lin_t = primals[n:], tangents[n:]
    if not all(type(t) is ad.Zero for t in lin_t):  # linear in its linear inputs
        terms.append(linear_p.bind(*primals[:n], *map(ad.instantiate_zeros, lin_t), **params))
    res = jax.tree.unflatten(res_tree, primals[:n])
    # The residuals' flat positions (the tangents may hold symbolic zeros, not leaves).
    position = jax.tree.unflatten(res_tree, range(n))
    res_t = [tangents[i] for i in differentiable_leaves(position)]
    moved = tuple(not is_zero_tangent(t) for t in res_t)
    if any(moved):  # along its residuals: second order
        stopped = jax.tree.map(jax.lax.stop_gradient, res)
        z = derivative_guard(THIRD_ORDER_MESSAGE, res.lse.dtype,
                             *marked(differentiable_leaves(res), moved))
        mode = "backward" if transposed else "tangent"
        # The saved out and lse move by T(x; w): their tangents, when JAX has them.
        d_saved = [tangents[position.out], tangents[position.lse]]
        given = None if any(type(t) is ad.Zero for t in d_saved) else d_saved
        terms.append(second_order(cfg, mode, which, moved, (stopped, z), lin,
                                  marked(res_t, moved), given))
    if not terms:
        return out, [ad.Zero(jax.typeof(x).to_tangent_aval()) for x in out]
    return out, [sum(ts[1:], ts[0]) for ts in zip(*terms, strict=True)]


def _linear_transpose(cts, *args, **params):
    num_res = params["res_tree"].num_leaves
    residuals, linear = args[:num_res], args[num_res:]
    assert not any(ad.is_undefined_primal(x) for x in residuals)
    if all(type(ct) is ad.Zero for ct in cts):
        return [None] * len(args)
    out_avals = _linear_abstract_eval(
        *(jax.typeof(x) for x in residuals),
        *(x.aval if ad.is_undefined_primal(x) else jax.typeof(x) for x in linear),
        **params,
    )
    cts = [ad.zeros_like_aval(a) if type(ct) is ad.Zero else ct
           for ct, a in zip(cts, out_avals, strict=True)]
    flipped = dict(params, transposed=not params["transposed"])
    lin_cts = linear_p.bind(*residuals, *cts, **flipped)
    # A linear operand that is a known value (an instantiated zero) gets no cotangent.
    lin_cts = [ct if ad.is_undefined_primal(x) else None
               for ct, x in zip(lin_cts, linear, strict=True)]
    return [None] * num_res + lin_cts


ad.primitive_jvps[linear_p] = _linear_jvp
ad.primitive_transposes[linear_p] = _linear_transpose
batching.primitive_batchers[linear_p] = batch_by_map(linear_p)


def linear(cfg: KernelConfig, which: tuple[bool, ...], residuals: Residuals,
           nonzero: tuple[Array, ...]) -> list[Array]:
    """`(d_out, d_lse)` for the non-zero tangents `nonzero` (the leaves `which` marks)."""
    flat, res_tree = jax.tree.flatten(residuals)
    return linear_p.bind(*flat, *nonzero, cfg=cfg, which=which, res_tree=res_tree,
                         transposed=False)
