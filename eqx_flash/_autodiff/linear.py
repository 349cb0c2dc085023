"""The linear primitive: the tangent kernel one way, the backward kernel the other.

`linear_p` does what `jax.custom_derivatives.linear_call(tangent_fn, backward_fn,
residuals, tangents)` does, plus a batching rule (linear_call has none, so `jax.jacfwd`,
`jax.hessian` and `vmap` of a gradient would fail) and zero handling in its JVP.

Operands: the residuals `(q, k, v, out, lse, diff, const, z)` flattened — `diff` and
`const` the differentiable and the constant `Operands`, `z` the second-order guard
(`second_order`) — then the linear inputs. The differentiable inputs are `(q, k, v,
diff)`, and `which` marks their leaves with a non-zero tangent. `transposed=False` maps
those tangents to `(d_out, d_lse)` with the tangent kernel; `transposed=True` maps
cotangents `(d_out, d_lse)` to those of the marked leaves with the backward kernel,
which accumulates only those (a constant bias or frozen score_mod costs nothing). Each
is the other's transpose.
"""

from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jaxtyping import Array

from .._core.config import KernelConfig
from .._core.operands import Operands, combine, replace
from .._kernels.backward import backward, backward_statistics
from .._kernels.tangent import tangent
from .batching import batch_by_map
from .second_order import SECOND_ORDER_MESSAGE


def _differentiable(residuals: tuple[Any, ...]) -> tuple[Any, ...]:
    """The differentiable inputs `(q, k, v, diff)` among the residuals."""
    q, k, v, _, _, diff = residuals[:6]
    return q, k, v, diff


def _zero_tangents_filled(d_arrays: Any, arrays: Any) -> Any:
    """A score_mod's arrays are differentiated together: zeros where a tangent is None,
    or None when all are."""
    if all(t is None for t in jax.tree.leaves(d_arrays, is_leaf=lambda t: t is None)):
        return None
    return jax.tree.map(lambda t, x: t if t is not None or x is None else jnp.zeros_like(x),
                        d_arrays, arrays, is_leaf=lambda t: t is None)


def _linear_fn(*args, cfg: KernelConfig, which, res_tree, transposed: bool):
    residuals = jax.tree.unflatten(res_tree, args[: res_tree.num_leaves])
    linear = args[res_tree.num_leaves :]
    q, k, v, out, lse, diff, const, _ = residuals  # last: the guard `z`
    ops = combine(diff, const)
    diff_tree = jax.tree.structure(_differentiable(residuals))
    if transposed:
        d_out, d_lse = linear
        safe_lse, delta = backward_statistics(out, lse, d_out, d_lse)
        wanted = jax.tree.unflatten(diff_tree, which)[3]
        grads = backward(cfg, q, k, v, ops, safe_lse, delta, d_out, wanted)
        leaves = diff_tree.flatten_up_to(grads)
        return [g for g, w in zip(leaves, which, strict=True) if w]
    # Zero tangents stay None: the kernel skips what they would cost.
    it = iter(linear)
    dq, dk, dv, d_diff = jax.tree.unflatten(diff_tree, [next(it) if w else None for w in which])
    if isinstance(d_diff, Operands) and d_diff.score_mod_arrays is not None:
        d_diff = replace(d_diff, score_mod_arrays=_zero_tangents_filled(
            d_diff.score_mod_arrays, diff.score_mod_arrays))
    return list(tangent(cfg, q, k, v, ops, out, lse, dq, dk, dv, d_diff))


linear_p = Primitive("eqx_flash_attention_linear")
linear_p.multiple_results = True
linear_p.def_impl(_linear_fn)
mlir.register_lowering(linear_p, mlir.lower_fun(_linear_fn, multiple_results=True))


def _linear_abstract_eval(*args, cfg, which, res_tree, transposed):
    del cfg
    residuals = jax.tree.unflatten(res_tree, args[: res_tree.num_leaves])
    # The residuals' own avals: same shapes and dtypes, and under shard_map the same
    # varying axes.
    if transposed:
        leaves = jax.tree.leaves(_differentiable(residuals))
        return [x for x, w in zip(leaves, which, strict=True) if w]
    return list(residuals[3:5])  # out, lse


linear_p.def_abstract_eval(_linear_abstract_eval)


def _is_zero(t) -> bool:
    return type(t) is ad.Zero or jnp.dtype(t.dtype) == jax.dtypes.float0


def _linear_jvp(primals, tangents, **params):
    num_res = params["res_tree"].num_leaves
    # The residuals pass through stop_gradient, except the last, `z`: zero, with a
    # derivative that raises wherever it is used (`second_order`).
    if not all(_is_zero(t) for t in tangents[: num_res - 1]):
        raise NotImplementedError(SECOND_ORDER_MESSAGE)
    out = linear_p.bind(*primals, **params)
    lin_t = tangents[num_res:]
    z_t = tangents[num_res - 1]
    if all(type(t) is ad.Zero for t in lin_t):
        if _is_zero(z_t):
            return out, [ad.Zero(jax.typeof(x).to_tangent_aval()) for x in out]
        out_t = [jnp.zeros_like(x) for x in out]
    else:
        lin_t = [ad.instantiate_zeros(t) for t in lin_t]
        out_t = linear_p.bind(*primals[:num_res], *lin_t, **params)
    if not _is_zero(z_t):
        out_t = [t + z_t.astype(t.dtype) for t in out_t]
    return out, out_t


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


def linear(cfg: KernelConfig, which: tuple[bool, ...], residuals: tuple[Any, ...],
           nonzero: tuple[Array, ...]) -> list[Array]:
    """`(d_out, d_lse)` for the non-zero tangents `nonzero` (the leaves `which` marks)."""
    flat, res_tree = jax.tree.flatten(residuals)
    return linear_p.bind(*flat, *nonzero, cfg=cfg, which=which, res_tree=res_tree,
                         transposed=False)
