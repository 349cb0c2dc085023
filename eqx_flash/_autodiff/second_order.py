"""The second-order primitive: derivatives of the tangent and backward kernels along a
direction of their residuals, blockwise.

Write `F(x) = (out, lse)` for the attention of the differentiable inputs `x` (q, k, v
and the differentiable operands), `T(x; u) = F'(x) u` for the tangent kernel and
`B(x; c) = F'(x)^T c` for the backward kernel (`residuals`). Differentiating either
along a direction `w` of `x` — with the saved `out` and `lse` moving too, by `T(x; w)`,
since they are `F(x)` — gives, with `H_c = sum_i c_i F_i''(x)` (a symmetric matrix):

    T2(x; u, w) = d/dt T(x + t w; u)  = [u^T F_i''(x) w]_i     (mode "tangent")
    B2(x; c, w) = d/dt B(x + t w; c)  = H_c w                  (mode "backward")

`T2` is bilinear in `(u, w)` and `B2` in `(c, w)`, and by the symmetry of `F''` their
transposes are the same two maps again:

    T2 in u:  c -> B2(x; c, w)        T2 in w:  c -> B2(x; c, u)
    B2 in c:  u -> T2(x; u, w)        B2 in w:  v -> B2(x; c, v)

so `second_p` with these transposes makes every second-order composition of JAX work
(`jax.jvp` of `jax.grad` evaluates `B2`, `jax.grad` of `jax.grad` transposes it, a loss
on a jvp tangent transposes `T2`, `jax.jacfwd` of `jax.jacfwd` evaluates `T2`), and
each is evaluated as `jax.jvp` of the first-order kernel: the kernels are plain JAX
loops over blocks, and forward mode through a loop carries the tangents in the loop's
carry, so memory stays linear in the sequence, like the kernels'. The linear
primitive's JVP rule (`linear`) binds it; it is exact to second order, and its own
residuals pass through `stop_gradient` beyond that, guarded (`guard`): a third-order
term raises `THIRD_ORDER_MESSAGE`, never a silently missing term.

Operands: the residuals `(Residuals, z)` flattened (`z` the guard), then `a` — `u`'s
marked leaves (`wa`) in mode "tangent", `c = (d_out, d_lse)` in mode "backward" — then
`w`'s marked leaves (`wb`), then, with `given_moved`, `T(x; w)` itself. The linear
primitive's JVP rule has it at hand (the tangents of the saved `out` and `lse` are
exactly that), which saves recomputing it; it is an operand for evaluation only: the JVP
and transpose rules treat the result as a function of `w` alone (`out` and `lse` moving
with `x`), so they give it no cotangent and their own binds recompute it. Outputs:
`(d_out, d_lse)` in mode "tangent", the marked (`wa`) leaves' cotangents in mode
"backward".
"""

from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jaxtyping import Array

from .._core.config import KernelConfig
from .._kernels.dispatch import differentiable
from .batching import batch_by_map
from .guard import THIRD_ORDER_MESSAGE, add_guard_tangent, is_zero_tangent
from .residuals import (
    Residuals,
    apply_backward,
    apply_tangent,
    differentiable_leaves,
    marked,
    with_differentiable,
)

Mode = Literal["tangent", "backward"]


def _num_a(mode: Mode, wa: Sequence[bool]) -> int:
    return sum(wa) if mode == "tangent" else 2


def _split(args: Sequence[Any], res_tree, mode: Mode, wa, wb
           ) -> tuple[Residuals, Any, list, list, list]:
    """`(residuals, z, a, w, moved)` from the flat operands (`moved` empty unless given)."""
    n = res_tree.num_leaves
    res, z = jax.tree.unflatten(res_tree, list(args[:n]))
    lin = list(args[n:])
    na, nb = _num_a(mode, wa), sum(wb)
    return res, z, lin[:na], lin[na : na + nb], lin[na + nb :]


def _second_fn(*args, cfg: KernelConfig, res_tree, mode: Mode, wa, wb, given_moved
               ) -> list[Array]:
    res, _, a, w, moved = _split(args, res_tree, mode, wa, wb)
    # The first-order kernels are differentiated here: kernels JAX cannot differentiate
    # (Mosaic's) hand over to the xla family's.
    cfg = differentiable(cfg)
    # out and lse move along w by the first derivative.
    d_out, d_lse = moved if given_moved else apply_tangent(cfg, res, wb, w)

    def first_order(x_w, out, lse):
        shifted = with_differentiable(res, wb, x_w)._replace(out=out, lse=lse)
        if mode == "tangent":
            return apply_tangent(cfg, shifted, wa, a)
        return apply_backward(cfg, shifted, wa, a)

    primals = (marked(differentiable_leaves(res), wb), res.out, res.lse)
    tangents = (list(w), d_out.astype(res.out.dtype), d_lse.astype(res.lse.dtype))
    return list(jax.jvp(first_order, primals, tangents)[1])


second_p = Primitive("eqx_flash_attention_second_order")
second_p.multiple_results = True
second_p.def_impl(_second_fn)
mlir.register_lowering(second_p, mlir.lower_fun(_second_fn, multiple_results=True))


def _second_abstract_eval(*args, cfg, res_tree, mode, wa, wb, given_moved) -> list[Any]:
    del cfg, given_moved
    res, _, _, _, _ = _split(args, res_tree, mode, wa, wb)
    if mode == "tangent":
        return [res.out, res.lse]
    return marked(differentiable_leaves(res), wa)


second_p.def_abstract_eval(_second_abstract_eval)


def _second_jvp(primals, tangents, **params):
    n = params["res_tree"].num_leaves
    out = second_p.bind(*primals, **params)
    # The residuals passed through stop_gradient, except the last, the guard `z`.
    if not all(is_zero_tangent(t) for t in tangents[: n - 1]):
        raise NotImplementedError(THIRD_ORDER_MESSAGE)
    na, nb = _num_a(params["mode"], params["wa"]), sum(params["wb"])
    res, a, b = primals[:n], primals[n : n + na], primals[n + na : n + na + nb]
    da, db = tangents[n : n + na], tangents[n + na : n + na + nb]
    plain = dict(params, given_moved=False)
    terms = []  # bilinear in (a, b); `moved` is a function of b (module docstring)
    if not all(type(t) is ad.Zero for t in da):
        terms.append(second_p.bind(*res, *map(ad.instantiate_zeros, da), *b,
                                   *primals[n + na + nb :], **params))
    if not all(type(t) is ad.Zero for t in db):
        terms.append(second_p.bind(*res, *a, *map(ad.instantiate_zeros, db), **plain))
    z_t = tangents[n - 1]
    if not terms:
        if is_zero_tangent(z_t):
            return out, [ad.Zero(jax.typeof(x).to_tangent_aval()) for x in out]
        terms = [[jnp.zeros_like(x) for x in out]]
    out_t = [sum(ts[1:], ts[0]) for ts in zip(*terms, strict=True)]
    return out, add_guard_tangent(out_t, z_t)


def _second_transpose(cts, *args, cfg, res_tree, mode, wa, wb, given_moved):
    n = res_tree.num_leaves
    na, nb = _num_a(mode, wa), sum(wb)
    residuals, a, b = args[:n], args[n : n + na], args[n + na : n + na + nb]
    moved = args[n + na + nb :]  # gets no cotangent: the result's is w's (docstring)
    assert not any(ad.is_undefined_primal(x) for x in residuals)
    a_linear = any(ad.is_undefined_primal(x) for x in a)
    b_linear = any(ad.is_undefined_primal(x) for x in (*b, *moved))
    if a_linear and b_linear:
        raise NotImplementedError("eqx_flash: a second-order term transposed in both of "
                                  "its directions at once (it is bilinear, not linear)")
    if all(type(ct) is ad.Zero for ct in cts):
        return [None] * len(args)
    out_avals = [x.aval if ad.is_undefined_primal(x) else jax.typeof(x) for x in args]
    out_avals = _second_abstract_eval(*out_avals, cfg=cfg, res_tree=res_tree, mode=mode,
                                      wa=wa, wb=wb, given_moved=given_moved)
    cts = [ad.zeros_like_aval(av) if type(ct) is ad.Zero else ct
           for ct, av in zip(cts, out_avals, strict=True)]
    bind = lambda mode, wa, wb, a, w: second_p.bind(  # noqa: E731
        *residuals, *a, *w, cfg=cfg, res_tree=res_tree, mode=mode, wa=wa, wb=wb,
        given_moved=False)
    if mode == "tangent" and a_linear:  # T2 in u
        new = bind("backward", wa, wb, cts, b)
    elif mode == "tangent":  # T2 in w
        new = bind("backward", wb, wa, cts, a)
    elif a_linear:  # B2 in c
        new = bind("tangent", wa, wb, cts, b)
    else:  # B2 in w
        new = bind("backward", wb, wa, a, cts)
    linear = a if a_linear else b
    # A linear operand that is a known value (an instantiated zero) gets no cotangent.
    new = [ct if ad.is_undefined_primal(x) else None for ct, x in zip(new, linear, strict=True)]
    rest = [None] * len(moved)
    return [None] * n + (new + [None] * nb + rest if a_linear else [None] * na + new + rest)


ad.primitive_jvps[second_p] = _second_jvp
ad.primitive_transposes[second_p] = _second_transpose
batching.primitive_batchers[second_p] = batch_by_map(second_p)


def second_order(cfg: KernelConfig, mode: Mode, wa: tuple[bool, ...], wb: tuple[bool, ...],
                 guarded: tuple[Residuals, Array], a: Sequence[Array],
                 w: Sequence[Array], moved: Sequence[Array] | None = None) -> list[Array]:
    """`T2(x; a, w)` (mode "tangent") or `B2(x; a, w)` (mode "backward") for the
    residuals and guard `guarded`; `moved`, if known, `T(x; w)` (module docstring)."""
    flat, res_tree = jax.tree.flatten(guarded)
    extra = [] if moved is None else list(moved)
    return second_p.bind(*flat, *a, *w, *extra, cfg=cfg, res_tree=res_tree, mode=mode,
                         wa=wa, wb=wb, given_moved=moved is not None)
