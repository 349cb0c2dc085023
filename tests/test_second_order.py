"""Second-order derivatives through flash attention (`_autodiff.second_order`):
Hessian-vector products, `jax.hessian`, gradients of gradients and of jvp tangents, and
forward-over-forward, against the differentiable float64 oracle
(`helpers.oracle_attention`, to round-off) and against `plain_attention` for every
option; rows with nothing to attend get zero, finite second derivatives; first-order
programs are unchanged."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import enable_x64, examples, oracle_attention
from hypothesis import given

from eqx_flash import (
    FlashAttention,
    FlashMultiheadAttention,
    RelativePositionBias,
    causal_flash_attention,
    flash_attention,
    plain_attention,
)
from eqx_flash.testing import attention_inputs, check_attention

BLOCKS = dict(block_q=4, block_k=4)  # several blocks per axis


def _oracle(q, k, v, **options):
    """The oracle's `(out, lse)` (`helpers.oracle_attention`), differentiable; a row with
    no key gives out 0 and lse -inf with zero derivatives."""
    return oracle_attention(q, k, v, xp=jnp, **options)[:2]


def _flash(q, k, v, **kwargs):
    return flash_attention(q, k, v, **BLOCKS, **kwargs)


def _loss(attention, q, k, v, bias, kwargs):
    """Nonlinear in out and lse, so the loss's own curvature enters too."""
    if bias is not None:
        kwargs = dict(kwargs, bias=bias)
    out, lse = attention(q, k, v, **kwargs)
    return jnp.sum(jnp.sin(out)) + 0.5 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) ** 2)


# (shapes (batch, heads, kv_heads, seq_q, seq_k), options); float64, several blocks, ragged
# tails. No case without options: each absent option is absent from some case here.
CASES = {
    "causal_gqa": ((2, 4, 2, 10, 10), {"causal": True}),
    "key_mask_empty_rows": ((2, 2, 1, 7, 9), {"mask": np.array([[1, 0, 1, 1, 0, 1, 0, 1, 1],
                                                                [0] * 9], bool)}),
    "bias_softcap_scale": ((1, 2, 2, 9, 11), {"softcap": 2.0, "scale": 0.3, "bias": True}),
}


def _problem(shapes, options, seed=0):
    batch, heads, kv_heads, seq_q, seq_k = shapes
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float64)

    q, k = normal(batch, heads, seq_q, 4) * 1.5, normal(batch, kv_heads, seq_k, 4)
    v = normal(batch, kv_heads, seq_k, 3)
    options = dict(options)
    bias = normal(heads, seq_q, seq_k) if options.pop("bias", False) else None
    if "mask" in options:
        options["mask"] = jnp.asarray(options["mask"])
    directions = [normal(*x.shape) for x in (q, k, v)]
    directions.append(None if bias is None else normal(*bias.shape))
    return (q, k, v, bias), options, tuple(directions)


def _second_derivatives(attention, args, options, directions):
    """Every composition the issue names, each reduced to arrays."""
    q, k, v, bias = args
    with_bias = bias is not None
    argnums = (0, 1, 2, 3) if with_bias else (0, 1, 2)

    def loss(q, k, v, bias=None):
        return _loss(attention, q, k, v, bias, options)

    primals = args if with_bias else args[:3]
    tangents = directions if with_bias else directions[:3]
    grad = jax.grad(loss, argnums=argnums)
    results = {"hvp": jax.jvp(grad, primals, tangents)[1]}

    def penalty(*xs):  # a gradient penalty: |d loss / d q|^2
        return jnp.sum(jax.grad(loss)(*xs) ** 2)

    results["grad_of_grad"] = jax.grad(penalty, argnums=argnums)(*primals)

    def on_tangent(*xs):  # a loss on the jvp tangent, no stop_gradient
        def outputs(*ys):
            kwargs = dict(options, bias=ys[3]) if with_bias else options
            return attention(*ys[:3], **kwargs)

        d_out, d_lse = jax.jvp(outputs, xs, tangents)[1]
        return jnp.sum(d_out**2) + jnp.sum(jnp.where(jnp.isfinite(d_lse), d_lse, 0.0) ** 2)

    results["grad_of_tangent"] = jax.grad(on_tangent, argnums=argnums)(*primals)

    def first(*xs):  # forward over forward: a directional second derivative
        return jax.jvp(loss, xs, tangents)[1]

    results["jvp_of_jvp"] = jax.jvp(first, primals, tangents)[1]
    return results


@functools.cache
def _compiled(attention, name):
    """`_second_derivatives` of `attention` on case `name` as one jitted function, shared by
    the tests of this module (a program compiled once per dtype)."""
    with enable_x64():
        _, options, _ = _problem(*CASES[name])
    return jax.jit(functools.partial(_second_derivatives, attention, options=options))


@pytest.mark.parametrize("name", list(CASES))
def test_second_order_matches_the_reference_in_float64(name):
    with enable_x64():
        args, _, directions = _problem(*CASES[name])
        got = _compiled(_flash, name)(args, directions=directions)
        expected = _compiled(_oracle, name)(args, directions=directions)
        for what in expected:
            for a, b in zip(jax.tree.leaves(got[what]), jax.tree.leaves(expected[what]),
                            strict=True):
                assert a.dtype == jnp.float64
                np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-11, err_msg=what)
                assert np.all(np.isfinite(a)), what


def test_hessian_and_jacfwd_of_jacfwd_match_the_reference_in_float64():
    with enable_x64():
        (q, k, v, _), _, _ = _problem((1, 1, 1, 5, 6), {})

        @functools.partial(jax.jit, static_argnums=0)
        def both(attention, q):
            def f(q):
                return _loss(attention, q, k, v, None, {"causal": True})

            return jax.hessian(f)(q), jax.jacfwd(jax.jacfwd(f))(q)

        for got, expected in zip(both(_flash, q), both(_oracle, q), strict=True):
            assert got.shape == q.shape * 2
            np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-11)


def test_rows_with_nothing_to_attend_have_zero_second_derivatives():
    """A batch element whose keys are all masked (and query padding past q_lengths):
    finite, zero second derivatives for its rows."""
    with enable_x64():
        args, _, directions = _problem(*CASES["key_mask_empty_rows"])
        got = _compiled(_flash, "key_mask_empty_rows")(args, directions=directions)
        for what in ("hvp", "grad_of_grad", "grad_of_tangent"):
            dq = np.asarray(got[what][0])
            assert np.all(np.isfinite(dq)), what
            np.testing.assert_array_equal(dq[1], 0.0, err_msg=what)

        q, k, v, _ = args

        def loss(q):
            out, _ = flash_attention(q, k, v, q_lengths=jnp.array([4, 0]), **BLOCKS)
            return jnp.sum(jnp.sin(out))

        hvp = np.asarray(jax.jit(lambda q, d: jax.jvp(jax.grad(loss), (q,), (d,))[1])(
            q, directions[0]))
        np.testing.assert_array_equal(hvp[0, :, 4:], 0.0)
        np.testing.assert_array_equal(hvp[1], 0.0)
        assert np.all(hvp[0, :, :4] != 0.0)


def test_float32_within_the_gradient_tolerance():
    with enable_x64():
        args, _, directions = _problem(*CASES["causal_gqa"])
        expected = _compiled(_oracle, "causal_gqa")(args, directions=directions)
        args, directions, expected = jax.tree.map(np.asarray, (args, directions, expected))
    args32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), args)
    directions32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), directions)
    got = _compiled(_flash, "causal_gqa")(args32, directions=directions32)
    for what in expected:
        for a, b in zip(jax.tree.leaves(got[what]), jax.tree.leaves(expected[what]),
                        strict=True):
            assert a.dtype == jnp.float32
            size = float(np.max(np.abs(b)))
            np.testing.assert_allclose(a, b, atol=2e-5 * max(size, 1.0), rtol=0, err_msg=what)


# Every option against plain_attention (also differentiable, materialising), through the
# public checker's second-order mode.
SEQ_Q, SEQ_K = 13, 17
OPTION_CASES = {
    "window_segments_lengths": {
        "window": (5, 2),
        "q_segment_ids": np.sort(np.random.default_rng(3).integers(0, 2, (2, SEQ_Q))),
        "kv_segment_ids": np.sort(np.random.default_rng(4).integers(0, 2, (2, SEQ_K))),
        "kv_lengths": np.array([15, 11]),
    },
    "causal_alibi_bias_sinks": {"causal": True, "alibi_slopes": np.array([0.5, 0.25, 0.1, 0.05]),
                                "bias": True, "sinks": np.array([0.3, -1.0, 0.0, 2.0])},
    "softcap_attn_mask_mask_mod_dropout": {
        "softcap": 3.0, "mask_mod": lambda b, h, i, j: (i + 2 * j) % 5 != 0,
        "attn_mask": np.random.default_rng(5).random((SEQ_Q, SEQ_K)) < 0.7,
        "dropout_rate": 0.2, "key": jax.random.key(3),
    },
}


def _checker_inputs(options, dtype=jnp.float32):
    from eqx_flash.testing import AttentionInputs

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 4, SEQ_Q, 8)), dtype)
    k = jnp.asarray(rng.standard_normal((2, 2, SEQ_K, 8)), dtype)
    v = jnp.asarray(rng.standard_normal((2, 2, SEQ_K, 8)), dtype)
    def as_input(x):  # floats in the test's dtype; ids as int32 (int64 under x64 is refused)
        if np.issubdtype(x.dtype, np.floating):
            return jnp.asarray(x, dtype)
        return jnp.asarray(x, jnp.int32 if np.issubdtype(x.dtype, np.integer) else None)

    kwargs = {n: as_input(x) if isinstance(x, np.ndarray) else x for n, x in options.items()}
    if kwargs.pop("bias", False) is True:
        kwargs["bias"] = jnp.asarray(rng.standard_normal((4, SEQ_Q, SEQ_K)), dtype)
    return AttentionInputs(q, k, v, {**BLOCKS, **kwargs})


# In float32 the cases with their own floating arguments (bias, slopes, sinks; and a
# score_mod's table) and dropout; the window, segments and lengths in float32:
# `test_second_order_property` (which draws them), all three cases to round-off in float64
# below.
@pytest.mark.parametrize("name", ["causal_alibi_bias_sinks",
                                  "softcap_attn_mask_mask_mod_dropout"])
def test_every_option_against_plain_attention(name):
    """With the first case, a score_mod closing over a table: the HVP reaches the table,
    as plain_attention's."""
    inputs = _checker_inputs(OPTION_CASES[name])
    if name == "causal_alibi_bias_sinks":
        module = RelativePositionBias(4, num_buckets=8, max_distance=16, key=jax.random.key(7))
        inputs = type(inputs)(inputs.q, inputs.k, inputs.v, {**inputs.kwargs,
                                                             "score_mod": module})
    check_attention(flash_attention, inputs, grads=False, second_order=True)


@pytest.mark.parametrize("name", list(OPTION_CASES))
def test_every_option_to_float64_round_off(name):
    """The same in float64, judged by the float64 (round-off) tolerances."""
    with enable_x64():
        check_attention(flash_attention, _checker_inputs(OPTION_CASES[name], jnp.float64),
                        grads=False, second_order=True)


@given(attention_inputs(dtypes=(jnp.float32,), max_seq=32, dims=(4, 8),
                        batch_shapes=((), (2,)), block_sizes=(8, None), bias=None,
                        alibi=None, sinks=None, lengths=None))
@examples(6)
def test_second_order_property(inputs):
    check_attention(flash_attention, inputs, grads=False, second_order=True)


def test_checker_catches_a_wrong_second_derivative():
    """An attention whose first derivatives are right but second derivatives wrong (its
    logits' curvature removed by a custom_jvp with a linear tangent) is caught."""

    @jax.custom_jvp
    def tanh_linearised(s):
        return jnp.tanh(s)

    @tanh_linearised.defjvp
    def _(primals, tangents):
        (s,), (ds,) = primals, tangents
        # right first derivative, but built from a stopped primal: no second derivative
        return jnp.tanh(s), ds * (1 - jax.lax.stop_gradient(jnp.tanh(s)) ** 2)

    def wrong(q, k, v, **kwargs):
        return plain_attention(q, k, v, score_mod=lambda s, b, h, i, j: 3 * tanh_linearised(s / 3),
                               **kwargs)

    def right(q, k, v, **kwargs):
        return plain_attention(q, k, v, softcap=3.0, **kwargs)

    inputs = _checker_inputs({})
    inputs = type(inputs)(inputs.q, inputs.k, inputs.v, {})
    check_attention(wrong, inputs, reference=right, grads=True)  # first order agrees
    with pytest.raises(AssertionError, match="hvp"):
        check_attention(wrong, inputs, reference=right, grads=False, second_order=True)


def test_causal_flash_attention_and_modules():
    """`causal_flash_attention` and `FlashMultiheadAttention` (its parameters, through
    `eqx.filter_grad` / `eqx.filter_jvp`): HVPs as through plain attention."""
    inputs = _checker_inputs({})
    q, k, v = inputs.q, inputs.k, inputs.v
    d = jnp.cos(q)

    def hvp(fn):
        return jax.jvp(jax.grad(lambda q: jnp.sum(jnp.sin(fn(q, k, v)[0]))), (q,), (d,))[1]

    # FlashAttention works on one example: vmapped over the batch.
    layer = FlashAttention(causal=True, block_q=4, block_k=4)
    got = jax.jit(lambda: (hvp(lambda q, k, v: causal_flash_attention(q, k, v, **BLOCKS)),
                           hvp(lambda q, k, v: (jax.vmap(layer)(q, k, v),))))()  # out only
    expected = np.asarray(jax.jit(lambda: hvp(
        lambda q, k, v: plain_attention(q, k, v, causal=True)))())
    for a in got:
        np.testing.assert_allclose(a, expected, atol=2e-5 * float(np.max(np.abs(expected))))

    # Same key: the same weights as eqx.nn.MultiheadAttention, which materialises.
    x = jnp.asarray(np.random.default_rng(1).standard_normal((12, 16)), jnp.float32)
    flash_mha = FlashMultiheadAttention(4, 16, causal=True, block_q=4, block_k=4,
                                        key=jax.random.key(0))
    eqx_mha = eqx.nn.MultiheadAttention(4, 16, key=jax.random.key(0))
    causal = np.tril(np.ones((12, 12), bool))
    projections = ("query_proj", "key_proj", "value_proj", "output_proj")

    @eqx.filter_jit
    def model_hvp(model, **kwargs):
        params, static = eqx.partition(model, eqx.is_inexact_array)
        tangent = jax.tree.map(jnp.cos, params)

        def grad_of(params):
            def loss(model):
                return jnp.sum(jnp.sin(model(x, x, x, **kwargs)))

            return eqx.filter_grad(loss)(eqx.combine(params, static))

        hvp = eqx.filter_jvp(grad_of, (params,), (tangent,))[1]
        return [getattr(hvp, name).weight for name in projections]

    got = model_hvp(flash_mha)
    with jax.default_matmul_precision("highest"):
        expected = model_hvp(eqx_mha, mask=causal)
    for name, a, b in zip(projections, got, expected, strict=True):
        b = np.asarray(b)
        np.testing.assert_allclose(a, b, atol=3e-5 * max(float(np.max(np.abs(b))), 1.0),
                                   err_msg=name)


def test_first_order_programs_are_unchanged():
    """jax.grad and jax.jvp bind only the first-order linear primitive; so does the
    sCM/MeanFlow pattern (the tangent under stop_gradient): the second-order primitive
    appears only where a second derivative is taken."""
    inputs = _checker_inputs({"causal": True})
    q, k, v = inputs.q, inputs.k, inputs.v

    def f(q):
        return flash_attention(q, k, v, causal=True, **BLOCKS)[0]

    def scm(q):
        out, d_out = jax.jvp(f, (q,), (jnp.ones_like(q),))
        return jnp.sum(out * jax.lax.stop_gradient(d_out))

    def hvp(q):
        return jax.jvp(jax.grad(lambda q: jnp.sum(f(q))), (q,), (q,))[1]

    def program(fn):
        return str(jax.make_jaxpr(fn)(q))

    for fn in (jax.grad(lambda q: jnp.sum(f(q))), lambda q: jax.jvp(f, (q,), (q,)),
               jax.grad(scm)):
        text = program(fn)
        assert "eqx_flash_attention_linear" in text
        assert "eqx_flash_attention_second_order" not in text
    assert "eqx_flash_attention_second_order" in program(hvp)


def test_ring_second_order_raises_clearly():
    """The ring has first-order derivatives only: a gradient of its gradient and an HVP
    raise an error naming the ring (not JAX's about reversing a while_loop). Its
    first-order gradient is unchanged."""
    from jax.sharding import Mesh

    from eqx_flash import sharded_flash_attention

    mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
    inputs = _checker_inputs({})
    q, k, v = (jnp.asarray(np.asarray(x)[0, :2, :8]) for x in (inputs.q, inputs.k, inputs.v))

    def f(q):
        out = sharded_flash_attention(q, k, v, mesh=mesh, seq_axis="seq", causal=True)[0]
        return jnp.sum(out**2)

    got, expected = jax.jit(lambda q: (jax.grad(f)(q), jax.grad(
        lambda q: jnp.sum(causal_flash_attention(q, k, v)[0] ** 2))(q)))(q)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    with pytest.raises(NotImplementedError, match="second-order derivatives.*ring"):
        jax.grad(lambda q: jnp.sum(jax.grad(f)(q) ** 2))(q)
    with pytest.raises(NotImplementedError, match="second-order derivatives.*ring"):
        jax.jvp(jax.grad(f), (q,), (q,))


def test_decoding_shapes_take_the_split_k_path_at_second_order(monkeypatch):
    """One query against a long cache with valid lengths (the split-K decoding kernel,
    checked to run): an HVP and a gradient of a gradient as plain_attention's."""
    from eqx_flash._kernels import dispatch

    calls = []
    xla = dispatch.FAMILIES["xla"]
    split_k_forward = xla.split_k_forward
    assert split_k_forward is not None
    monkeypatch.setitem(dispatch.FAMILIES, "xla", xla._replace(
        split_k_forward=lambda *args: (calls.append(1), split_k_forward(*args))[1]))
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 4, 1, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 2, 2048, 16)), jnp.float32)
    lengths = jnp.array([300, 2048])

    def loss(attention, q, k):
        return jnp.sum(jnp.sin(attention(q, k, k, kv_lengths=lengths)[0]))

    @functools.partial(jax.jit, static_argnums=0)  # each side compiled whole
    def both(attention, q, k):
        grad = jax.grad(functools.partial(loss, attention), argnums=(0, 1))
        hvp = jax.jvp(grad, (q, k), (jnp.cos(q), jnp.sin(k)))[1]

        def penalty(k):
            return jnp.sum(jax.grad(lambda q: loss(attention, q, k))(q) ** 2)

        return hvp, jax.grad(penalty)(k)  # an HVP and a gradient of a gradient

    for a, b in zip(jax.tree.leaves(both(flash_attention, q, k)),
                    jax.tree.leaves(both(plain_attention, q, k)), strict=True):
        b = np.asarray(b)
        np.testing.assert_allclose(a, b, atol=2e-5 * max(float(np.max(np.abs(b))), 1.0))
    assert calls, "the split-K kernel did not run"
