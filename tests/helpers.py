"""Shared test helpers: tolerances per dtype and comparisons that report where and how far."""

import jax
import jax.numpy as jnp
import numpy as np

try:  # the float64 context manager: `jax.enable_x64` on new jax,
    from jax import enable_x64 as enable_x64
except ImportError:  # `jax.experimental.enable_x64` on the oldest supported (0.7)
    from jax.experimental import enable_x64 as enable_x64

# (rtol, atol) for outputs compared against a float32/float64 reference.
TOLERANCE = {
    jnp.dtype(jnp.float64): (1e-10, 1e-10),
    jnp.dtype(jnp.float32): (1e-5, 2e-5),
    jnp.dtype(jnp.bfloat16): (3e-2, 3e-2),
    jnp.dtype(jnp.float16): (5e-3, 5e-3),
}


def assert_close(actual, expected, dtype=jnp.float32, scale=1.0, name="value"):
    rtol, atol = TOLERANCE[jnp.dtype(dtype)]
    a = np.asarray(jnp.asarray(actual, jnp.float64) if jax.config.jax_enable_x64
                   else jnp.asarray(actual, jnp.float32))
    e = np.asarray(jnp.asarray(expected, a.dtype))
    np.testing.assert_allclose(a, e, rtol=rtol * scale, atol=atol * scale, err_msg=name)


def assert_lse_close(actual, expected, dtype=jnp.float32, scale=1.0):
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    np.testing.assert_array_equal(np.isneginf(a), np.isneginf(e), err_msg="lse -inf pattern")
    finite = np.isfinite(e)
    rtol, atol = TOLERANCE[jnp.dtype(dtype)]
    np.testing.assert_allclose(a[finite], e[finite], rtol=rtol * scale, atol=atol * scale,
                               err_msg="lse")


def normal(key, shape, dtype=jnp.float32, std=1.0):
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def qkv(key, q_shape, k_shape, dim_v=None, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(key, 3)
    v_shape = (*k_shape[:-1], k_shape[-1] if dim_v is None else dim_v)
    return normal(kq, q_shape, dtype), normal(kk, k_shape, dtype), normal(kv, v_shape, dtype)


def linear_loss(fn, weights_key, **kwargs):
    """A random linear function of out and of the finite lse: exercises both cotangents."""

    def loss(q, k, v):
        out, lse = fn(q, k, v, **kwargs)
        w_out = jax.random.normal(weights_key, out.shape, jnp.float32)
        w_lse = jax.random.normal(jax.random.fold_in(weights_key, 1), lse.shape, jnp.float32)
        finite_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(
            finite_lse.astype(jnp.float32) * w_lse
        )

    return loss


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
