"""Shared test helpers: q/k/v inputs, tolerances and comparisons that report where and how far.

There is one tolerance table, the public `eqx_flash.testing.TOLERANCES` (`(atol, rtol)` per
input dtype, for `out`, `lse` and gradients), read through `eqx_flash.testing.tolerance_for`,
which widens it by the backend's factor (1 on CPU; `BACKEND_FACTORS`). Tests that need a
different bound say so at the call site with an explicit factor (`scale` for both,
`rtol_scale` for the relative part).

Every comparison runs at the matmul precision `eqx_flash.testing.PRECISION` ("highest"):
`conftest.py` sets it for the whole session (unless `JAX_DEFAULT_MATMUL_PRECISION` is set),
so a test means the same on a TPU, whose default float32 matmul is a bfloat16 pass, as on
CPU, where the two precisions compile to the same program. `at_precision` states it where
a test must not depend on that setting.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import settings

try:  # the float64 context manager: `jax.enable_x64` on new jax,
    from jax import enable_x64 as enable_x64
except ImportError:  # `jax.experimental.enable_x64` on the oldest supported (0.7)
    from jax.experimental import enable_x64 as enable_x64

from eqx_flash.testing import PRECISION as PRECISION
from eqx_flash.testing import tolerance_for
from eqx_flash.testing._tolerances import at_precision as at_precision


def tolerance(dtype=jnp.float32, kind: str = "out", scale: float = 1.0,
              rtol_scale: float = 1.0) -> dict[str, float]:
    """`{"atol": ..., "rtol": ...}` from `tolerance_for(dtype).<kind>` (the table
    `TOLERANCES` on this backend) times the factors, for
    `np.testing.assert_allclose(..., **tolerance(...))`."""
    atol, rtol = getattr(tolerance_for(dtype), kind)
    return {"atol": atol * scale, "rtol": rtol * scale * rtol_scale}


def _host(x) -> np.ndarray:
    # Converted on the host: `jnp.asarray(x, dtype)` compiles a program per shape.
    wide = np.float64 if jax.config.jax_enable_x64 else np.float32
    return np.asarray(x).astype(wide)


def assert_close(actual, expected, dtype=jnp.float32, scale=1.0, rtol_scale=1.0, kind="out",
                 name="value"):
    """Elementwise `|actual - expected| <= atol + rtol * |expected|` with the public
    tolerance of `dtype` (the dtype of the inputs) for `kind` ("out", "lse", "grad")."""
    a = _host(actual)
    e = np.asarray(expected).astype(a.dtype)
    np.testing.assert_allclose(a, e, err_msg=name, **tolerance(dtype, kind, scale, rtol_scale))


def assert_lse_close(actual, expected, dtype=jnp.float32, scale=1.0, rtol_scale=1.0):
    """lse: -inf in the same places, the finite entries within the `lse` tolerance."""
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    np.testing.assert_array_equal(np.isneginf(a), np.isneginf(e), err_msg="lse -inf pattern")
    finite = np.isfinite(e)
    np.testing.assert_allclose(a[finite], e[finite], err_msg="lse",
                               **tolerance(dtype, "lse", scale, rtol_scale))


@contextlib.contextmanager
def optimised_compilation():
    """Compile with XLA's optimisations on, as users do: `conftest.py` turns most of them off
    for speed, which changes the buffers that a memory measurement sees."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _normal(key, shape, dtype, std):
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def normal(key, shape, dtype=jnp.float32, std=1.0):
    # One compiled program per shape and dtype, not one per eager op.
    return _normal(key, tuple(shape), jnp.dtype(dtype), jnp.float32(std))


def seeded_normal(seed: int, shape, dtype=jnp.float32):
    """Standard normal values from NumPy's generator `seed` (the same on every jax)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def seeded_qkv(q_shape, k_shape, v_shape=None, dtype=jnp.float32):
    """q, k, v from `seeded_normal` seeds 0, 1, 2 (v defaults to k's shape)."""
    return (seeded_normal(0, q_shape, dtype), seeded_normal(1, k_shape, dtype),
            seeded_normal(2, k_shape if v_shape is None else v_shape, dtype))


def qkv(key, q_shape, k_shape, dim_v=None, dtype=jnp.float32):
    """Standard normal q `q_shape`, k `k_shape` and v (k's shape with last axis `dim_v`,
    default k's), drawn in float32 and cast to `dtype`. `key` may be an int seed."""
    if isinstance(key, int):
        key = jax.random.key(key)
    kq, kk, kv = jax.random.split(key, 3)
    v_shape = (*k_shape[:-1], k_shape[-1] if dim_v is None else dim_v)
    return normal(kq, q_shape, dtype), normal(kk, k_shape, dtype), normal(kv, v_shape, dtype)


def oracle_attention(q, k, v, mask=None, *, causal=False, window=None, scale=None,
                     softcap=None, bias=None, alibi_slopes=None, sinks=None,
                     q_segment_ids=None, kv_segment_ids=None, q_lengths=None,
                     kv_lengths=None, q_positions=None, kv_positions=None, xp=np):
    """Attention written out from its definition, independently of the package: `(out,
    lse, max_scores)`, materialising every score. The tests' one oracle.

    `xp=np` (the default): NumPy in float64, whatever the inputs (no x64 mode needed), a
    float64 truth. `xp=jnp`: jax.numpy in the inputs' dtype, differentiable to any order
    (pass float64 under `enable_x64` for a float64 truth of the derivatives).

    Keywords as `flash_attention`'s, in one layout: q `(B, H, SQ, D)`, k and v `(B, KH,
    SK, D|DV)` (GQA by repeating k and v); `mask`, `kv_segment_ids`, `kv_positions` `(B,
    SK)`; `q_segment_ids`, `q_positions` `(B, SQ)`; lengths `(B,)` (or lists); slopes and
    sinks broadcastable to `(B, H)`; bias broadcastable to `(B, H, SQ, SK)`. The score is
    `scale * q.k + bias - slope * |p - j|`, soft-capped; causal and the window are around `p = i +
    kv_len - q_len` (bottom-right on the valid lengths; ALiBi on the full lengths, `p =
    i + SK - SQ`), or, with positions, around the query's position with ALiBi on
    `|q_pos - kv_pos|` and the lengths marking padding only. Sinks join each row's
    denominator (not its max score). A row that attends nothing gives `out = 0`, `lse =
    -inf` (the sink with sinks) and max score -inf, with zero derivatives."""
    if xp is np:
        def cast(x, dtype=None):
            return None if x is None else np.asarray(x, dtype)
        q, k, v, bias, alibi_slopes, sinks = (cast(x, np.float64) for x in (
            q, k, v, bias, alibi_slopes, sinks))
        stop_gradient = cast
    else:
        def cast(x, dtype=None):
            return None if x is None else jnp.asarray(x, dtype)
        stop_gradient = jax.lax.stop_gradient
    (mask, q_segment_ids, kv_segment_ids, q_lengths, kv_lengths, q_positions,
     kv_positions) = (cast(x) for x in (mask, q_segment_ids, kv_segment_ids, q_lengths,
                                        kv_lengths, q_positions, kv_positions))
    batch, heads, seq_q, dim = q.shape
    seq_k = k.shape[2]
    groups = heads // k.shape[1]
    k, v = xp.repeat(k, groups, axis=1), xp.repeat(v, groups, axis=1)
    scale = 1 / np.sqrt(dim) if scale is None else scale
    s = xp.einsum("bhqd,bhkd->bhqk", q, k) * scale
    i = xp.arange(seq_q).reshape(1, 1, -1, 1)
    j = xp.arange(seq_k).reshape(1, 1, 1, -1)
    q_len = xp.full((batch, 1, 1, 1), seq_q) if q_lengths is None else q_lengths.reshape(
        -1, 1, 1, 1)
    kv_len = xp.full((batch, 1, 1, 1), seq_k) if kv_lengths is None else kv_lengths.reshape(
        -1, 1, 1, 1)
    if q_positions is not None:
        p, key = q_positions[:, None, :, None], kv_positions[:, None, None, :]
        distance = xp.abs(p - key)
    else:
        p, key = i + (kv_len - q_len), j
        distance = xp.abs(i + (seq_k - seq_q) - j)
    if bias is not None:
        s = s + xp.broadcast_to(bias, s.shape)
    if alibi_slopes is not None:
        s = s - alibi_slopes[None, :, None, None] * distance.astype(s.dtype)
    if softcap is not None:
        s = softcap * xp.tanh(s / softcap)
    left, right = (window, window) if isinstance(window, int) else (window or (None, None))
    if causal:
        right = 0 if right is None else min(right, 0)
    allowed = (i < q_len) & (j < kv_len)
    if left is not None:
        allowed = allowed & (key >= p - left)
    if right is not None:
        allowed = allowed & (key <= p + right)
    if mask is not None:
        allowed = allowed & mask.astype(bool)[:, None, None, :]
    if q_segment_ids is not None:
        allowed = allowed & (q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
    allowed = xp.broadcast_to(allowed, s.shape)
    max_scores = xp.where(allowed, s, -xp.inf).max(axis=-1)
    if sinks is not None:  # broadcastable to (B, H)
        sinks = xp.broadcast_to(sinks, s.shape[:2])[:, :, None]
    top = max_scores if sinks is None else xp.maximum(max_scores, sinks)
    top = stop_gradient(xp.where(xp.isfinite(top), top, 0.0))
    e = xp.where(allowed, xp.exp(xp.where(allowed, s, 0.0) - top[..., None]), 0.0)
    total = e.sum(axis=-1)
    if sinks is not None:
        total = total + xp.exp(sinks - top)
    some = total > 0
    safe = xp.where(some, total, 1.0)
    out = xp.einsum("bhqk,bhkd->bhqd", e / safe[..., None], v)
    lse = xp.where(some, xp.log(safe) + top, -xp.inf)
    return out, lse, stop_gradient(max_scores)


def linear_in_outputs(out, lse, w_out, w_lse):
    """`sum(w_out * out) + sum(w_lse * lse over its finite entries)`, in at least float32:
    a random linear function of both outputs, so that both cotangents are exercised."""
    # At least float32 (half-precision sums), float64 kept for the x64 tests.
    wide = jnp.float64 if out.dtype == jnp.float64 else jnp.float32
    finite_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return (jnp.sum(out.astype(wide) * w_out.astype(wide))
            + jnp.sum(finite_lse.astype(wide) * w_lse.astype(wide)))


def linear_loss(fn, weights_key, **kwargs):
    """`linear_in_outputs` of `fn(q, k, v, **kwargs)`, weights drawn from `weights_key`."""

    def loss(q, k, v):
        out, lse = fn(q, k, v, **kwargs)
        wide = jnp.float64 if out.dtype == jnp.float64 else jnp.float32
        w_out = jax.random.normal(weights_key, out.shape, wide)
        w_lse = jax.random.normal(jax.random.fold_in(weights_key, 1), lse.shape, wide)
        return linear_in_outputs(out, lse, w_out, w_lse)

    return loss


def seeded_linear_loss(fn, *args, **kwargs):
    """`(loss, (out, lse))`: `linear_in_outputs` of `(out, lse) = fn(*args, **kwargs)` with
    fixed weights (`seeded_normal` seeds 3 and 4)."""
    out, lse = fn(*args, **kwargs)
    w_out, w_lse = seeded_normal(3, out.shape), seeded_normal(4, lse.shape)
    return linear_in_outputs(out, lse, w_out, w_lse), (out, lse)


def values_and_grads(fn, *args, **kwargs):
    """`((out, lse), grads)`: `fn(*args, **kwargs)` and the gradients of
    `seeded_linear_loss` with respect to every positional argument, as one compiled
    program."""

    def loss(*args):
        return seeded_linear_loss(fn, *args, **kwargs)

    grad = jax.jit(jax.grad(loss, argnums=tuple(range(len(args))), has_aux=True))
    grads, outputs = grad(*args)
    return outputs, grads


def outputs_and_grads(fn, q, k, v, weights_key, **kwargs):
    """`((out, lse), (dq, dk, dv))` of `linear_loss`, compiled once (forward and backward)."""
    loss = linear_loss(fn, weights_key, **kwargs)

    def loss_with_outputs(q, k, v):
        return loss(q, k, v), fn(q, k, v, **kwargs)

    grad = jax.jit(jax.grad(loss_with_outputs, argnums=(0, 1, 2), has_aux=True))
    grads, outputs = grad(q, k, v)
    return outputs, grads


def python_blocks(path) -> list[str]:
    """The ```python blocks of a Markdown file, in order."""
    import pathlib
    import re

    return re.findall(r"```python\n(.*?)```", pathlib.Path(path).read_text(), flags=re.DOTALL)


def run_block(code: str, name: str) -> None:
    """Run a documentation block as a user would: fresh globals, JAX's default settings."""
    with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
        exec(compile(code, name, "exec"), {})


# The example counts below are written for the `ci` profile's 15 examples per property.
_CI_EXAMPLES = 15


def examples(n: int) -> settings:
    """`n` examples at the `ci` profile's scale, scaled with the loaded profile (`ci`: 6
    of 15; `dev`: 200 of 15), at least 2; no deadline."""
    scaled = round(n * settings().max_examples / _CI_EXAMPLES)
    return settings(max_examples=max(2, scaled), deadline=None)


# A score_mod and a mask_mod the Pallas kernels run (elementwise, holding no arrays): a
# soft cap with a per-head distance penalty; a window per head, a prefix per batch
# element, and rows it empties.
def capped_distance(score, b, h, i, j):
    return 20.0 * jnp.tanh(score / 20.0) - 0.05 * (h + 1).astype(score.dtype) * jnp.abs(
        i - j).astype(score.dtype)


def sliding_prefix(b, h, i, j):
    return (((j <= i) & (i - j < 40 + 10 * h)) | (j < 8 * (b + 1))) & (i % 50 != 7)
