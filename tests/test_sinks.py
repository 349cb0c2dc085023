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


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("options", [{}, {"softcap": 3.0}, BLOCKS])
def test_values_and_lse_match_the_independent_reference(causal, options):
    q, k, v, sinks = _inputs()
    mask = np.random.default_rng(1).random((B, SK)) > 0.3
    mask[1] = False  # batch element 1 attends nothing: out 0, lse = sink
    expected_out, expected_lse, _ = oracle_attention(q, k, v, mask, causal=causal, sinks=sinks,
                                                     softcap=options.get("softcap"))
    for fn in (eqx_flash.flash_attention, eqx_flash.plain_attention):
        kwargs = options if fn is eqx_flash.flash_attention else {
            n: x for n, x in options.items() if n == "softcap"}
        out, lse = fn(q, k, v, jnp.asarray(mask), causal=causal, sinks=sinks, **kwargs)
        assert_close(out, expected_out)
        assert_lse_close(lse, expected_lse)
    np.testing.assert_array_equal(np.asarray(out[1]), 0.0)
    np.testing.assert_allclose(np.asarray(lse[1]), np.broadcast_to(sinks[:, None], (H, SQ)),
                               rtol=1e-6)


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

        args = (q, k, v, sinks)
        expected = jax.grad(loss(dense), argnums=(0, 1, 2, 3))(*args)
        got = jax.grad(loss(eqx_flash.flash_attention), argnums=(0, 1, 2, 3))(*args)
        for g, e in zip(got, expected, strict=True):
            assert g.shape == e.shape and g.dtype == e.dtype
            np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-12)
        tangents = tuple(jnp.asarray(np.random.default_rng(5 + i).standard_normal(x.shape))
                         for i, x in enumerate(args))
        _, t_got = jax.jvp(lambda *a: eqx_flash.flash_attention(*a[:3], causal=True,
                                                                 sinks=a[3]), args, tangents)
        _, t_expected = jax.jvp(dense, args, tangents)
        for g, e in zip(t_got, t_expected, strict=True):
            np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-12)


def test_sink_is_a_merged_part():
    """The sink is the part `(out = 0, lse = sink)`: the result without sinks, rescaled."""
    q, k, v, sinks = _inputs(4)
    out, lse = eqx_flash.flash_attention(q, k, v, **BLOCKS)
    with_out, with_lse = eqx_flash.flash_attention(q, k, v, sinks=sinks, **BLOCKS)
    expected_lse = jnp.logaddexp(lse, sinks[None, :, None])
    assert_lse_close(with_lse, expected_lse)
    assert_close(with_out, out * jnp.exp(lse - expected_lse)[..., None])


def test_sink_gradient_keeps_its_shape_and_dtype_and_broadcasts():
    q, k, v, _ = _inputs(5)
    for sinks in (jnp.zeros((H,), jnp.bfloat16), jnp.zeros((B, H)), jnp.zeros((1, H))):
        grad = jax.grad(lambda s: eqx_flash.flash_attention(q, k, v, sinks=s)[0].sum())(sinks)
        assert grad.shape == sinks.shape and grad.dtype == sinks.dtype
        assert bool(jnp.all(jnp.isfinite(grad)))


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
    for fn in (eqx_flash.flash_attention, eqx_flash.plain_attention):
        out, lse = fn(q, k, v, causal=True, sinks=sinks)
        assert_close(out, expected_out)
        assert_lse_close(lse, expected_lse)
        grad = jax.grad(lambda s, fn=fn: fn(q, k, v, causal=True, sinks=s)[1].sum())(sinks)
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
    x = jax.random.normal(jax.random.key(1), (SQ, 16))

    @eqx.filter_grad
    def grad(m):
        return jnp.sum(m(x, x, x) ** 2)

    assert bool(jnp.any(grad(mha).sinks != 0))
    # A trained sink changes the output, and decode with a cache uses it too.
    mha = eqx.tree_at(lambda m: m.sinks, mha, jnp.linspace(-1.0, 2.0, H))
    full = mha(x, x, x)
    cache = mha.init_cache(SQ)
    prefix, cache = mha.decode(x[:10], cache)
    step, cache = mha.decode(x[10:], cache)
    assert_close(jnp.concatenate([prefix, step]), full, scale=5.0)
    assert float(jnp.abs(full - mha.from_eqx(eqx.nn.MultiheadAttention(
        H, 16, key=jax.random.key(0)), causal=True)(x, x, x)).max()) > 0  # sinks matter
    # FlashAttention takes them per call.
    heads = jax.random.normal(jax.random.key(2), (H, SQ, D))
    out = eqx_flash.FlashAttention()(heads, heads, heads, sinks=mha.sinks)
    assert_close(out, eqx_flash.flash_attention(heads, heads, heads, sinks=mha.sinks)[0])


def test_from_eqx_with_sinks_starts_at_zero():
    mha = eqx.nn.MultiheadAttention(2, 8, key=jax.random.key(1))
    flash = eqx_flash.FlashMultiheadAttention.from_eqx(mha, use_sinks=True)
    np.testing.assert_array_equal(np.asarray(flash.sinks), 0.0)


@examples(15)
@given(attention_inputs(sinks=True, alibi=None, bias=None, lengths=None, max_seq=64))
def test_property_flash_against_plain_with_sinks(inputs):
    check_attention(eqx_flash.flash_attention, inputs, jvp=True)


def test_ring_and_sharded_count_the_sink_once():
    from jax.sharding import Mesh, PartitionSpec

    q, k, v, sinks = _inputs(7)
    q, k, v = q[..., :16, :], k[..., :16, :], v[..., :16, :]
    mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
    seq = PartitionSpec(None, None, "seq")
    expected = eqx_flash.flash_attention(q, k, v, causal=True, sinks=sinks)

    def ring(q, k, v, sinks):
        return eqx_flash.ring_flash_attention(q, k, v, axis_name="seq", causal=True,
                                              sinks=sinks)

    mapped = jax.shard_map(ring, mesh=mesh, in_specs=(seq, seq, seq, PartitionSpec()),
                           out_specs=(seq, seq))
    sharded = eqx_flash.sharded_flash_attention(q, k, v, mesh=mesh, seq_axis="seq",
                                                causal=True, sinks=sinks)
    for out, lse in (mapped(q, k, v, sinks), sharded):
        assert_close(out, expected[0])
        assert_lse_close(lse, expected[1])

    def loss(fn):
        return lambda s: jnp.sum(fn(q, k, v, s)[0]) + jnp.sum(fn(q, k, v, s)[1])

    flash_grad = jax.grad(loss(lambda q, k, v, s: eqx_flash.flash_attention(
        q, k, v, causal=True, sinks=s)))(sinks)
    assert_close(jax.grad(loss(mapped))(sinks), flash_grad, kind="grad")


def test_broadcast_sinks_on_the_ring_strategies_and_modules():
    """A scalar sink on the ring (one-device `shard_map`), every strategy of
    `sharded_flash_attention` and the `FlashAttention` module: as `flash_attention`'s
    (the 4-device check `ring_user_shard_map_vma` takes `(batch, 1)` on the ring)."""
    from jax.sharding import Mesh, PartitionSpec

    q, k, v, _ = _inputs(9)
    q, k, v = q[..., :16, :], k[..., :16, :], v[..., :16, :]
    sinks = jnp.float32(0.7)
    mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
    seq = PartitionSpec(None, None, "seq")
    expected = eqx_flash.flash_attention(q, k, v, causal=True, sinks=sinks)
    ring = jax.shard_map(
        lambda q, k, v, s: eqx_flash.ring_flash_attention(q, k, v, axis_name="seq",
                                                          causal=True, sinks=s),
        mesh=mesh, in_specs=(seq, seq, seq, PartitionSpec()), out_specs=(seq, seq))
    got = [ring(q, k, v, sinks)]
    got += [eqx_flash.sharded_flash_attention(q, k, v, mesh=mesh, seq_axis="seq", causal=True,
                                              sinks=sinks, strategy=strategy)
            for strategy in ("ring", "ulysses", "all_gather")]
    module = eqx_flash.FlashAttention(causal=True)
    got.append((jax.vmap(lambda q, k, v: module(q, k, v, sinks=sinks))(q, k, v), expected[1]))
    for out, lse in got:
        assert_close(out, expected[0])
        assert_lse_close(lse, expected[1])
