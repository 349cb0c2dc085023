"""The guard against second-order derivatives that the derivative rules cannot give.

The linear primitive (`linear`) requires its residuals to carry no tangents (its
transpose is a fixed kernel), so the rule (`derivatives`) passes them through
`stop_gradient`. That is exact for first-order forward and reverse mode and for the
sCM/MeanFlow pattern (`jax.grad` of a loss on the primal output of a `jax.jvp`, with the
tangent output under `stop_gradient`): there the derivative of the tangent with respect
to the residuals is never used. Where it would be used it would be silently dropped, so
it is *poisoned* instead: one more residual, `second_order_guard(...)`, is zero and keeps
its derivative, `_unsupported_p`, a primitive that raises `SECOND_ORDER_MESSAGE` when it
is evaluated, compiled or transposed; the linear primitive's JVP adds that derivative to
its output tangents (forward or transposed). First-order programs contain no trace of
it. JAX's linearisation removes dead code before transposing, so the poison only fires
when a second-order term actually reaches an output: a loss on the tangent output
itself, forward-over-forward (`jacfwd(jacfwd)`), forward-over-reverse (`hessian`) or
reverse-over-reverse.
"""

import functools

import jax
import jax.numpy as jnp
from jax import core
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

SECOND_ORDER_MESSAGE = (
    "eqx_flash: this needs a second-order derivative of flash attention (a derivative of "
    "its jvp tangent, or of its gradient, with respect to q, k, v, a bias, ALiBi slopes "
    "or a score_mod's arrays), which is not "
    "supported. First-order jax.jvp/jax.linearize/jax.jacfwd/jax.grad work, and so does "
    "jax.grad of a loss on the primal output of a jax.jvp when the tangent output enters "
    "the loss only through jax.lax.stop_gradient (the sCM/MeanFlow pattern). Wrap the "
    "jvp tangent in jax.lax.stop_gradient, or use eqx_flash.plain_attention (which "
    "materialises the logits) where you need higher-order derivatives."
)



def _unsupported(*args, dtype):
    del args, dtype
    raise NotImplementedError(SECOND_ORDER_MESSAGE)


_unsupported_p = Primitive("eqx_flash_second_order_unsupported")
_unsupported_p.def_impl(_unsupported)
_unsupported_p.def_abstract_eval(
    lambda *args, dtype: core.ShapedArray((), dtype)
)


def _unsupported_lowering(ctx, *args, dtype):
    del ctx, args, dtype
    raise NotImplementedError(SECOND_ORDER_MESSAGE)


def _unsupported_transpose(ct, *args, dtype):
    del dtype
    if type(ct) is ad.Zero:
        return [None] * len(args)
    raise NotImplementedError(SECOND_ORDER_MESSAGE)


def _unsupported_jvp(primals, tangents, *, dtype):
    out = _unsupported_p.bind(*primals, dtype=dtype)
    nonzero = [t for t in tangents if type(t) is not ad.Zero]
    if not nonzero:
        return out, ad.Zero(core.ShapedArray((), dtype))
    return out, _unsupported_p.bind(*nonzero, dtype=dtype)


def _unsupported_batch(args, dims, *, dtype):
    del dims
    return _unsupported_p.bind(*args, dtype=dtype), None


mlir.register_lowering(_unsupported_p, _unsupported_lowering)
ad.primitive_jvps[_unsupported_p] = _unsupported_jvp
ad.primitive_transposes[_unsupported_p] = _unsupported_transpose
batching.primitive_batchers[_unsupported_p] = _unsupported_batch


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def second_order_guard(dtype, *residuals):
    """Zero, whose derivative with respect to `residuals` is `_unsupported_p`."""
    del residuals
    return jnp.zeros((), dtype)


@functools.partial(second_order_guard.defjvp, symbolic_zeros=True)
def _second_order_guard_jvp(dtype, primals, tangents):
    nonzero = [t for t in tangents if type(t) is not SymbolicZero]
    zero = jnp.zeros((), dtype)
    if not nonzero:
        return zero, zero
    return zero, _unsupported_p.bind(*nonzero, dtype=jnp.dtype(dtype))
