"""`over_band`: the pure-JAX kernels' loop over the key (or query) blocks of one query
(or key) block, as the block plan (`_kernels.schedule`) lists them."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ..._core.compat import varying_axes
from ..._mods.block_mask import EMPTY, FULL
from ..schedule import Bands, Limits


def _whole_run(full_lo: Array, full_hi: Array, limits: Limits | None, outer: Array
               ) -> tuple[Array, Array]:
    """The static whole run `[full_lo, full_hi)` of one outer block intersected with the
    run that is whole by position (`Limits.full_lo`), if any."""
    if limits is None or limits.full_lo is None or limits.full_hi is None:
        return full_lo, full_hi
    new_lo = jnp.clip(limits.full_lo[outer], full_lo, full_hi)
    return new_lo, jnp.clip(limits.full_hi[outer], new_lo, full_hi)


def over_band(
    bands: Bands, outer: Array, step: Callable[[Any, Array, bool], Any], carry: Any,
    limits: Limits | None = None,
) -> Any:
    """Fold `step(carry, inner_block, masked)` over the inner blocks of one outer block:
    first the whole ones (`masked=False`: no positional mask, no `mask_mod`), then those
    that need their masks; all clipped to `limits` (`run_limits`) if given. Trip counts
    are dynamic, so every outer block shares one compiled loop. A single inner block is
    visited through a switch instead (`_only_block`)."""
    if limits is not None and limits.flags is not None:
        return _over_listed(bands, outer, step, carry, limits, limits.flags)
    # The band's three runs: partial [lo, full_lo), whole [full_lo, full_hi), partial
    # [full_hi, hi). Clipping every end into [seg_lo, seg_hi] intersects each run with it.
    ends = [jnp.asarray(x)[outer] for x in bands.runs]
    if limits is not None:
        ends = [jnp.clip(x, limits.lo[outer], limits.hi[outer]) for x in ends]
    lo, full_lo, full_hi, hi = ends
    full_lo, full_hi = _whole_run(full_lo, full_hi, limits, outer)
    by_position = limits is not None and limits.full_lo is not None
    if bands.inner == 1:
        return _only_block(step, carry, full_hi > full_lo, hi > lo)
    if int(np.max(bands.full_hi - bands.full_lo, initial=0)) > 0:
        carry = jax.lax.fori_loop(full_lo, full_hi, lambda j, c: step(c, j, False), carry)
    if bands.max_partial > 0 or by_position:
        n_left = full_lo - lo

        def partial(t, c):
            return step(c, jnp.where(t < n_left, lo + t, full_hi + t - n_left), True)

        carry = jax.lax.fori_loop(0, n_left + hi - full_hi, partial, carry)
    return carry


def _over_listed(
    bands: Bands, outer: Array, step: Callable[[Any, Array, bool], Any], carry: Any,
    limits: Limits, flags: Array,
) -> Any:
    """`over_band` with a `block_mask`: its blocks need not form runs, so the outer
    block's inner blocks are listed, whole ones (full by position and by the flags)
    first, then the rest of the non-empty ones, as FlexAttention's `full_kv_indices`
    and `kv_indices`. Two branch-free loops over the list: a per-block `lax.cond` on
    the flag would move the accumulators in and out of a separate computation."""
    lo, full_lo, full_hi, hi = (jnp.asarray(x)[outer] for x in bands.runs)
    full_lo, full_hi = _whole_run(full_lo, full_hi, limits, outer)
    lo, hi = jnp.maximum(lo, limits.lo[outer]), jnp.minimum(hi, limits.hi[outer])
    inner = jnp.arange(flags.shape[1], dtype=jnp.int32)
    flag = flags[outer]
    inside = (inner >= lo) & (inner < hi) & (flag != EMPTY)
    whole = inside & (inner >= full_lo) & (inner < full_hi) & (flag == FULL)
    if bands.inner == 1:
        return _only_block(step, carry, whole[0], inside[0])
    rank = jnp.where(whole, 0, jnp.where(inside, 1, 2)).astype(jnp.int32)
    order = jnp.argsort(rank, stable=True).astype(jnp.int32)
    n_whole = jnp.sum(whole, dtype=jnp.int32)
    n_inside = jnp.sum(inside, dtype=jnp.int32)
    carry = jax.lax.fori_loop(0, n_whole, lambda t, c: step(c, order[t], False), carry)
    return jax.lax.fori_loop(n_whole, n_inside, lambda t, c: step(c, order[t], True), carry)


def _only_block(step: Callable[[Any, Array, bool], Any], carry: Any, whole: Array,
                inside: Array) -> Any:
    """The one inner block (0) of an outer block when there is only one: `step` once,
    unmasked if `whole`, masked if only `inside`, else not at all, as a switch. In a loop
    the block's slices do not depend on the (then folded) index, and XLA's loop-invariant
    code motion hoists the whole tile out of the loop, computing it even where the loop
    runs no step, once per loop: a backward with one query block against 8 key blocks, 2
    of them within a causal window on positions, took 29.6 ms in loops, 6.5 ms so.

    Under `shard_map(check_vma=True)` the flags vary over the mesh when run-time
    operands (segment ids, positions) give them, and batching a switch on a varying
    index (the heads' `vmap`) evaluates its branches on operands cast to vary, against
    a jaxpr traced with them invariant ("mul requires varying manual axes to match").
    A batched switch computes its branches and selects anyway: there the block is
    visited masked (exact on a whole block too) and kept where it is inside."""
    zero = jnp.zeros((), jnp.int32)
    if varying_axes(inside) | varying_axes(whole):
        new = step(carry, zero, True)
        return jax.tree.map(lambda n, c: jnp.where(inside, n, c), new, carry)
    which = jnp.where(whole, 1, jnp.where(inside, 2, 0))
    return jax.lax.switch(which, [lambda c: c, lambda c: step(c, zero, False),
                                  lambda c: step(c, zero, True)], carry)
