"""`merge_attention`: the results of attention over disjoint key sets, combined into the
result over their union (cascade and prefix-cached attention, chunked prefill, custom
context parallelism)."""

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from .._core.config import stat_dtype
from .._semantics.softmax import merge_all
from .binder import as_float_array


def merge_attention(outs: ArrayLike, lses: ArrayLike) -> tuple[Array, Array]:
    """Combine partial attention results by their log-sum-exp.

    **Arguments:**

    - `outs`: `(parts, *batch, heads, seq_q, dim_v)`, each part's `out` over its own key
        set (the key sets disjoint), as `flash_attention` returns it.
    - `lses`: `(parts, *batch, heads, seq_q)`, each part's lse.

    **Returns:**

    `(out, lse)` of attention over the union of the key sets: `out` in `outs`' dtype,
    `lse` in float32 (float64 for float64 inputs). Exact, and differentiable in reverse
    and forward mode. A part whose lse is `-inf` (it attended nothing) contributes
    nothing, whatever its `out` holds (NaN or inf included), and gets zero gradients; a
    row where every part is `-inf` gets `out = 0`, `lse = -inf` and finite
    (zero) gradients. An attention sink is the part `(out = 0, lse = sink)`.

    **Raises:**

    `TypeError` for non-floating inputs, `ValueError` naming the argument when the shapes
    disagree.
    """
    outs, lses = as_float_array("outs", outs), as_float_array("lses", lses)
    if outs.ndim < 2:
        raise ValueError(f"outs must have shape (parts, ..., seq_q, dim_v); got "
                         f"outs.shape={outs.shape}")
    if lses.shape != outs.shape[:-1]:
        raise ValueError(f"lses must have shape outs.shape[:-1] = {outs.shape[:-1]} (parts, "
                         f"..., seq_q); got lses.shape={lses.shape}")
    if outs.shape[0] == 0:
        raise ValueError(f"outs must hold at least one part; got outs.shape={outs.shape}")
    wide = jnp.float64 in (outs.dtype, lses.dtype)
    stat = stat_dtype(jnp.float64 if wide else jnp.float32)
    dtype, outs, lses = outs.dtype, outs.astype(stat), lses.astype(stat)
    # An empty part's out is meaningless (a buffer never written, say): its weight is 0,
    # and 0 * NaN would still be NaN, so it is dropped rather than weighted.
    outs = jnp.where((lses == -jnp.inf)[..., None], jnp.zeros((), stat), outs)
    out, lse = merge_all(outs, lses, axis=0)
    return out.astype(dtype), lse
