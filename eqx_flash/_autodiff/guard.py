"""`derivative_guard`: zero, whose derivative raises wherever it is used.

Each derivative rule of the package is exact up to some order and passes its residuals
through `stop_gradient` beyond it (`linear` to `second_order`; `second_order` for the
third order). What that drops must never be silently missing, so the rule adds one more
residual, `derivative_guard(message, dtype, *inputs)`: exactly zero, and its derivative
with respect to `inputs` is `_unsupported_p`, a primitive that raises `message` when it
is evaluated, compiled or transposed. The rule adds that derivative to its output
tangents (forward or transposed). Programs of the supported orders contain no trace of
it: JAX's linearisation removes dead code before transposing, so the guard only fires
when an unsupported term actually reaches an output.
"""

import functools

import jax
import jax.numpy as jnp
from jax import core
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

THIRD_ORDER_MESSAGE = (
    "eqx_flash: this needs a third-order derivative of flash attention (a derivative of "
    "a Hessian-vector product, a jax.hessian or a gradient of a gradient with respect "
    "to q, k, v, a bias, ALiBi slopes or a score_mod's arrays), which is not supported. "
    "First and second order work: jax.grad, jax.jvp, jax.hessian, jax.jvp of jax.grad, "
    "jax.grad of jax.grad, jax.jacfwd of jax.jacfwd. Use eqx_flash.plain_attention "
    "(which materialises the logits) where you need higher orders."
)


def _unsupported(*args, dtype, message):
    del args, dtype
    raise NotImplementedError(message)


_unsupported_p = Primitive("eqx_flash_derivative_unsupported")
_unsupported_p.def_impl(_unsupported)
_unsupported_p.def_abstract_eval(lambda *args, dtype, message: core.ShapedArray((), dtype))


def _unsupported_lowering(ctx, *args, dtype, message):
    del ctx, args, dtype
    raise NotImplementedError(message)


def _unsupported_transpose(ct, *args, dtype, message):
    del dtype
    if type(ct) is ad.Zero:
        return [None] * len(args)
    raise NotImplementedError(message)


def _unsupported_jvp(primals, tangents, *, dtype, message):
    out = _unsupported_p.bind(*primals, dtype=dtype, message=message)
    nonzero = [t for t in tangents if type(t) is not ad.Zero]
    if not nonzero:
        return out, ad.Zero(core.ShapedArray((), dtype))
    return out, _unsupported_p.bind(*nonzero, dtype=dtype, message=message)


def _unsupported_batch(args, dims, *, dtype, message):
    del dims
    return _unsupported_p.bind(*args, dtype=dtype, message=message), None


mlir.register_lowering(_unsupported_p, _unsupported_lowering)
ad.primitive_jvps[_unsupported_p] = _unsupported_jvp
ad.primitive_transposes[_unsupported_p] = _unsupported_transpose
batching.primitive_batchers[_unsupported_p] = _unsupported_batch


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def derivative_guard(message, dtype, *inputs):
    """Zero, whose derivative with respect to `inputs` raises `message`."""
    del message, inputs
    return jnp.zeros((), dtype)


@functools.partial(derivative_guard.defjvp, symbolic_zeros=True)
def _derivative_guard_jvp(message, dtype, primals, tangents):
    del primals
    nonzero = [t for t in tangents if type(t) is not SymbolicZero]
    zero = jnp.zeros((), dtype)
    if not nonzero:
        return zero, zero
    return zero, _unsupported_p.bind(*nonzero, dtype=jnp.dtype(dtype), message=message)


def is_zero_tangent(t) -> bool:
    """A tangent that is known to be zero (symbolic, or of a non-float input)."""
    return type(t) is ad.Zero or jnp.dtype(t.dtype) == jax.dtypes.float0


def add_guard_tangent(out_t: list, z_t) -> list:
    """The output tangents with the guard's tangent added (when it has one)."""
    if is_zero_tangent(z_t):
        return out_t
    return [t + z_t.astype(t.dtype) for t in out_t]
