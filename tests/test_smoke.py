"""A fast pass over every public name, each checked against an independent answer.

This file (marker `smoke`, `python -m pytest -m smoke`) is what CI runs on the oldest
supported versions (`.ci/oldest.txt`) and on the newest Python; the rest of the suite runs
on the newest versions (the default `python -m pytest` leaves this file out: see
`addopts` in pyproject.toml). `test_every_public_name_is_covered` keeps it complete.
"""

import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, assert_lse_close, outputs_and_grads, qkv
from hypothesis import given, settings
from jax.sharding import Mesh, PartitionSpec

import eqx_flash
import eqx_flash.testing

pytestmark = pytest.mark.smoke

COVERED: set[str] = set()


def covers(*names: str):
    COVERED.update(names)
    return lambda fn: fn


@covers("flash_attention", "plain_attention")
def test_flash_every_mask_against_plain(getkey):
    q, k, v = qkv(getkey(), (2, 4, 40, 8), (2, 2, 56, 8))
    ids_q = jnp.repeat(jnp.arange(2), 20)[None].repeat(2, axis=0)
    ids_k = jnp.sort(jax.random.randint(getkey(), (2, 56), 0, 2), axis=-1)
    kwargs = dict(
        mask=jnp.arange(56) < 50, causal=True, window=(24, 0), softcap=5.0,
        q_segment_ids=ids_q, kv_segment_ids=ids_k,
    )
    wkey = getkey()
    (out, lse), grads = outputs_and_grads(eqx_flash.flash_attention, q, k, v, wkey,
                                          block_q=16, block_k=16, **kwargs)
    (ref, ref_lse), ref_grads = outputs_and_grads(eqx_flash.plain_attention, q, k, v, wkey,
                                                  **kwargs)
    assert_close(out, ref)
    assert_lse_close(lse, ref_lse)
    for g, r in zip(grads, ref_grads, strict=True):
        assert_close(g, r, scale=4.0)


@covers("flash_attention", "plain_attention")
def test_dropout_and_dense_mask_match_plain(getkey):
    q, k, v = qkv(getkey(), (2, 24, 8), (2, 40, 8))
    attn_mask = jax.random.bernoulli(getkey(), 0.7, (24, 40))
    key = jax.random.key(3)
    out, _ = eqx_flash.flash_attention(q, k, v, attn_mask=attn_mask, dropout_rate=0.2, key=key,
                                       block_q=8, block_k=16)
    ref, _ = eqx_flash.plain_attention(q, k, v, attn_mask=attn_mask, dropout_rate=0.2, key=key)
    assert_close(out, ref)


@covers("kernel_family")
def test_kernel_family_and_the_pallas_kernels_interpreted(getkey):
    """Which family a call gets, and the Pallas TPU kernels run in Pallas' interpreter
    off a TPU (on every supported jax), against plain attention."""
    q, k, v = qkv(getkey(), (1, 2, 128, 32), (1, 2, 128, 32))
    family, reason = eqx_flash.kernel_family(q, k, v, causal=True)
    assert family == ("pallas_tpu" if jax.default_backend() == "tpu" else "xla") and reason

    table = jnp.linspace(0.0, -1.0, 8)

    def relative(score, b, h, i, j):  # a lookup by the offset: a relative term
        return score + table[jnp.clip(j - i, 0, 7)]

    def summed(score, b, h, i, j):  # a lookup by i + j: not in the Pallas kernels
        return score + table[jnp.clip(j + i, 0, 7)]

    family, _ = eqx_flash.kernel_family(q, k, v, score_mod=relative, kernels="pallas_tpu")
    assert family == "pallas_tpu"
    family, reason = eqx_flash.kernel_family(q, k, v, score_mod=summed,
                                             kernels="pallas_tpu")
    assert family is None and "score_mod" in reason
    out, lse = eqx_flash.flash_attention(q, k, v, causal=True, kernels="pallas_tpu")
    ref, ref_lse = eqx_flash.plain_attention(q, k, v, causal=True)
    assert_close(out, ref)
    assert_lse_close(lse, ref_lse)


@covers("causal_flash_attention")
def test_causal_flash_attention_is_flash_causal(getkey):
    q, k, v = qkv(getkey(), (33, 8), (33, 8))
    out, lse = eqx_flash.causal_flash_attention(q, k, v)
    ref, ref_lse = eqx_flash.plain_attention(q, k, v, causal=True)
    assert_close(out, ref)
    assert_lse_close(lse, ref_lse)


@covers("cosine_sim_flash_attention")
def test_cosine_sim_normalises_each_vector(getkey):
    q, k, v = qkv(getkey(), (2, 16, 8), (2, 24, 8))
    out, _ = eqx_flash.cosine_sim_flash_attention(q, k, v)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    ref, _ = eqx_flash.plain_attention(unit(q), unit(k), v, scale=10.0)
    assert_close(out, ref)


@covers("value_and_grad_difference")
def test_value_and_grad_difference_small():
    # Jitted, so that the comparison compiles once instead of dispatching op by op.
    plain, flash = jax.jit(eqx_flash.plain_attention), jax.jit(eqx_flash.flash_attention)
    diff, grads = eqx_flash.value_and_grad_difference(
        plain, flash, batch=1, q_seq_len=48, k_seq_len=40, dim=8, heads=2, kv_heads=1,
    )
    assert float(diff) < 1e-5 and max(map(float, grads)) < 1e-4
    # ...and it does see a difference when there is one.
    off, _ = eqx_flash.value_and_grad_difference(
        plain, jax.jit(lambda *a: eqx_flash.plain_attention(*a, scale=0.3)),
        batch=1, q_seq_len=48, k_seq_len=40, dim=8, heads=2, kv_heads=1,
    )
    assert float(off) > 1e-3


@covers("FlashMultiheadAttention")
def test_flash_multihead_matches_equinox(getkey):
    ours = eqx_flash.FlashMultiheadAttention(2, 16, key=jax.random.key(0))
    mha = eqx.nn.MultiheadAttention(2, 16, key=jax.random.key(0))
    x = jax.random.normal(getkey(), (12, 16))
    mask = jnp.tril(jnp.ones((12, 12), bool))
    assert_close(ours(x, x, x, mask), mha(x, x, x, mask))
    causal = eqx_flash.FlashMultiheadAttention(2, 16, causal=True, key=jax.random.key(0))
    assert_close(causal(x, x, x), mha(x, x, x, mask))
    grads = eqx.filter_grad(lambda m: jnp.sum(m(x, x, x) ** 2))(causal)
    assert jnp.all(jnp.isfinite(grads.query_proj.weight))


@covers("FlashAttention")
def test_flash_attention_module(getkey):
    q, k, v = qkv(getkey(), (4, 20, 8), (2, 20, 8))
    module = eqx_flash.FlashAttention(causal=True, softcap=5.0, dropout_p=0.1)
    ref, _ = eqx_flash.plain_attention(q, k, v, causal=True, softcap=5.0)
    assert_close(module(q, k, v, inference=True), ref)
    dropped = module(q, k, v, key=jax.random.key(1))
    assert dropped.shape == ref.shape and not jnp.allclose(dropped, ref)


@covers("ring_order", "to_ring_layout", "from_ring_layout")
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
def test_ring_layouts_round_trip(layout):
    order = eqx_flash.ring_order(16, 2, layout)
    assert sorted(order.tolist()) == list(range(16))
    x = jnp.arange(2 * 16 * 3.0).reshape(2, 16, 3)
    arranged = eqx_flash.to_ring_layout(x, num_devices=2, layout=layout)
    np.testing.assert_array_equal(arranged, x[:, order])
    back = eqx_flash.from_ring_layout(arranged, num_devices=2, layout=layout)
    np.testing.assert_array_equal(back, x)


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:1]), ("seq",))


@covers("sharded_flash_attention")
def test_sharded_flash_attention_one_device(getkey):
    q, k, v = qkv(getkey(), (2, 4, 32, 8), (2, 2, 32, 8))
    out, lse = jax.jit(lambda q, k, v: eqx_flash.sharded_flash_attention(
        q, k, v, mesh=_mesh(), seq_axis="seq", causal=True, block_q=8, block_k=8))(q, k, v)
    ref, ref_lse = eqx_flash.plain_attention(q, k, v, causal=True)
    assert_close(out, ref)
    assert_lse_close(lse, ref_lse)


@covers("ring_flash_attention")
@pytest.mark.parametrize("check_vma", [False, True])
def test_ring_in_shard_map_one_device(getkey, check_vma):
    # check_vma=True exercises the varying-axes casts (`_core.compat.pcast_varying`).
    q, k, v = qkv(getkey(), (4, 32, 8), (2, 32, 8))
    spec = PartitionSpec(None, "seq", None)
    ring = jax.shard_map(
        lambda q, k, v: eqx_flash.ring_flash_attention(
            q, k, v, axis_name="seq", layout="zigzag", causal=True, block_q=8, block_k=8),
        mesh=_mesh(), in_specs=(spec, spec, spec),
        out_specs=(spec, PartitionSpec(None, "seq")), check_vma=check_vma,
    )
    wkey = getkey()
    (out, lse), grads = outputs_and_grads(ring, q, k, v, wkey)
    ref_fn = lambda q, k, v: eqx_flash.plain_attention(q, k, v, causal=True)  # noqa: E731
    (ref, ref_lse), ref_grads = outputs_and_grads(ref_fn, q, k, v, wkey)
    assert_close(out, ref)
    assert_lse_close(lse, ref_lse)
    for g, r in zip(grads, ref_grads, strict=True):
        assert_close(g, r, scale=4.0)


@covers("flash_attention")
def test_lengths_bias_and_alibi_match_plain(getkey):
    q, k, v = qkv(getkey(), (2, 4, 24, 8), (2, 2, 40, 8))
    kwargs = dict(
        causal=True, q_lengths=jnp.array([24, 9]), kv_lengths=jnp.array([40, 17]),
        bias=0.3 * jax.random.normal(getkey(), (4, 24, 40)),
        alibi_slopes=2.0 ** -jnp.arange(1.0, 5.0), sinks=jnp.linspace(-1.0, 1.0, 4),
    )
    wkey = getkey()
    (out, lse), grads = outputs_and_grads(eqx_flash.flash_attention, q, k, v, wkey,
                                          block_q=8, block_k=16, **kwargs)
    (ref, ref_lse), ref_grads = outputs_and_grads(eqx_flash.plain_attention, q, k, v, wkey,
                                                  **kwargs)
    assert_close(out, ref)
    assert_lse_close(lse, ref_lse)
    for g, r in zip(grads, ref_grads, strict=True):
        assert_close(g, r, scale=4.0)


@covers("dot_product_attention")
def test_dot_product_attention_is_jax_nns(getkey):
    q = jax.random.normal(getkey(), (2, 12, 4, 8))  # jax.nn's (batch, seq, heads, dim)
    k, v = (jax.random.normal(getkey(), (2, 20, 2, 8)) for _ in range(2))
    out = eqx_flash.dot_product_attention(q, k, v, is_causal=True)
    assert_close(out, jax.nn.dot_product_attention(q, k, v, is_causal=True))


@covers("flash_attn_varlen_func", "flash_attn_func")
def test_flash_attn_varlen_func_attends_within_each_sequence(getkey):
    q = jax.random.normal(getkey(), (9, 4, 8))  # packed: sequences of 3 and 6 tokens
    k, v = (jax.random.normal(getkey(), (9, 2, 8)) for _ in range(2))
    cu = jnp.array([0, 3, 9], jnp.int32)
    out = eqx_flash.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=True)
    for a, b in ((0, 3), (3, 9)):
        alone = eqx_flash.flash_attn_func(q[None, a:b], k[None, a:b], v[None, a:b],
                                          causal=True)
        assert_close(out[a:b], alone[0])


@covers("flax_attention")
def test_flax_attention_is_flaxs_attention_fn(getkey):
    q = jax.random.normal(getkey(), (2, 3, 12, 4, 8))  # Flax: [batch..., length, heads, depth]
    k, v = (jax.random.normal(getkey(), (2, 3, 12, 4, 8)) for _ in range(2))
    mask = jnp.tril(jnp.ones((12, 12), bool))[None, None, None]
    out = eqx_flash.flax_attention(q, k, v, mask=mask, deterministic=True)
    ref = jax.nn.dot_product_attention(q.reshape(6, 12, 4, 8), k.reshape(6, 12, 4, 8),
                                       v.reshape(6, 12, 4, 8), mask=mask[0], is_causal=False)
    assert_close(out, ref.reshape(q.shape))


@covers("merge_attention")
def test_merge_attention_of_two_key_halves(getkey):
    q, k, v = qkv(getkey(), (2, 4, 12, 8), (2, 4, 32, 8))
    halves = [eqx_flash.flash_attention(q, k[..., a:a + 16, :], v[..., a:a + 16, :])
              for a in (0, 16)]
    out, lse = eqx_flash.merge_attention(jnp.stack([h[0] for h in halves]),
                                         jnp.stack([h[1] for h in halves]))
    ref, ref_lse = eqx_flash.plain_attention(q, k, v)
    assert_close(out, ref)
    assert_lse_close(lse, ref_lse)


@covers("flash_attention")
def test_forward_mode_matches_plain(getkey):
    q, k, v = qkv(getkey(), (2, 24, 8), (2, 32, 8))
    tangents = qkv(getkey(), (2, 24, 8), (2, 32, 8))
    flash = lambda q, k, v: eqx_flash.flash_attention(  # noqa: E731
        q, k, v, causal=True, block_q=8, block_k=8)
    plain = lambda q, k, v: eqx_flash.plain_attention(q, k, v, causal=True)  # noqa: E731
    (out, lse), (d_out, d_lse) = jax.jvp(flash, (q, k, v), tangents)
    _, (ref_d_out, ref_d_lse) = jax.jvp(plain, (q, k, v), tangents)
    assert_close(d_out, ref_d_out, scale=4.0)
    assert_close(d_lse, ref_d_lse, scale=4.0)
    # ...and reverse mode of a function that takes a jvp inside (the sCM/MeanFlow pattern).
    grad = jax.grad(lambda q: jnp.sum(jax.jvp(flash, (q, k, v), tangents)[0][0] ** 2))(q)
    ref_grad = jax.grad(lambda q: jnp.sum(plain(q, k, v)[0] ** 2))(q)
    assert_close(grad, ref_grad, scale=4.0)


@covers("KVCache", "rotary")
def test_cached_decoding_equals_full_attention():
    layer = eqx_flash.FlashMultiheadAttention(4, 16, num_kv_heads=2, causal=True,
                                              key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (10, 16))

    def rope(q, k, v, positions):
        rot = jax.vmap(lambda x: eqx_flash.rotary(x, positions), in_axes=1, out_axes=1)
        return rot(q), rot(k), v

    cache = layer.init_cache(max_len=16)
    assert isinstance(cache, eqx_flash.KVCache)
    first, cache = layer.decode(x[:6], cache, process_heads=rope)
    cache, rest = jax.lax.scan(
        lambda c, x_t: layer.decode(x_t[None], c, process_heads=rope)[::-1], cache, x[6:])
    full = layer(x, x, x, process_heads=lambda q, k, v: rope(q, k, v, jnp.arange(10)))
    assert_close(jnp.concatenate([first, rest[:, 0]]), full)
    assert int(cache.length) == 10
    # rotary at positions 0..n-1 is Equinox's rotary embedding.
    y = jax.random.normal(jax.random.key(2), (10, 16))
    assert_close(eqx_flash.rotary(y, jnp.arange(10)), eqx.nn.RotaryPositionalEmbedding(16)(y))


@covers("make_block_mask", "BlockMask", "ALiBi", "RelativePositionBias", "RelativeScoreMod",
        "testing.RelativeBiasTable", "testing.HeadScaling", "testing.PrefixLM",
        "testing.Documents", "testing.Dilated", "testing.BlockSparse")
def test_score_mod_mask_mod_and_block_mask_match_plain(getkey):
    from eqx_flash import testing

    q, k, v = qkv(getkey(), (2, 4, 32, 8), (2, 2, 32, 8))
    docs = jnp.repeat(jnp.arange(2), 16)[None].repeat(2, axis=0)
    table = testing.RelativeBiasTable(0.1 * jax.random.normal(getkey(), (4, 63)), 32)
    cases = [
        (table, testing.PrefixLM(8, 0)),
        (testing.HeadScaling(jnp.linspace(0.5, 1.5, 4)), testing.Documents(docs, docs)),
        (eqx_flash.RelativePositionBias(4, key=getkey()), testing.Dilated(3, 0)),
        (eqx_flash.ALiBi(4), testing.BlockSparse(jnp.array([[True, False], [True, True]]), 16)),
    ]
    wkey = getkey()
    for score_mod, mask_mod in cases:
        block_mask = eqx_flash.make_block_mask(mask_mod, (2,), 4, 32, 32, block_q=8,
                                               block_k=8, kv_heads=2)
        assert isinstance(block_mask, eqx_flash.BlockMask)
        kwargs = dict(score_mod=score_mod, mask_mod=mask_mod)
        (out, lse), grads = outputs_and_grads(eqx_flash.flash_attention, q, k, v, wkey,
                                              block_mask=block_mask, block_q=8, block_k=8,
                                              **kwargs)
        (ref, ref_lse), ref_grads = outputs_and_grads(eqx_flash.plain_attention, q, k, v,
                                                      wkey, **kwargs)
        assert_close(out, ref)
        assert_lse_close(lse, ref_lse)
        for g, r in zip(grads, ref_grads, strict=True):
            assert_close(g, r, scale=4.0)
    # ALiBi as a score_mod is the built-in alibi_slopes; the learned table gets gradients.
    alibi, _ = eqx_flash.flash_attention(q, k, v, score_mod=eqx_flash.ALiBi(4), causal=True)
    slopes, _ = eqx_flash.flash_attention(q, k, v, alibi_slopes=eqx_flash.ALiBi(4).slopes,
                                          causal=True)
    assert_close(alibi, slopes)
    d_table = eqx.filter_grad(
        lambda m: jnp.sum(eqx_flash.flash_attention(q, k, v, score_mod=m)[0] ** 2))(table)
    ref_table = eqx.filter_grad(
        lambda m: jnp.sum(eqx_flash.plain_attention(q, k, v, score_mod=m)[0] ** 2))(table)
    assert_close(d_table.table, ref_table.table, scale=4.0)


@covers("testing.attention_inputs", "testing.check_attention", "testing.AttentionInputs",
        "testing.Tolerance", "testing.TOLERANCES", "testing.value_and_grad_difference",
        "testing.PRECISION", "testing.tolerance_for")
def test_testing_finds_a_bug_and_passes_flash():
    from eqx_flash.testing import TOLERANCES, AttentionInputs, attention_inputs, check_attention

    assert TOLERANCES[jnp.dtype(jnp.float32)].out[0] < 1e-4
    assert eqx_flash.testing.tolerance_for(jnp.float32, "cpu") == TOLERANCES[jnp.dtype(jnp.float32)]
    assert eqx_flash.testing.PRECISION == "highest"
    assert eqx_flash.testing.value_and_grad_difference is eqx_flash.value_and_grad_difference

    @settings(max_examples=3, deadline=None, derandomize=True, database=None)
    @given(attention_inputs(max_seq=33, dtypes=[jnp.float32], attn_mask=False))
    def flash_passes(inputs):
        assert isinstance(inputs, AttentionInputs)
        check_attention(eqx_flash.flash_attention, inputs)

    flash_passes()

    def wrong_scale(q, k, v, **kwargs):
        return eqx_flash.plain_attention(q, k, v, scale=0.9 / q.shape[-1] ** 0.5)

    problem = AttentionInputs(*qkv(jax.random.key(0), (2, 16, 8), (2, 16, 8)))
    with pytest.raises(AssertionError, match="out"):
        check_attention(wrong_scale, problem, grads=False)
    loose = eqx_flash.testing.Tolerance(out=(1.0, 1.0), lse=(1.0, 1.0), grad=(1.0, 1.0))
    check_attention(wrong_scale, problem, grads=False, tolerance=loose)


def test_every_public_name_is_covered():
    public = {
        name for name, value in vars(eqx_flash).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    public |= {f"testing.{name}" for name in eqx_flash.testing.__all__}
    assert public - COVERED == set(), "public names without a smoke test"
