"""Forward-mode AD (`jax.jvp`, `jax.linearize`, `jax.jacfwd`) through flash attention,
checked against forward mode through `plain_attention`; reverse mode still runs the
hand-written backward; third-order uses raise a clear error (second order:
`test_second_order.py`)."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, examples
from hypothesis import given

import eqx_flash
from eqx_flash import (
    FlashAttention,
    FlashMultiheadAttention,
    causal_flash_attention,
    flash_attention,
    plain_attention,
)
from eqx_flash.testing import TOLERANCES, AttentionInputs, attention_inputs, check_attention

THIRD_ORDER = "third-order derivative of flash attention"


def _inputs(seed=0, *, batch=(2,), heads=4, kv_heads=2, seq_q=37, seq_k=53, dim=8, dim_v=8,
            dtype=jnp.float32, **kwargs) -> AttentionInputs:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((*batch, heads, seq_q, dim), np.float32) * 1.5
    k = rng.standard_normal((*batch, kv_heads, seq_k, dim), np.float32)
    v = rng.standard_normal((*batch, kv_heads, seq_k, dim_v), np.float32)
    q, k, v = (jnp.asarray(x).astype(dtype) for x in (q, k, v))
    return AttentionInputs(q, k, v, {"block_q": 16, "block_k": 16, **kwargs})


def _key_mask(seq_k=53):
    return jnp.asarray(np.random.default_rng(1).random((2, seq_k)) < 0.7)


# Few configurations, each with several options at once, keep the compile count low
# (GQA: the two with options; MQA and no leading axes: the plain one).
OPTIONS = {
    "plain_mqa_no_leading_axes": {"batch": (), "heads": 3, "kv_heads": 1},
    "masks_positional_softcap_scale": {
        "mask": _key_mask(),
        "attn_mask": jnp.asarray(np.random.default_rng(2).random((37, 53)) < 0.6),
        "q_segment_ids": jnp.asarray(np.sort(np.random.default_rng(3).integers(0, 3, (2, 37)))),
        "kv_segment_ids": jnp.asarray(np.sort(np.random.default_rng(4).integers(0, 3, (2, 53)))),
        "causal": True, "window": (9, 3), "softcap": 2.0, "scale": 0.7,
    },
    "dropout_everything": {
        "mask": _key_mask(), "causal": True, "window": (20, 0), "softcap": 3.0, "scale": 0.4,
        "dropout_rate": 0.3, "key": jax.random.key(6),
    },
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_jvp_matches_plain_attention(name):
    check_attention(flash_attention, _inputs(**OPTIONS[name]), grads=False, jvp=True)


def test_jvp_low_precision():
    check_attention(flash_attention, _inputs(dtype=jnp.bfloat16, causal=True), grads=False,
                    jvp=True)


@given(attention_inputs(dtypes=(jnp.float32,), max_seq=64, dims=(8,),
                        batch_shapes=((), (2,)), block_sizes=(16, None)))
@examples(6)
def test_jvp_property(inputs):
    check_attention(flash_attention, inputs, grads=False, jvp=True)


def test_checker_catches_a_wrong_tangent():
    """`check_attention(jvp=True)` fails a function whose tangent is off (the checker can
    fail): plain attention whose jvp is perturbed."""

    @jax.custom_jvp
    def wrong(q, k, v):
        return plain_attention(q, k, v)

    @wrong.defjvp
    def wrong_jvp(primals, tangents):
        out, d_out = jax.jvp(plain_attention, primals, tangents)
        return out, (d_out[0] * 1.01, d_out[1])

    # (The inputs of "plain_mqa_no_leading_axes": the reference's programs are compiled.)
    inputs = _inputs(**OPTIONS["plain_mqa_no_leading_axes"])
    with pytest.raises(AssertionError, match="d_out"):
        check_attention(lambda q, k, v: wrong(q, k, v), inputs, grads=False, jvp=True)


def test_fully_masked_rows_have_zero_finite_tangents():
    # (NumPy, placed on the device, and checked in NumPy: no eager op to compile.)
    mask = np.zeros((2, 4, 37, 53), bool)
    mask[:, :, 5:] = True
    inputs = _inputs(attn_mask=jax.device_put(mask))
    tangents = jax.device_put(tuple(np.ones(x.shape, np.float32)
                                    for x in (inputs.q, inputs.k, inputs.v)))
    primals, tangents_out = jax.jvp(
        lambda q, k, v: flash_attention(q, k, v, **inputs.kwargs),
        (inputs.q, inputs.k, inputs.v), tangents,
    )
    (out, lse), (d_out, d_lse) = ((np.asarray(a), np.asarray(b))
                                  for a, b in (primals, tangents_out))
    assert np.all(np.isneginf(lse[:, :, :5])) and np.all(out[:, :, :5] == 0)
    assert np.all(d_out[:, :, :5] == 0) and np.all(d_lse[:, :, :5] == 0)
    assert np.all(np.isfinite(d_out)) and np.all(np.isfinite(d_lse))


def _plain_and_flash(**kwargs):
    def flash(q, k, v):
        return flash_attention(q, k, v, block_q=4, block_k=4, **kwargs)

    def plain(q, k, v):
        return plain_attention(q, k, v, **kwargs)

    return flash, plain


def _ones_like(*arrays):
    """Ones of each array's shape (float32), made in NumPy: no eager op to compile."""
    return jax.device_put(tuple(np.ones(x.shape, np.float32) for x in arrays))


def test_jacfwd_and_linearize():
    inputs = _inputs(batch=(), heads=2, kv_heads=1, seq_q=5, seq_k=7, dim=4, dim_v=3)
    flash, plain = _plain_and_flash(causal=True, softcap=2.0)
    args = (inputs.q, inputs.k, inputs.v)
    tol = TOLERANCES[jnp.dtype(jnp.float32)].grad[0]
    tangents = _ones_like(*args)

    @jax.jit  # each side compiled whole: faster than op by op
    def flash_derivatives(*args):
        return (jax.jacfwd(flash, argnums=(0, 1, 2))(*args),
                jax.linearize(flash, *args)[1](*tangents))

    @jax.jit
    def plain_derivatives(*args):
        return jax.jacfwd(plain, argnums=(0, 1, 2))(*args), jax.jvp(plain, args, tangents)[1]

    (got, d_got), (expected, d_expected) = flash_derivatives(*args), plain_derivatives(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        b = np.asarray(b)
        np.testing.assert_allclose(a, b, atol=tol * float(np.abs(b).max()) + 1e-6)
    for a, b in zip(d_got, d_expected, strict=True):
        assert_close(a, b, kind="grad")


def _linear_eqns(jaxpr) -> list[bool]:
    """The `transposed` flag of every forward-mode linear kernel call in a jaxpr."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "eqx_flash_attention_linear":
            found.append(eqn.params["transposed"])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _linear_eqns(sub)
    return found


def test_grad_uses_the_backward_kernel():
    """Reverse mode transposes the linear call into the hand-written backward kernel (never
    an autodiff transpose of the tangent kernel), for any subset of q, k, v."""
    inputs = _inputs(causal=True)
    flash, plain = _plain_and_flash(causal=True)
    subsets = [(1,), (0, 2), (0, 1, 2)]

    def loss(fn, argnums):
        def f(q, k, v):
            out, lse = fn(q, k, v)
            return jnp.sum(out**2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

        return jax.grad(f, argnums=argnums)

    args = (inputs.q, inputs.k, inputs.v)
    for argnums in subsets:
        calls = _linear_eqns(jax.make_jaxpr(loss(flash, argnums))(*args).jaxpr)
        assert calls == [True], (argnums, calls)  # one backward-kernel call, no tangent kernel
    # Every subset in one compiled program; the reference's gradients are those of all three.
    got = jax.jit(lambda *a: [loss(flash, argnums)(*a) for argnums in subsets])(*args)
    expected = jax.jit(loss(plain, (0, 1, 2)))(*args)
    for argnums, grads in zip(subsets, got, strict=True):
        for i, a in zip(argnums, grads, strict=True):
            b = np.asarray(expected[i])
            np.testing.assert_allclose(a, b, atol=1e-4 * float(np.abs(b).max()))


def _primitive_names(jaxpr) -> list[str]:
    """The package's primitives bound in a jaxpr, in order (sub-jaxprs included)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name.startswith("eqx_flash_attention"):
            found.append(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _primitive_names(sub)
    return found


def test_jvp_runs_the_one_pass_kernel_and_linearize_the_two():
    """`jax.jvp` binds the one-pass primitive (forward and tangents in one kernel, no
    linear call); `jax.linearize` splits it into the forward (known) and the linear
    primitive (the tangent kernel), which `jax.grad` transposes."""
    inputs = _inputs(causal=True)
    flash, _ = _plain_and_flash(causal=True)
    args = (inputs.q, inputs.k, inputs.v)
    tangents = tuple(jnp.cos(x) for x in args)
    jvp = jax.make_jaxpr(lambda *a: jax.jvp(flash, a, tangents))(*args)
    assert _primitive_names(jvp.jaxpr) == ["eqx_flash_attention_jvp"]
    linearized = jax.make_jaxpr(lambda *a: jax.linearize(flash, *a)[1](*tangents))(*args)
    assert _primitive_names(linearized.jaxpr) == ["eqx_flash_attention_linear"]


def test_gradient_of_a_checkpointed_jvp():
    """The sCM/MeanFlow pattern under `jax.checkpoint` (the default policy, which JAX's
    partial evaluation runs as `nothing_saveable`, and `everything_saveable`): its partial
    evaluation splits the one-pass primitive inside the checkpointed jaxpr
    (`partial_eval_jaxpr_custom`). (Both policies against one reference: they change what
    is saved, not the numbers.)"""
    inputs = _inputs(batch=(), causal=True)
    flash, plain = _plain_and_flash(causal=True)
    dq = jax.device_put(np.sin(np.asarray(inputs.q)))
    everything = jax.checkpoint_policies.everything_saveable
    policies = [jax.checkpoint, functools.partial(jax.checkpoint, policy=everything)]

    def loss(fn, ckpt):
        def f(q, k):
            _, (d_out, d_lse) = jax.jvp(lambda q: fn(q, k, inputs.v), (q,), (dq,))
            return jnp.sum(d_out**2) + jnp.sum(d_lse)
        return jax.jit(jax.grad(ckpt(f), argnums=(0, 1)))

    expected = loss(plain, jax.checkpoint)(inputs.q, inputs.k)
    for ckpt in policies:
        got = loss(flash, ckpt)(inputs.q, inputs.k)
        for a, b in zip(got, expected, strict=True):
            assert_close(a, b, kind="grad")


def test_jacfwd_along_tangents_runs_the_forward_once():
    """`vmap` of a jvp over the tangents alone (`jax.jacfwd`) batches the decomposition:
    one forward kernel, the tangent kernel mapped; over the primals, the one-pass
    primitive mapped."""
    inputs = _inputs(batch=(), causal=True)
    flash, plain = _plain_and_flash(causal=True)
    args = (inputs.q, inputs.k, inputs.v)
    q = np.asarray(inputs.q)  # (inputs made in NumPy: no eager op to compile)
    dqs = jax.device_put(np.stack([np.sin(q), np.cos(q)]))
    qs = jax.device_put(np.stack([q, 0.5 * q]))

    def tangents_only(fn):
        return jax.vmap(lambda d: jax.jvp(lambda q: fn(q, *args[1:]), (args[0],), (d,)))

    def both(fn):
        return jax.vmap(lambda q, d: jax.jvp(lambda q: fn(q, *args[1:]), (q,), (d,)))

    jaxpr = jax.make_jaxpr(tangents_only(flash))(dqs)
    assert _primitive_names(jaxpr.jaxpr) == ["eqx_flash_attention_linear"]
    assert _primitive_names(jax.make_jaxpr(both(flash))(qs, dqs).jaxpr) == [
        "eqx_flash_attention_jvp"]

    @jax.jit  # each side compiled whole: faster than op by op
    def results(qs, dqs):
        return ([tangents_only(fn)(dqs) for fn in (flash, plain)],
                [both(fn)(qs, dqs) for fn in (flash, plain)])

    for got, expected in results(qs, dqs):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
            assert_close(a, b, kind="grad")


def test_vmap_and_checkpoint_compose():
    inputs = _inputs(batch=(), causal=True)
    flash, plain = _plain_and_flash(causal=True)
    q = np.asarray(inputs.q)
    qs = jax.device_put(np.stack([q, 2 * q]))
    tangents = jax.device_put(np.ones(qs.shape, np.float32))

    def jvp_out(fn):
        return jax.vmap(lambda q, t: jax.jvp(lambda q: fn(q, inputs.k, inputs.v)[0],
                                             (q,), (t,))[1])(qs, tangents)

    def grad_vmapped(fn):
        return jax.grad(lambda qs: jnp.sum(jax.vmap(lambda q: fn(q, inputs.k, inputs.v)[0])(
            qs) ** 2))(qs)

    # Each side compiled whole: faster than op by op.
    (got_jvp, got_grad), (expected_jvp, expected_grad) = (
        jax.jit(lambda fn=fn: (jvp_out(fn), grad_vmapped(fn)))()
        for fn in (jax.checkpoint(flash), plain))
    assert_close(got_jvp, expected_jvp, kind="grad")
    expected_grad = np.asarray(expected_grad)
    np.testing.assert_allclose(got_grad, expected_grad,
                               atol=1e-4 * float(np.abs(expected_grad).max()))


def test_module_entry_points():
    inputs = _inputs(batch=(), heads=2, kv_heads=2, seq_q=30, seq_k=30)
    x = np.asarray(inputs.q).transpose(1, 0, 2).reshape(30, 16)
    x, t = jax.device_put((x, np.cos(x)))  # (NumPy: no eager op to compile)
    flash = FlashMultiheadAttention(4, 16, causal=True, key=jax.random.key(0))
    # FlashMultiheadAttention(causal=True) is eqx.nn.MultiheadAttention with a causal mask.
    mha = eqx.nn.MultiheadAttention(4, 16, key=jax.random.key(0))
    causal = jax.device_put(np.tril(np.ones((30, 30), bool)))
    # Each side compiled whole: faster than op by op.
    got = eqx.filter_jit(lambda x, t: jax.jvp(lambda x: flash(x, x, x), (x,), (t,)))(x, t)
    expected = eqx.filter_jit(lambda x, t: jax.jvp(lambda x: mha(x, x, x, causal), (x,),
                                                   (t,)))(x, t)
    for a, b in zip(got, expected, strict=True):
        assert_close(a, b, kind="grad")

    attention = FlashAttention(causal=True)
    q, k, v = inputs.q, inputs.k, inputs.v
    tangents = _ones_like(q, k, v)
    functions = (lambda q, k, v: attention(q, k, v),
                 lambda q, k, v: causal_flash_attention(q, k, v)[0],
                 lambda q, k, v: plain_attention(q, k, v, causal=True)[0])
    got, expected, reference = jax.jit(
        lambda *a: [jax.jvp(f, a, tangents)[1] for f in functions])(q, k, v)
    np.testing.assert_allclose(got, expected, atol=1e-6)
    assert_close(got, reference, kind="grad")


class _Net(eqx.Module):
    """A small consistency-style network: x -> x + attention(x * t)."""

    attention: eqx.Module
    proj: eqx.nn.Linear

    def __call__(self, x, t):
        h = jax.vmap(self.proj)(x) * t
        return x + self.attention(h, h, h)


def _scm_loss(net, x, t, v):
    """sCM/MeanFlow pattern: grad of a loss on the jvp's primal, target built from the
    tangent under stop_gradient."""
    u, du = jax.jvp(net, (x, t), (v, jnp.ones_like(t)))
    target = jax.lax.stop_gradient(u - 0.5 * du)
    return jnp.mean((u - target) ** 2) + jnp.mean(u**2)


def test_scm_pattern_gradient_matches_plain():
    key = jax.random.key(0)
    k1, k2, k3 = jax.random.split(key, 3)
    mha = eqx.nn.MultiheadAttention(4, 16, key=k1)
    proj = eqx.nn.Linear(16, 16, key=k2)
    flash_net = _Net(FlashMultiheadAttention.from_eqx(mha, block_q=8, block_k=8), proj)
    plain_net = _Net(mha, proj)
    x = jax.random.normal(k3, (24, 16))
    v, t = jnp.sin(x), jnp.asarray(0.7)

    def grads(net):
        return eqx.filter_jit(eqx.filter_grad(_scm_loss))(net, x, t, v)

    got, expected = grads(flash_net), grads(plain_net)
    assert_close(got.proj.weight, expected.proj.weight, kind="grad")
    np.testing.assert_allclose(got.attention.query_proj.weight,
                               expected.attention.query_proj.weight, atol=1e-4)


def test_loss_on_the_tangent_is_differentiated():
    """A gradient through the jvp tangent (no stop_gradient) needs the second-order term:
    it is computed (`_autodiff.second_order`), as forward mode through plain_attention
    gives it; and differentiating the tangent along another tangent is linear."""
    inputs = _inputs(causal=True)
    flash_fn, plain_fn = _plain_and_flash(causal=True)

    def loss(fn, q):
        _, (d_out, _) = jax.jvp(lambda q: fn(q, inputs.k, inputs.v), (q,), (q,))
        return jnp.sum(d_out**2)

    def tangent_of(fn, d):
        return jax.jvp(lambda q: fn(q, inputs.k, inputs.v)[0], (inputs.q,), (d,))[1]

    @functools.partial(jax.jit, static_argnums=0)  # each side compiled whole
    def derivatives(fn, q, d):
        return (jax.grad(functools.partial(loss, fn))(q),
                jax.jvp(lambda d: tangent_of(fn, d), (d,), (q,))[1])

    (d,) = _ones_like(inputs.q)
    (got, got_tangent), (expected, expected_tangent) = (
        derivatives(fn, inputs.q, d) for fn in (flash_fn, plain_fn))
    assert_close(got, expected, kind="grad", scale=4)
    assert_close(got_tangent, expected_tangent, kind="grad")


@pytest.mark.parametrize("how", ["grad_of_hvp", "jvp_of_hessian", "jvp_of_jvp_of_jvp"])
def test_third_order_raises_clearly(how):
    inputs = _inputs(batch=(), heads=1, kv_heads=1, seq_q=3, seq_k=4, dim=2, dim_v=2)
    k, v = inputs.k, inputs.v

    def f(q):
        return jnp.sum(flash_attention(q, k, v, block_q=2, block_k=2)[0] ** 2)

    def hvp(q):
        return jax.jvp(jax.grad(f), (q,), (q,))[1]

    def jvp2(q):
        return jax.jvp(lambda q: jax.jvp(f, (q,), (q,))[1], (q,), (q,))[1]

    q = inputs.q
    # Under `jax.jit`: raised while tracing, before anything is compiled.
    with pytest.raises(NotImplementedError, match=THIRD_ORDER):
        if how == "grad_of_hvp":
            jax.jit(jax.grad(lambda q: jnp.sum(hvp(q) ** 2)))(q)
        elif how == "jvp_of_hessian":
            jax.jit(lambda q: jax.jvp(jax.hessian(f), (q,), (q,)))(q)
        else:
            jax.jit(lambda q: jax.jvp(jvp2, (q,), (q,)))(q)


def test_ring_forward_mode_on_one_device():
    """jax.jvp through sharded_flash_attention (the ring, #25) equals the single-device
    jvp, along q, k, v, a bias and ALiBi slopes, with a key mask; reverse mode still runs
    the ring's own backward. (Several devices: `multidevice_checks.py`.)"""
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
    inputs = _inputs(batch=(2,), heads=4, kv_heads=2, seq_q=32, seq_k=32)
    mask = _key_mask(32)
    bias = jnp.asarray(np.random.default_rng(5).standard_normal((4, 32, 32)), jnp.float32)
    slopes = jnp.array([0.1, 0.2, 0.3, 0.4])

    def ring(q, k, v, bias, slopes):
        return eqx_flash.sharded_flash_attention(q, k, v, mask, mesh=mesh, seq_axis="seq",
                                                 causal=True, bias=bias, alibi_slopes=slopes)

    def single(q, k, v, bias, slopes):
        return flash_attention(q, k, v, mask, causal=True, bias=bias, alibi_slopes=slopes)

    primals = (inputs.q, inputs.k, inputs.v, bias, slopes)
    tangents = tuple(jnp.cos(x) for x in primals)
    got = jax.jit(lambda p, t: jax.jvp(ring, p, t))(primals, tangents)
    expected = jax.jvp(single, primals, tangents)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        assert_close(a, b, kind="grad")
    # A zero tangent (here all but q's) costs nothing and changes nothing.
    got_q = jax.jvp(lambda q: ring(q, *primals[1:]), (inputs.q,), (tangents[0],))[1]
    expected_q = jax.jvp(lambda q: single(q, *primals[1:]), (inputs.q,), (tangents[0],))[1]
    for a, b in zip(got_q, expected_q, strict=True):
        assert_close(a, b, kind="grad")
    grad = jax.grad(lambda q: jnp.sum(ring(q, *primals[1:])[0] ** 2))(inputs.q)
    expected = jax.grad(lambda q: jnp.sum(single(q, *primals[1:])[0] ** 2))(inputs.q)
    assert_close(grad, expected, kind="grad")
