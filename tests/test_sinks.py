"""Attention sinks: a per-head logit in every row's softmax denominator (`sinks=`),
against the independent float64 oracle (`helpers.oracle_attention`), on every entry
point."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, assert_lse_close, enable_x64, examples, oracle_attention, qkv
from hypothesis import given

import eqx_flash
from eqx_flash.testing import attention_inputs, check_attention

B, H, KH, SQ, SK, D = 2, 4, 2, 19, 27, 8
BLOCKS = dict(block_q=8, block_k=8)


def _inputs(seed=0):
    q, k, v = qkv(seed, (B, H, SQ, D), (B, KH, SK, D))
    sinks = jnp.asarray(np.random.default_rng(seed).standard_normal(H), jnp.float32)
    return q, k, v, sinks


def _sliced(seed):
    """`_inputs(seed)` with 16 queries and keys (cut on the host: no slicing programs)."""
    q, k, v, sinks = _inputs(seed)
    return (*(jnp.asarray(np.asarray(x)[..., :16, :]) for x in (q, k, v)), sinks)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("options", [{}, {"softcap": 3.0}, BLOCKS])
def test_values_and_lse_match_the_independent_reference(causal, options):
    q, k, v, sinks = _inputs()
    mask = np.random.default_rng(1).random((B, SK)) > 0.3
    mask[1] = False  # batch element 1 attends nothing: out 0, lse = sink
    expected_out, expected_lse, _ = oracle_attention(q, k, v, mask, causal=causal, sinks=sinks,
                                                     softcap=options.get("softcap"))
    plain_options = {n: x for n, x in options.items() if n == "softcap"}

    @jax.jit  # both functions in one program (the mask stays concrete)
    def results(q, k, v, sinks):
        return [fn(q, k, v, jnp.asarray(mask), causal=causal, sinks=sinks, **kwargs)
                for fn, kwargs in ((eqx_flash.flash_attention, options),
                                   (eqx_flash.plain_attention, plain_options))]

    for out, lse in results(q, k, v, sinks):
        assert_close(out, expected_out)
        assert_lse_close(lse, expected_lse)
    np.testing.assert_array_equal(np.asarray(out)[1], 0.0)
    np.testing.assert_allclose(np.asarray(lse)[1],
                               np.broadcast_to(np.asarray(sinks)[:, None], (H, SQ)), rtol=1e-6)


def test_gradients_and_tangents_in_float64():
    with enable_x64():
        q, k, v, sinks = (x.astype(jnp.float64) for x in _inputs(2))
        w = jnp.asarray(np.random.default_rng(3).standard_normal((B, H, SQ, D)))
        u = jnp.asarray(np.random.default_rng(4).standard_normal((B, H, SQ)))

        def loss(fn):
            def f(q, k, v, sinks):
                out, lse = fn(q, k, v, causal=True, sinks=sinks)
                return jnp.sum(out * w) + jnp.sum(lse * u)
            return f

        def dense(q, k, v, sinks, causal=True):
            return oracle_attention(q, k, v, causal=causal, sinks=sinks, xp=jnp)[:2]

        def flash(q, k, v, sinks, causal=True):
            return eqx_flash.flash_attention(q, k, v, causal=causal, sinks=sinks)

        args = (q, k, v, sinks)
        tangents = tuple(jnp.asarray(np.random.default_rng(5 + i).standard_normal(x.shape))
                         for i, x in enumerate(args))

        @jax.jit
        def derivatives(args, tangents):  # both sides, gradients and tangents, compiled once
            return [(jax.grad(loss(fn), argnums=(0, 1, 2, 3))(*args),
                     jax.jvp(fn, args, tangents)[1]) for fn in (flash, dense)]

        (got, t_got), (expected, t_expected) = jax.tree.map(
            np.asarray, derivatives(args, tangents))
        for g, e in zip(got, expected, strict=True):
            assert g.shape == e.shape and g.dtype == e.dtype
            np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-12)
        for g, e in zip(t_got, t_expected, strict=True):
            np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-12)


def test_sink_is_a_merged_part():
    """The sink is the part `(out = 0, lse = sink)`: the result without sinks, rescaled."""
    q, k, v, sinks = _inputs(4)
    out, lse = (np.asarray(x, np.float64) for x in eqx_flash.flash_attention(q, k, v, **BLOCKS))
    with_out, with_lse = eqx_flash.flash_attention(q, k, v, sinks=sinks, **BLOCKS)
    expected_lse = np.logaddexp(lse, np.asarray(sinks, np.float64)[None, :, None])
    assert_lse_close(with_lse, expected_lse)
    assert_close(with_out, out * np.exp(lse - expected_lse)[..., None])


def test_sink_gradient_keeps_its_shape_and_dtype_and_broadcasts():
    q, k, v, _ = _inputs(5)
    shapes = ((H,), (B, H), (1, H))
    sinks = (jnp.zeros(shapes[0], jnp.bfloat16), jnp.zeros(shapes[1]), jnp.zeros(shapes[2]))
    grads = jax.jit(lambda sinks: [jax.grad(  # the three in one program
        lambda s: eqx_flash.flash_attention(q, k, v, sinks=s)[0].sum())(s) for s in sinks])(
        sinks)
    for s, grad in zip(sinks, grads, strict=True):
        assert grad.shape == s.shape and grad.dtype == s.dtype
        assert np.all(np.isfinite(np.asarray(grad, np.float32)))


@pytest.mark.parametrize("sinks, match", [
    (jnp.zeros((H + 1,)), r"broadcastable to \(\*batch, heads\) = \(2, 4\); got "
                          r"sinks.shape=\(5,\)"),
    (jnp.zeros((3, H)), r"sinks.shape=\(3, 4\)"), (jnp.zeros((B, 3)), r"sinks.shape=\(2, 3\)"),
    (jnp.zeros((1, B, H)), r"sinks.shape=\(1, 2, 4\)"),
    (jnp.zeros((H,), jnp.int32), "sinks"),
])
def test_bad_sinks_name_the_argument(sinks, match):
    q, k, v, _ = _inputs()
    with pytest.raises((TypeError, ValueError), match=match):
        eqx_flash.flash_attention(q, k, v, sinks=sinks)


@pytest.mark.parametrize("shape", [(), (1,), (B, 1), (1, H)])
def test_sinks_broadcastable_to_batch_heads_are_taken(shape):
    """Every shape broadcastable to `(*batch, heads)` (as documented): `()`, `(1,)` and
    `(batch, 1)` were refused (#41) with a message contradicting itself; values against
    the float64 reference, the cotangent in the sinks' own shape."""
    q, k, v, _ = _inputs(8)
    sinks = jnp.asarray(np.random.default_rng(8).standard_normal(shape), jnp.float32)
    expected_out, expected_lse, _ = oracle_attention(q, k, v, causal=True, sinks=sinks)

    @jax.jit  # both functions' values and sink gradients in one program
    def results(sinks):
        return [(fn(q, k, v, causal=True, sinks=sinks), jax.grad(
                    lambda s, fn=fn: fn(q, k, v, causal=True, sinks=s)[1].sum())(sinks))
                for fn in (eqx_flash.flash_attention, eqx_flash.plain_attention)]

    for (out, lse), grad in results(sinks):
        assert_close(out, expected_out)
        assert_lse_close(lse, expected_lse)
        assert grad.shape == shape
        # d sum(lse) / d sink = sum over the rows it joins of exp(sink - lse)
        weight = np.exp(np.broadcast_to(np.asarray(sinks, np.float64)[..., None],
                                        (B, H, SQ)) - expected_lse)
        np.testing.assert_allclose(np.asarray(grad).sum(), weight.sum(), rtol=1e-4)


def test_alibi_slopes_shape_error_does_not_contradict_itself():
    """ALiBi slopes need the heads axis whole, and the message says so (a `(batch, 1)`
    slope array is broadcastable to `(batch, heads)`, so "broadcastable" must not be the
    stated rule)."""
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(heads,\) or "
                                         r"\(\*batch, heads\) with heads = 4.*got "
                                         r"alibi_slopes.shape=\(2, 1\)"):
        eqx_flash.flash_attention(q, k, v, alibi_slopes=jnp.ones((B, 1)))


def test_split_k_decode_path_uses_the_sink():
    q, k, v = qkv(6, (1, H, 1, D), (1, KH, 512, D))
    sinks = jnp.linspace(-1.0, 3.0, H)
    out, lse = eqx_flash.flash_attention(q, k, v, sinks=sinks, block_k=32)
    expected_out, expected_lse, _ = oracle_attention(q, k, v, sinks=sinks)
    assert_close(out, expected_out)
    assert_lse_close(lse, expected_lse)


def test_modules_train_their_sinks():
    mha = eqx_flash.FlashMultiheadAttention(H, 16, num_kv_heads=KH, causal=True,
                                            use_sinks=True, key=jax.random.key(0))
    assert mha.sinks is not None and mha.sinks.shape == (H,)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((SQ, 16)), jnp.float32)
    heads = jnp.asarray(np.random.default_rng(2).standard_normal((H, SQ, D)), jnp.float32)

    @eqx.filter_jit  # every call below in one program
    def outputs(mha):
        grad = eqx.filter_grad(lambda m: jnp.sum(m(x, x, x) ** 2))(mha)
        # A trained sink changes the output, and decode with a cache uses it too.
        mha = eqx.tree_at(lambda m: m.sinks, mha, jnp.linspace(-1.0, 2.0, H))
        full = mha(x, x, x)
        cache = mha.init_cache(SQ)
        prefix, cache = mha.decode(x[:10], cache)
        step, cache = mha.decode(x[10:], cache)
        no_sinks = eqx.tree_at(lambda m: m.sinks, mha, None)(x, x, x)  # the same weights
        # FlashAttention takes them per call.
        module = eqx_flash.FlashAttention()(heads, heads, heads, sinks=mha.sinks)
        direct = eqx_flash.flash_attention(heads, heads, heads, sinks=mha.sinks)[0]
        return grad.sinks, full, jnp.concatenate([prefix, step]), no_sinks, module, direct

    d_sinks, full, decoded, no_sinks, module, direct = jax.tree.map(np.asarray, outputs(mha))
    assert np.any(d_sinks != 0)
    assert_close(decoded, full, scale=5.0)
    assert float(np.abs(full - no_sinks).max()) > 0  # sinks matter
    assert_close(module, direct)


def test_from_eqx_with_sinks_starts_at_zero():
    mha = eqx.nn.MultiheadAttention(2, 8, key=jax.random.key(1))
    flash = eqx_flash.FlashMultiheadAttention.from_eqx(mha, use_sinks=True)
    np.testing.assert_array_equal(np.asarray(flash.sinks), 0.0)


@examples(10)
@given(attention_inputs(sinks=True, alibi=None, bias=None, lengths=None, max_seq=64))
def test_property_flash_against_plain_with_sinks(inputs):
    check_attention(eqx_flash.flash_attention, inputs, jvp=True)


def test_ring_and_sharded_count_the_sink_once():
    from jax.sharding import Mesh, PartitionSpec

    q, k, v, sinks = _sliced(7)
    mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
    seq = PartitionSpec(None, None, "seq")

    def ring(q, k, v, sinks):
        return eqx_flash.ring_flash_attention(q, k, v, axis_name="seq", causal=True,
                                              sinks=sinks)

    mapped = jax.shard_map(ring, mesh=mesh, in_specs=(seq, seq, seq, PartitionSpec()),
                           out_specs=(seq, seq))

    def flash(q, k, v, s):
        return eqx_flash.flash_attention(q, k, v, causal=True, sinks=s)

    def loss(fn):
        return lambda s: jnp.sum(fn(q, k, v, s)[0]) + jnp.sum(fn(q, k, v, s)[1])

    @jax.jit  # the ring, sharded and flash_attention, values and sink gradients, at once
    def results(sinks):
        sharded = eqx_flash.sharded_flash_attention(q, k, v, mesh=mesh, seq_axis="seq",
                                                    causal=True, sinks=sinks)
        return (mapped(q, k, v, sinks), sharded, flash(q, k, v, sinks),
                jax.grad(loss(mapped))(sinks), jax.grad(loss(flash))(sinks))

    on_ring, sharded, expected, ring_grad, flash_grad = results(sinks)
    for out, lse in (on_ring, sharded):
        assert_close(out, expected[0])
        assert_lse_close(lse, expected[1])
    assert_close(ring_grad, flash_grad, kind="grad")


def test_broadcast_sinks_on_the_ring_strategies_and_modules():
    """A scalar sink on the ring (one-device `shard_map`), every strategy of
    `sharded_flash_attention` and the `FlashAttention` module: as `flash_attention`'s
    (the 4-device check `ring_user_shard_map_vma` takes `(batch, 1)` on the ring)."""
    from jax.sharding import Mesh, PartitionSpec

    q, k, v, _ = _sliced(9)
    sinks = jnp.float32(0.7)
    mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
    seq = PartitionSpec(None, None, "seq")
    ring = jax.shard_map(
        lambda q, k, v, s: eqx_flash.ring_flash_attention(q, k, v, axis_name="seq",
                                                          causal=True, sinks=s),
        mesh=mesh, in_specs=(seq, seq, seq, PartitionSpec()), out_specs=(seq, seq))
    module = eqx_flash.FlashAttention(causal=True)

    @jax.jit  # flash_attention, the ring, the strategies and the module in one program
    def results(q, k, v, sinks):
        expected = eqx_flash.flash_attention(q, k, v, causal=True, sinks=sinks)
        module_out = jax.vmap(lambda q, k, v: module(q, k, v, sinks=sinks))(q, k, v)
        got = [ring(q, k, v, sinks), (module_out, expected[1])]
        got += [eqx_flash.sharded_flash_attention(q, k, v, mesh=mesh, seq_axis="seq",
                                                  causal=True, sinks=sinks, strategy=strategy)
                for strategy in ("ring", "ulysses", "all_gather")]
        return expected, got

    expected, got = results(q, k, v, sinks)
    for out, lse in got:
        assert_close(out, expected[0])
        assert_lse_close(lse, expected[1])
