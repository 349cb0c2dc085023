"""`check_attention`: an attention function against `plain_attention` on one drawn
problem: outputs, lse, gradients, jvp tangents and Hessian-vector products."""

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._api.reference import plain_attention
from .._api.sanity import split_outputs
from .._core.operands import differentiable_arguments
from .._mods.tracing import StaticValue
from ._strategies import AttentionInputs
from ._tolerances import PRECISION, Tolerance, at_precision, tolerance_for

# Floating array arguments whose gradients `check_attention` compares too (for a
# `score_mod`, the floating arrays of the PyTree).
DIFFERENTIABLE = differentiable_arguments()
# PyTree arguments: their arrays are traced (`score_mod`'s floating ones differentiated),
# the rest is static.
MODIFICATIONS = ("score_mod", "mask_mod", "block_mask")


def _split_kwargs(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], tuple]:
    """`(arrays, static)`: array arguments (and the arrays of PyTree arguments, by name)
    and the rest as a hashable tuple."""
    arrays, static = {}, []
    for name, value in kwargs.items():
        if isinstance(value, jax.Array | np.ndarray):
            arrays[name] = value
        elif name in MODIFICATIONS and value is not None:
            keep = eqx.is_inexact_array if name in DIFFERENTIABLE else eqx.is_array
            dynamic, rest = eqx.partition(value, keep)
            arrays[name] = dynamic
            static.append((name, StaticValue(rest)))
        else:
            static.append((name, value))
    return arrays, tuple(static)


def _join(static, arrays: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments again from `_split_kwargs`' halves."""
    kwargs = dict(arrays)
    for name, value in static:
        kwargs[name] = (eqx.combine(arrays[name], value.value)
                        if isinstance(value, StaticValue) else value)
    return kwargs


def _named_grads(name: str, grad: Any) -> dict[str, Array]:
    """`{"dname": grad}`, or one entry per array leaf of a PyTree cotangent."""
    if isinstance(grad, jax.Array):
        return {f"d{name}": grad}
    leaves = jax.tree_util.tree_flatten_with_path(grad)[0]
    return {f"d{name}{jax.tree_util.keystr(path)}": g for path, g in leaves}


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind is p.VAR_KEYWORD or p.name == name for p in params)


def _values_and_grads(fn, static, q, k, v, arrays, weights, grads: bool):
    """`out`, `lse` (or None) and, with `grads`, the gradients with respect to q, k, v
    and every floating array argument (a bias, ALiBi slopes; `DIFFERENTIABLE`) of
    `sum(w * out) + sum(u * lse over its finite entries)` for `weights = (w, u)`."""
    fixed = {n: x for n, x in arrays.items() if n not in DIFFERENTIABLE}
    free = {n: x for n, x in arrays.items() if n in DIFFERENTIABLE}

    def call(q, k, v, free):
        return split_outputs(fn(q, k, v, **_join(static, {**fixed, **free})))

    w, u = weights
    if not grads:
        return (*call(q, k, v, free), None)
    (out, lse), vjp = jax.vjp(call, q, k, v, free)
    if out.shape != w.shape or (lse is not None and lse.shape != u.shape):
        return out, lse, None  # reported as a shape mismatch
    d_lse = None if lse is None else jnp.where(jnp.isfinite(lse), u, 0.0).astype(lse.dtype)
    dq, dk, dv, d_free = vjp((w.astype(out.dtype), d_lse))
    named = {k: g for n, grad in d_free.items() for k, g in _named_grads(n, grad).items()}
    return out, lse, {"dq": dq, "dk": dk, "dv": dv, **named}



def _evaluate_jvp(fn, static, q, k, v, arrays, tangents):
    """Tangents of `out` and `lse` (or None) along `tangents = (dq, dk, dv, d_free)`,
    `d_free` the tangents of the floating array arguments (`DIFFERENTIABLE`) by name."""
    *d_qkv, d_free = tangents
    fixed = {n: x for n, x in arrays.items() if n not in d_free}

    def call(q, k, v, free):
        return split_outputs(fn(q, k, v, **_join(static, {**fixed, **free})))

    free = {n: arrays[n] for n in d_free}
    _, (d_out, d_lse) = jax.jvp(call, (q, k, v, free), (*d_qkv, d_free))
    return d_out, d_lse



def _evaluate_hvp(fn, static, q, k, v, arrays, extra):
    """The Hessian-vector product (`jax.jvp` of `jax.grad`) of the linear function of
    `_values_and_grads` (weights `extra[0]`) along the tangents `extra[1]` (as in
    `_evaluate_jvp`), named like the gradients."""
    (w, u), (*d_qkv, d_free) = extra
    fixed = {n: x for n, x in arrays.items() if n not in d_free}

    def loss(q, k, v, free):
        out, lse = split_outputs(fn(q, k, v, **_join(static, {**fixed, **free})))
        total = jnp.sum(w.astype(out.dtype) * out)
        if lse is not None:
            total = total + jnp.sum(u.astype(lse.dtype) * jnp.where(jnp.isfinite(lse), lse, 0.0))
        return total

    free = {n: arrays[n] for n in d_free}
    grads, hvps = jax.jvp(jax.grad(loss, argnums=(0, 1, 2, 3)), (q, k, v, free),
                          (*d_qkv, d_free))

    def named(dq, dk, dv, d_free):
        free = {k: g for n, grad in d_free.items() for k, g in _named_grads(n, grad).items()}
        return {"dq": dq, "dk": dk, "dv": dv, **free}

    return named(*hvps), named(*grads)


def _tangents(inputs: "AttentionInputs", seed: int) -> tuple[Any, ...]:
    """Random tangents of q, k, v and (by name) of the floating array arguments
    (`DIFFERENTIABLE`), scaled like them (so the logits move by O(1))."""
    rng = np.random.default_rng(seed + 1)

    def like(x):
        x32 = np.asarray(jnp.asarray(x).astype(jnp.float32))
        finite = x32[np.isfinite(x32)]  # a -inf sink has a finite tangent too
        std = float(np.std(finite)) if finite.size else 1.0
        t = rng.standard_normal(x.shape, np.float32) * max(std, 1e-3)
        return jnp.asarray(t.astype(jnp.dtype(x.dtype)))

    d_qkv = like(inputs.q), like(inputs.k), like(inputs.v)
    arrays, _ = _split_kwargs(inputs.kwargs)
    free = {n: jax.tree.map(like, x) for n, x in arrays.items() if n in DIFFERENTIABLE}
    return (*d_qkv, free)


def _evaluate(fn, static, q, k, v, arrays, extra, mode: str) -> Any:
    """`mode` "values" or "grads": `_values_and_grads` with weights `extra`; "jvp":
    `_evaluate_jvp` along tangents `extra`; "hvp": `_evaluate_hvp`; "max_scores": the
    third result of `fn(..., return_max_scores=True)`."""
    if mode == "max_scores":
        return fn(q, k, v, **_join(static, arrays), return_max_scores=True)[2]
    if mode == "jvp":
        return _evaluate_jvp(fn, static, q, k, v, arrays, extra)
    if mode == "hvp":
        return _evaluate_hvp(fn, static, q, k, v, arrays, extra)
    return _values_and_grads(fn, static, q, k, v, arrays, extra, mode == "grads")


_evaluate_jit = jax.jit(_evaluate, static_argnums=(0, 1, 7))


def _run(fn, kwargs: Mapping[str, Any], q, k, v, extra, mode: str, jit: bool) -> Any:
    """`_evaluate` of `fn` on the problem, compiled (and cached by `fn` and the static
    settings) unless `jit` is False."""
    kwargs = {
        name: value
        for name, value in kwargs.items()
        if name not in ("block_q", "block_k") or _accepts(fn, name)
    }
    arrays, static = _split_kwargs(kwargs)
    if not jit:
        return _evaluate(fn, static, q, k, v, arrays, extra, mode)
    try:
        hash((fn, static))
    except TypeError:  # unhashable settings: compile this once, uncached
        return jax.jit(functools.partial(_evaluate, fn, static), static_argnums=(5,))(
            q, k, v, arrays, extra, mode
        )
    return _evaluate_jit(fn, static, q, k, v, arrays, extra, mode)


def _weights(inputs: "AttentionInputs", seed: int) -> tuple[Array, Array]:
    # Made with NumPy outside the traced function: jax.random would add a threefry
    # program to every compilation.
    rng = np.random.default_rng(seed)
    lse_shape = inputs.q.shape[:-1]
    w = rng.standard_normal((*lse_shape, inputs.v.shape[-1]), np.float32)
    return jnp.asarray(w), jnp.asarray(rng.standard_normal(lse_shape, np.float32))


def _compare(
    name: str, got: Any, expected: Any, tol: tuple[float, float], per_tensor: bool,
    floor: float = 0.0,
) -> str | None:
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), dtype=np.float64)
    expected = np.asarray(jnp.asarray(expected).astype(jnp.float32), dtype=np.float64)
    if got.shape != expected.shape:
        return f"{name}: shape {got.shape}, expected {expected.shape}"
    if got.size == 0:
        return None
    neg_inf = np.isneginf(expected)
    wrong_inf = neg_inf != np.isneginf(got)
    if wrong_inf.any():
        where = tuple(int(i) for i in np.argwhere(wrong_inf)[0])
        return (
            f"{name}: -inf at {int(np.isneginf(got).sum())} entries, expected exactly at "
            f"{int(neg_inf.sum())}; first mismatch at {where}: got {got[where]!r}, "
            f"expected {expected[where]!r}"
        )
    atol, rtol = tol
    size = float(np.max(np.abs(np.where(neg_inf, 0.0, expected)))) if per_tensor else 1.0
    # A gradient that is zero in exact arithmetic (e.g. dq, dk with a single key) is only
    # round-off in both: measure it against the largest gradient of the problem instead.
    size = max(size, floor)
    limit = atol * max(size, 1e-30 if per_tensor else 1.0) + rtol * np.abs(expected)
    with np.errstate(invalid="ignore"):
        diff = np.where(neg_inf, 0.0, np.abs(got - expected))
        bad = ~(diff <= limit)  # NaN counts as bad
    if not bad.any():
        return None
    excess = np.where(bad, np.nan_to_num(diff / limit, nan=np.inf, posinf=np.inf), -1.0)
    where = tuple(int(i) for i in np.unravel_index(np.argmax(excess), excess.shape))
    scale_text = f" * max|expected|={size:.3g}" if per_tensor else ""
    return (
        f"{name}: {int(bad.sum())} of {bad.size} entries out of tolerance; worst at {where}: "
        f"got {got[where]:.6g}, expected {expected[where]:.6g}, |diff| {diff[where]:.3g} > "
        f"{limit[where]:.3g} (atol {atol:g}{scale_text} + rtol {rtol:g} * |expected|)"
    )


def check_attention(
    fn: Callable[..., Any],
    inputs: AttentionInputs,
    *,
    reference: Callable[..., Any] = plain_attention,
    grads: bool = True,
    jvp: bool = False,
    jit: bool = True,
    tolerance: Tolerance | None = None,
    seed: int = 0,
    max_scores: bool = False,
    second_order: bool = False,
    precision: str | None = PRECISION,
) -> None:
    """Assert that `fn` computes the same attention as `reference` on `inputs`.

    Calls `fn(inputs.q, inputs.k, inputs.v, **inputs.kwargs)` and the reference the same
    way (`block_q`/`block_k` are passed only to functions that accept them). Each returns
    `(out, lse, ...)` or just `out`. Compares `out`; `lse`, which must be `-inf` exactly
    where the reference's is; and, with `grads`, the gradients with respect to `q`, `k`, `v`
    of a fixed random linear function of `out` and of the finite entries of `lse`; and, with
    `jvp`, the forward-mode tangents (`jax.jvp`) of `out` and `lse` along fixed random
    tangents of `q`, `k`, `v` and of the floating array arguments (a bias, ALiBi slopes,
    a score_mod's arrays) (judged like gradients, and never NaN); and, with
    `second_order`, the Hessian-vector products (`jax.jvp` of `jax.grad`) of the same
    linear function along the same tangents, for every input the gradients cover.

    **Arguments:**

    - `fn`: the attention function under test.
    - `inputs`: one problem, usually drawn from `attention_inputs`.
    - `reference`: the oracle; default `plain_attention`.
    - `grads`: also compare gradients.
    - `jvp`: also compare forward-mode tangents of `out` and `lse` (`jax.jvp`).
    - `jit`: run both functions under `jax.jit` (non-array keyword arguments static),
        which compiles much faster than running op by op; `False` for functions that
        cannot be traced.
    - `tolerance`: overrides the per-dtype table `TOLERANCES` (chosen by `q`'s dtype and
        widened by the backend's factor, `tolerance_for`).
    - `seed`: seed of the random linear function the gradients are taken of.
    - `max_scores`: also compare the per-row max scores of `fn(...,
        return_max_scores=True)` (judged like lse: `-inf` in the same places).
    - `second_order`: also compare Hessian-vector products (judged like gradients, with
        twice their tolerance: one more derivative of round-off).
    - `precision`: the matmul precision both `fn` and `reference` run at
        (`jax.default_matmul_precision`): `"highest"` (the default, `PRECISION`) compares
        float32 attention at float32 accuracy on every backend; at JAX's own default a
        float32 matmul runs in bfloat16 passes on TPU (TF32 on GPU), where two correct
        attentions differ by ~1e-2 in gradients. `None` keeps whatever precision is
        in effect; with anything but `"highest"` pass a `tolerance` to match.

    **Raises:**

    `AssertionError` listing, for each quantity out of tolerance, how many entries, the
    worst one (index, both values, the difference and the tolerance), and the inputs.
    """
    tol = tolerance if tolerance is not None else tolerance_for(inputs.q.dtype)
    with at_precision(precision):
        problems = _problems(fn, inputs, reference, grads, jvp, jit, tol, seed, max_scores,
                             second_order)
    if problems:
        report = "\n".join(f"  {p}" for p in problems)
        raise AssertionError(
            f"attention differs from the reference on {inputs!r} (matmul precision "
            f"{precision!r}):\n{report}"
        )


def _problems(fn, inputs, reference, grads, jvp, jit, tol, seed, max_scores, second_order
              ) -> list[str]:
    """`check_attention`'s comparisons, at the precision in effect: one line per quantity
    out of tolerance."""
    q, k, v = inputs.q, inputs.k, inputs.v
    weights = _weights(inputs, seed)
    mode = "grads" if grads else "values"
    out, lse, grad = _run(fn, inputs.kwargs, q, k, v, weights, mode, jit)
    if lse is None:  # `fn` returns only `out`: leave lse out of the linear function too
        weights = (weights[0], jnp.zeros_like(weights[1]))
    ref_out, ref_lse, ref_grad = _run(reference, inputs.kwargs, q, k, v, weights, mode,
                                       jit)
    problems = []
    if jnp.dtype(out.dtype) != jnp.dtype(ref_out.dtype):
        problems.append(f"out: dtype {out.dtype}, expected {ref_out.dtype}")
    problems.append(_compare("out", out, ref_out, tol.out, per_tensor=False))
    if lse is not None and ref_lse is not None:
        problems.append(_compare("lse", lse, ref_lse, tol.lse, per_tensor=False))
    if grad is not None and ref_grad is not None:
        qkv_grads = [ref_grad[n] for n in ("dq", "dk", "dv")]
        grad_scale = max(float(jnp.max(jnp.abs(r.astype(jnp.float32)))) for r in qkv_grads)
        for name, r in ref_grad.items():
            if name not in grad:
                problems.append(f"{name}: not computed (the function ignores it?)")
                continue
            floor = 0.1 * grad_scale if name in ("dq", "dk", "dv") else 0.0
            problems.append(
                _compare(name, grad.get(name), r, tol.grad, per_tensor=True, floor=floor)
            )
    if jvp:
        tangents = _tangents(inputs, seed)
        d_out, d_lse = _run(fn, inputs.kwargs, q, k, v, tangents, "jvp", jit)
        ref_d_out, ref_d_lse = _run(reference, inputs.kwargs, q, k, v, tangents,
                                          "jvp", jit)
        pairs = [("d_out", d_out, ref_d_out)]
        if d_lse is not None and ref_d_lse is not None:
            pairs.append(("d_lse", d_lse, ref_d_lse))
        scale = max(float(jnp.max(jnp.abs(r.astype(jnp.float32)))) for _, _, r in pairs)
        for name, got, expected in pairs:
            problems.append(
                _compare(name, got, expected, tol.grad, per_tensor=True, floor=0.1 * scale)
            )
    if second_order:
        extra = (weights, _tangents(inputs, seed))
        (got, _), (expected, ref_grads) = (_run(f, inputs.kwargs, q, k, v, extra, "hvp", jit)
                                           for f in (fn, reference))
        # An HVP that is zero in exact arithmetic (one key: the softmax is constant) is
        # round-off in both: measured against the problem's gradients and HVPs instead.
        scale = max(float(jnp.max(jnp.abs(x.astype(jnp.float32))))
                    for x in (*expected.values(), *ref_grads.values()) if x.size)
        atol, rtol = tol.grad
        for name, r in expected.items():
            problems.append(_compare(f"hvp {name}", got.get(name), r, (2 * atol, 2 * rtol),
                                     per_tensor=True, floor=0.1 * scale))
    if max_scores:
        got, expected = (_run(f, inputs.kwargs, q, k, v, None, "max_scores", jit)
                         for f in (fn, reference))
        problems.append(_compare("max_scores", got, expected, tol.lse, per_tensor=False))
    return [p for p in problems if p is not None]
