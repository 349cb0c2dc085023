"""`with_custom_derivatives`: forward and reverse mode through the blockwise kernels.

JAX lets a function have a custom VJP or a custom JVP, not both. The attention (the
forward kernel) is a `jax.custom_jvp` (symbolic zeros on), and its JVP rule returns

- the primal by calling the `custom_jvp` function itself (so any outer transform re-enters
  this rule), and
- the tangent through the linear primitive (`linear.linear_p`), whose forward evaluation
  is the tangent kernel (`_kernels.tangent`) and whose transpose is the backward kernel
  (`_kernels.backward`). So `jax.jvp` runs the forward and tangent kernels, and
  `jax.grad`, which linearises through this rule and transposes the linear primitive,
  runs the forward and backward kernels.

The differentiable inputs are q, k, v and the differentiable operands
(`_core.operands.differentiable_part`: a bias, ALiBi slopes, a score_mod's floating
arrays); everything else rides along as constants. Only the non-zero tangents enter the
linear primitive (a transpose must see every linear operand undefined), so gradients
with respect to a subset of the inputs work, and the backward kernel accumulates only
the cotangents that are asked for. The linear primitive's own derivative along its
residuals is the second-order primitive (`second_order`), so the rule is exact to second
order (Hessian-vector products, `jax.hessian`, gradients of gradients and of tangents).
"""

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from .._core.operands import Operands, combine
from .._kernels.split_k import split_k_applies
from .._semantics.masking import valid_rows
from .linear import linear
from .residuals import Residuals


def _is_symbolic_zero(t: Any) -> bool:
    return type(t) is SymbolicZero


def _clean_tangents(tangents, primals, ops: Operands) -> tuple[Any, ...]:
    """`valid_rows` applied to the tangents of q, k, v (symbolic zeros stay as they are;
    the primals stand in for them, and their results are dropped)."""
    d_q, d_k, d_v = (p if _is_symbolic_zero(t) else t
                     for t, p in zip(tangents, primals, strict=True))
    cleaned = valid_rows(d_q, d_k, d_v, ops, primals[0].shape[3], primals[1].shape[2])
    return tuple(t if _is_symbolic_zero(t) else c
                 for t, c in zip(tangents, cleaned, strict=True))


def with_custom_derivatives(attention: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap `attention(cfg, q, k, v, ops) -> (out, lse, max_score)` (the forward kernel on padded
    internal-layout arrays) as `wrapped(cfg, q, k, v, diff, const)`, the operands split
    into their differentiable and constant parts, with the derivative rules above."""

    @functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
    def wrapped(cfg, q, k, v, diff: Operands, const: Operands):
        return attention(cfg, q, k, v, combine(diff, const))

    @functools.partial(wrapped.defjvp, symbolic_zeros=True)
    def wrapped_jvp(cfg, primals, tangents):
        q, k, v, diff, const = primals
        if split_k_applies(cfg, combine(diff, const)):
            # The split-K kernel left the keys and values uncleaned (`_api.flash`); the
            # derivative kernels need them clean, and their tangents alike.
            ops = combine(diff, const)
            q, k, v = valid_rows(q, k, v, ops, q.shape[3], k.shape[2])  # padded sizes
            tangents = (*_clean_tangents(tangents[:3], (q, k, v), ops), *tangents[3:])
        out, lse, max_score = wrapped(cfg, q, k, v, diff, const)
        # The max scores carry no derivative (as FlexAttention's): a zero tangent.
        d_max = jnp.zeros_like(max_score)
        leaves = jax.tree.leaves(tangents[:4], is_leaf=_is_symbolic_zero)
        which = tuple(not _is_symbolic_zero(t) for t in leaves)
        nonzero = tuple(t for t, w in zip(leaves, which, strict=True) if w)
        if not nonzero:  # only constants were perturbed: they get no derivative
            return (out, lse, max_score), (jnp.zeros_like(out), jnp.zeros_like(lse), d_max)
        residuals = Residuals(q, k, v, out, lse, diff, const)
        d_out, d_lse = linear(cfg, which, residuals, nonzero)
        return (out, lse, max_score), (d_out, d_lse, d_max)

    return wrapped
