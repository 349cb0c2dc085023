"""Every transformation over two nested `vmap`s agrees with the reference.

A `custom_jvp` staged into a jaxpr and then batched takes the JVP rule's primal results to
sit at the batch axes its function's results had; a rule whose results come back elsewhere
returns a value with its batch axes swapped, silently. So each composition here compares
values as well as derivatives, with each argument mapped or not at each level.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, examples, seeded_normal
from hypothesis import given
from hypothesis import strategies as st

from eqx_flash import flash_attention, plain_attention

OUTER, INNER, HEADS, SEQ, DIM = 2, 3, 2, 16, 8
BLOCKS = dict(block_q=8, block_k=8)

# A per-example operand and its shape for one example (None: no operand).
OPERANDS = {
    None: None,
    "mask": (SEQ,),
    "attn_mask": (HEADS, SEQ, SEQ),
    "bias": (HEADS, SEQ, SEQ),
    "sinks": (HEADS,),
    "segment_ids": (SEQ,),
}
TRANSFORMS = ("jit", "grad", "value_and_grad", "vjp", "linearize", "jvp", "checkpoint")


def _operand(name, seed):
    shape = OPERANDS[name]
    # Built in NumPy and put on the device (eager jax.numpy compiled a program per op).
    if name in ("mask", "attn_mask"):
        mask = np.random.default_rng(seed).random(shape) < 0.8
        mask[..., 0] = True
        return jax.device_put(mask)
    if name == "segment_ids":
        return jax.device_put(
            np.sort(np.random.default_rng(seed).integers(0, 3, shape)).astype(np.int32))
    return jax.device_put(np.float32(0.5) * np.asarray(seeded_normal(seed, shape)))


def _keywords(name, x):
    if name is None:
        return {}
    if name == "segment_ids":
        return dict(q_segment_ids=x, kv_segment_ids=x)
    return {name: x}


def _nested(attention, name, outer, inner):
    """`(q, k, v, x) -> (out, finite lse)` vmapped twice with the given in_axes."""
    blocks = BLOCKS if attention is flash_attention else {}

    def one(q, k, v, x):
        out, lse = attention(q, k, v, causal=True, **_keywords(name, x), **blocks)
        return out, jnp.where(jnp.isfinite(lse), lse, 0.0)

    return jax.vmap(jax.vmap(one, in_axes=inner), in_axes=outer)


def _batched(x, mapped_outer, mapped_inner, seed):
    """`x` for one example, with the axes the mapped levels add (fresh values per slot)."""
    lead = (OUTER,) * mapped_outer + (INNER,) * mapped_inner
    if not lead:
        return x
    # (In NumPy, as `_operand`.)
    x = np.asarray(x)
    if x.dtype == np.float32:
        fresh = np.float32(0.5) * np.asarray(seeded_normal(seed, (*lead, *x.shape)))
        return jax.device_put(fresh + x[(None,) * len(lead)])
    return jax.device_put(np.broadcast_to(x, (*lead, *x.shape)))


def _transformed(transform, f, args, tangents, weights, eager=True):
    """What `transform` gives for `f` at `args`: values and derivatives, as a flat list.
    `jax.vjp`, `jax.linearize` and `jax.jvp` run eagerly (where the reported bug was),
    unless not `eager` (the reference: one compiled program, not one per op)."""
    diff = tuple(args[:3])
    rest = args[3:]

    def g(q, k, v):
        return f(q, k, v, *rest)

    def loss(q, k, v):
        out, lse = g(q, k, v)
        return jnp.sum(out * weights[0]) + jnp.sum(lse * weights[1])

    if transform == "jit":
        return list(jax.jit(g)(*diff))
    if transform == "grad":
        return list(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*diff))
    if transform == "value_and_grad":
        value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*diff)
        return [value, *grads]
    if transform == "checkpoint":
        return list(jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)))(*diff))

    def run(*diff):
        if transform == "vjp":
            outputs, vjp = jax.vjp(g, *diff)
            return [*outputs, *vjp(weights)]
        if transform == "linearize":
            outputs, lin = jax.linearize(g, *diff)
            return [*outputs, *lin(*tangents)]
        assert transform == "jvp"
        outputs, d_outputs = jax.jvp(g, diff, tangents)
        return [*outputs, *d_outputs]

    return run(*diff) if eager else jax.jit(run)(*diff)


def _check(transform, name, axes):
    """`axes`: (outer, inner) in_axes per argument (q, k, v, operand), each 0 or None."""
    outer = tuple(a[0] for a in axes)
    inner = tuple(a[1] for a in axes)
    one = [seeded_normal(i, (HEADS, SEQ, DIM)) for i in range(3)]
    one.append(_operand(name, 3) if name is not None else jnp.zeros(()))
    args = [_batched(x, o == 0, i == 0, 10 + n)
            for n, (x, o, i) in enumerate(zip(one, outer, inner, strict=True))]
    if name is None:
        outer, inner = (*outer[:3], None), (*inner[:3], None)
        args[3] = one[3]
    flash = _nested(flash_attention, name, outer, inner)
    plain = _nested(plain_attention, name, outer, inner)
    out_shape = jax.eval_shape(flash, *args)
    weights = tuple(seeded_normal(20 + n, s.shape) for n, s in enumerate(out_shape))
    tangents = tuple(seeded_normal(30 + n, x.shape) for n, x in enumerate(args[:3]))
    got = _transformed(transform, flash, args, tangents, weights)
    want = _transformed(transform, plain, args, tangents, weights, eager=False)
    for n, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.shape == b.shape, (n, a.shape, b.shape)
        assert_close(a, b, kind="grad", scale=4.0, name=f"{transform} result {n}")


def test_issue_example_value_under_two_vmaps_and_vjp():
    """The reported case: no options, every argument mapped at both levels; `jax.vjp`,
    `jax.linearize` and `jax.jvp` returned the value with its batch axes swapped."""
    for transform in ("vjp", "linearize", "jvp", "value_and_grad"):
        _check(transform, None, ((0, 0),) * 4)


@pytest.mark.parametrize("name", ["sinks", "bias"])
def test_per_example_operand_under_two_vmaps_and_vjp(name):
    """Sinks raised a broadcasting error there; a bias gave a wrong value."""
    _check("vjp", name, ((0, 0),) * 4)


_axes = st.sampled_from([(0, 0), (0, None), (None, 0), (None, None)])


@examples(12)
@given(transform=st.sampled_from(TRANSFORMS), name=st.sampled_from(list(OPERANDS)),
       axes=st.tuples(_axes, _axes, _axes, _axes))
def test_property_every_transform_over_two_vmaps(transform, name, axes):
    """Any transform of two nested vmaps, each argument mapped or not at each level."""
    used = axes if name is not None else axes[:3]
    # vmap needs one mapped argument per level.
    if not (any(a[0] == 0 for a in used) and any(a[1] == 0 for a in used)):
        axes = ((0, 0), *axes[1:])
    _check(transform, name, axes)
