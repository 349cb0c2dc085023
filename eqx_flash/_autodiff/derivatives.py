"""`with_custom_derivatives`: forward and reverse mode through the blockwise kernels.

JAX lets a function have a custom VJP or a custom JVP, not both. The attention (the
forward kernel) is a `jax.custom_jvp` (symbolic zeros on), and its JVP rule returns

- the primal by calling the `custom_jvp` function itself (so any outer transform re-enters
  this rule), and
- the tangent through the linear primitive (`linear.linear_p`), whose forward evaluation
  is the tangent kernel and whose transpose is the backward kernel, both of the family
  the configuration records (`_kernels.dispatch.family_of`). So `jax.jvp` runs the
  forward and tangent kernels, and `jax.grad`, which linearises through this rule and
  transposes the linear primitive, runs the forward and backward kernels.

The differentiable inputs are q, k, v and the differentiable operands
(`_core.operands.differentiable_part`: a bias, ALiBi slopes, a score_mod's floating
arrays); everything else rides along as constants. Only the non-zero tangents enter the
linear primitive (a transpose must see every linear operand undefined), so gradients
with respect to a subset of the inputs work, and the backward kernel accumulates only
the cotangents that are asked for. The linear primitive's own derivative along its
residuals is the second-order primitive (`second_order`), so the rule is exact to second
order (Hessian-vector products, `jax.hessian`, gradients of gradients and of tangents).

Where the tangents are only pushed forward (`jax.jvp`, not transposed), running the
forward kernel and then the tangent kernel forms every logit block twice. So the rule
binds `one_pass_p` instead, whose evaluation is the one-pass kernel (the family's
`forward_and_tangent`; the xla one's jvp costs about 3.0 forwards against 3.5). Every
other transformation of it replays the two-pass decomposition above (`_two_pass`):
partial evaluation (`jax.linearize`, `jax.grad`, `jax.checkpoint`) gets the forward as
the known part and the linear primitive as the unknown one, exactly as before; its JVP
(second order) is the decomposition's; `vmap` along the tangents alone (`jax.jacfwd`)
runs the forward once.
"""

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.core import ShapedArray, eval_jaxpr
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import Primitive
from jax.extend.core.primitives import closed_call_p
from jax.interpreters import ad, batching, mlir
from jax.interpreters import partial_eval as pe

from .._core.compat import register_dce_rule, set_current_trace, unsharded
from .._core.config import KernelConfig, stat_dtype
from .._core.operands import Operands, combine
from .._semantics.masking import valid_rows
from .batching import batch_by_map
from .linear import linear
from .residuals import Residuals, apply_forward_and_tangent


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
        return _batched_alike(attention(cfg, q, k, v, combine(diff, const)),
                              (q, k, v, diff, const))

    @functools.partial(wrapped.defjvp, symbolic_zeros=True)
    def wrapped_jvp(cfg, primals, tangents):
        q, k, v, diff, const = primals
        if cfg.split_k:
            # The split-K kernel left the keys and values uncleaned (`_api.flash`); the
            # derivative kernels need them clean, and their tangents alike.
            ops = combine(diff, const)
            q, k, v = valid_rows(q, k, v, ops, q.shape[3], k.shape[2])  # padded sizes
            tangents = (*_clean_tangents(tangents[:3], (q, k, v), ops), *tangents[3:])
        leaves = jax.tree.leaves(tangents[:4], is_leaf=_is_symbolic_zero)
        which = tuple(not _is_symbolic_zero(t) for t in leaves)
        nonzero = tuple(t for t, w in zip(leaves, which, strict=True) if w)
        if not nonzero:  # only constants were perturbed: they get no derivative
            out, lse, max_score = wrapped(cfg, q, k, v, diff, const)
            d_out, d_lse = jnp.zeros_like(out), jnp.zeros_like(lse)
        elif _one_pass_applies(cfg, (q, k, v, diff, const), nonzero):
            flat, tree = jax.tree.flatten((q, k, v, diff, const))
            # (Tied to the primals alone: a primal result tied to a tangent would no
            # longer be known to `jax.linearize`.)
            out, lse, max_score, d_out, d_lse = _batched_alike(one_pass_p.bind(
                *flat, *nonzero, cfg=cfg, which=which, tree=tree, two_pass=two_pass,
                read=_EVERY), flat)
        else:
            out, lse, max_score, d_out, d_lse = two_pass(cfg, which, q, k, v, diff, const,
                                                         nonzero)
        # The max scores carry no derivative (as FlexAttention's): a zero tangent.
        return (out, lse, max_score), (d_out, d_lse, jnp.zeros_like(max_score))

    def two_pass(cfg, which, q, k, v, diff, const, nonzero):
        """The forward kernel, then the linear primitive along the tangents `nonzero`."""
        out, lse, max_score = wrapped(cfg, q, k, v, diff, const)
        residuals = Residuals(q, k, v, out, lse, diff, const)
        d_out, d_lse = linear(cfg, which, residuals, nonzero)
        return out, lse, max_score, d_out, d_lse

    return wrapped


def _batched_alike(results: Any, inputs: Any) -> Any:
    """`results` unchanged in value, but under `vmap` batched along every axis that any
    of `inputs` is, with that batch axis first, at every level.

    A `custom_jvp` staged into a jaxpr (here: inside the jitted `_blockwise`) and then
    batched records how its function's results are batched; a later JVP evaluates the
    rule and takes its primal results to be batched the same way. The forward kernel's
    results are batched however its ops leave them (lse not at all where only v is
    mapped; a `lax.map` over heads puts the axis second), the one-pass primitive's by its
    rule: under two nested `vmap`s they differed, and a `jax.vjp` returned a value with
    its batch axes swapped, or failed to lower. Both paths end here, so both agree.

    Adding the sum of an empty slice of each input (exactly 0) makes a result batched
    wherever that input is; a reshape's batching rule then puts the batch axis first.
    Unbatched, XLA folds both away."""
    ties = []
    for leaf in jax.tree.leaves(inputs):
        if jnp.issubdtype(leaf.dtype, jax.dtypes.extended):  # a PRNG key
            leaf = jax.random.key_data(leaf)
        ties.append(jnp.sum(leaf.ravel()[:0]))

    def tie(x):
        for t in ties:
            x = x + t.astype(x.dtype)
        return jax.lax.reshape(jax.lax.expand_dims(x, (0,)), x.shape)

    return jax.tree.map(tie, results)


def _one_pass_applies(cfg: KernelConfig, primals: Any, nonzero: tuple[Any, ...]) -> bool:
    """Not for split-K (a few queries: the forward is cheap), nor under a mesh (where the
    primitive's output types would have to carry the inputs' sharding and varying axes;
    the decomposition's kernels do that themselves)."""
    if cfg.split_k:
        return False
    return all(unsharded(x) for x in (*jax.tree.leaves(primals), *nonzero))


# The one-pass jvp primitive. Operands: the leaves of `(q, k, v, diff, const)` (`tree`),
# then the non-zero tangents of the differentiable leaves `which` marks. Results:
# those of `(out, lse, max_score, d_out, d_lse)` that `read` marks: all when bound; a
# compiled program's dead-code elimination drops the ones it never reads (`_dce`), and
# the lowering then leaves them unwritten (`_lowering`: the Pallas kernel writes the
# statistics and the lse's tangent only where read).

_EVERY = (True,) * 5


def _read(results, read: tuple[bool, ...]) -> list[Any]:
    return [r for r, keep in zip(results, read, strict=True) if keep]


def _arguments(args, tree) -> tuple[Residuals, list[Any]]:
    q, k, v, diff, const = jax.tree.unflatten(tree, args[: tree.num_leaves])
    # out and lse are what is computed: absent from the primals.
    return Residuals(q, k, v, None, None, diff, const), list(args[tree.num_leaves:])  # pyright: ignore[reportArgumentType]


def _one_pass(*args, cfg, which, tree, two_pass, read):
    del two_pass
    primals, nonzero = _arguments(args, tree)
    return _read(apply_forward_and_tangent(cfg, primals, which, nonzero), read)


def _lowering(*args, **params):
    """`_one_pass` with what it does not return dead-code eliminated (traced, then the
    kernels' own rules drop their unread results: `_kernels/pallas_tpu/_unread_outputs`)."""
    closed = jax.make_jaxpr(functools.partial(_one_pass, **params))(*args)
    jaxpr, used_consts, _ = pe.dce_jaxpr_consts(closed.jaxpr, [True] * len(closed.out_avals),
                                                instantiate=True)
    consts = [c for c, used in zip(closed.consts, used_consts, strict=True) if used]
    return eval_jaxpr(jaxpr, consts, *args)


def _two_pass(*args, cfg, which, tree, two_pass, read):
    p, nonzero = _arguments(args, tree)
    return _read(two_pass(cfg, which, p.q, p.k, p.v, p.diff, p.const, tuple(nonzero)), read)


def _abstract_eval(*avals, cfg, which, tree, two_pass, read):
    del cfg, which, tree, two_pass
    q, v = avals[0], avals[2]  # (b, h, g, seq_q, d), (b, h, seq_k, dim_v)
    out = ShapedArray((*q.shape[:-1], v.shape[-1]), q.dtype)
    lse = ShapedArray(q.shape[:-1], stat_dtype(q.dtype))
    return _read([out, lse, lse, out, lse], read)


def _dce(used: list[bool], eqn: Any) -> tuple[list[bool], Any]:
    """The results a program never reads leave `read` (no effects: unread, it goes)."""
    if not any(used):
        return [False] * len(eqn.invars), None
    if all(used):
        return [True] * len(eqn.invars), eqn
    kept = iter(used)
    read = tuple(r and next(kept) for r in eqn.params["read"])
    outvars = [v for v, u in zip(eqn.outvars, used, strict=True) if u]
    return [True] * len(eqn.invars), eqn.replace(outvars=outvars,
                                                 params=dict(eqn.params, read=read))


def _partial_eval(trace, *tracers, **params):
    """`jax.linearize` and `jax.grad` (through `pe.JaxprTrace`): the decomposition, whose
    forward is known and whose linear primitive is not."""
    if all(t.is_known() for t in tracers):  # (this rule runs under the parent trace)
        return one_pass_p.bind(*(t.pval.get_known() for t in tracers), **params)
    with set_current_trace(trace):
        return _two_pass(*tracers, **params)


def _partial_eval_custom(saveable, unks_in, inst_in, eqn):
    """`jax.checkpoint`'s partial evaluation of a jaxpr: the equation as a call of the
    decomposition, split as any call is."""
    if not any(unks_in):
        n = len(eqn.outvars)
        return eqn, None, [False] * n, [False] * n, []
    avals = [jax.ShapeDtypeStruct(x.aval.shape, x.aval.dtype) for x in eqn.invars]
    call = jax.make_jaxpr(functools.partial(_two_pass, **eqn.params))(*avals)
    as_call = eqn.replace(primitive=closed_call_p, params=dict(call_jaxpr=call))
    return pe.partial_eval_jaxpr_custom_rules[closed_call_p](saveable, unks_in, inst_in,
                                                             as_call)


def _jvp(primals, tangents, **params):
    """Second order: the decomposition's derivative (the linear primitive's own rule)."""
    tangents = tuple(map(ad.instantiate_zeros, tangents))
    out, d_out = jax.jvp(functools.partial(_two_pass, **params), tuple(primals), tangents)
    return list(out), list(d_out)


def _batch(args, dims, **params):
    """Along the tangents alone (`jax.jacfwd`): the decomposition, so that the forward
    runs once; otherwise one one-pass call per batch element."""
    if all(d is None for d in dims[: params["tree"].num_leaves]):
        # The primal results do not vary.
        dims_out = _read([None, None, None, 0, 0], params["read"])
        outs = jax.vmap(functools.partial(_two_pass, **params), in_axes=list(dims),
                        out_axes=dims_out)(*args)
        return outs, dims_out
    return batch_by_map(one_pass_p)(args, dims, **params)


one_pass_p = Primitive("eqx_flash_attention_jvp")
one_pass_p.multiple_results = True
one_pass_p.def_impl(_one_pass)
one_pass_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(one_pass_p, mlir.lower_fun(_lowering, multiple_results=True))
register_dce_rule(one_pass_p, _dce)
pe.custom_partial_eval_rules[one_pass_p] = _partial_eval
pe.partial_eval_jaxpr_custom_rules[one_pass_p] = _partial_eval_custom
ad.primitive_jvps[one_pass_p] = _jvp
batching.primitive_batchers[one_pass_p] = _batch
