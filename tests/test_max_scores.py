"""`return_max_scores=True`: each row's largest final score over the keys it attends (the
statistic QK-clip/MuonClip rescales the projections by), on every entry point, against
an independent float64 reference (`helpers.oracle_attention`) and against
`plain_attention`."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, assert_lse_close, enable_x64, examples, oracle_attention, qkv
from hypothesis import given

import eqx_flash
from eqx_flash.testing import attention_inputs

B, H, KH, SQ, SK, D = 2, 4, 2, 19, 27, 8
BLOCKS = dict(block_q=8, block_k=8)


def _oracle_max(q, k, **kwargs):
    """The float64 oracle's max scores (`helpers.oracle_attention`; they do not read v)."""
    return oracle_attention(q, k, k, **kwargs)[2]


def _assert_max_close(actual, expected, dtype=jnp.float32):
    assert_lse_close(actual, expected, dtype)  # -inf in the same places, finite close


CASES = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window=(5, 2)),
    "softcap": dict(softcap=2.0, causal=True),
    "mask": dict(mask=True),
    "lengths": dict(q_lengths=[19, 7], kv_lengths=[27, 9], causal=True),
    "bias_alibi": dict(bias=True, slopes=True, causal=True),
}


def _arguments(case: dict, seed=0):
    """flash_attention keywords for one case (the oracle takes the same)."""
    keys = jax.random.split(jax.random.key(seed + 100), 3)
    kw = {}
    for name, value in case.items():
        if name == "mask":
            mask = np.array(jax.random.uniform(keys[0], (B, SK)) > 0.3)
            mask[1] = False  # batch element 1 attends nothing: -inf everywhere
            kw["mask"] = jnp.asarray(mask)
        elif name == "bias":
            kw["bias"] = jax.random.normal(keys[1], (H, SQ, SK))
        elif name == "slopes":
            kw["alibi_slopes"] = jax.random.uniform(keys[2], (H,))
        elif name in ("q_lengths", "kv_lengths"):
            kw[name] = jnp.asarray(value)
        else:
            kw[name] = value
    return kw


@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_float64_reference(case):
    q, k, v = qkv(0, (B, H, SQ, D), (B, KH, SK, D))
    kw = _arguments(CASES[case])
    out, lse, top = eqx_flash.flash_attention(q, k, v, return_max_scores=True, **kw, **BLOCKS)
    assert top.shape == lse.shape and top.dtype == jnp.float32
    _assert_max_close(top, _oracle_max(q, k, **kw))
    # The same (out, lse) as without, and the reference agrees on the max.
    plain_out, plain_lse = eqx_flash.flash_attention(q, k, v, **kw, **BLOCKS)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(plain_out))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(plain_lse))
    # (Compiled whole: eagerly each of its ops was a program.)
    *_, ref_top = jax.jit(functools.partial(eqx_flash.plain_attention, return_max_scores=True,
                                            **kw))(q, k, v)
    _assert_max_close(ref_top, _oracle_max(q, k, **kw))


def test_float64_inputs_give_float64_max_scores():
    with enable_x64():
        q, k, v = (x.astype(jnp.float64) for x in qkv(1, (B, H, SQ, D), (B, KH, SK, D)))
        *_, top = eqx_flash.flash_attention(q, k, v, causal=True, return_max_scores=True,
                                            **BLOCKS)
        assert top.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(top), _oracle_max(q, k, causal=True), rtol=1e-12)


def test_sinks_are_excluded_and_empty_rows_are_minus_inf():
    q, k, v = qkv(2, (B, H, SQ, D), (B, KH, SK, D))
    mask = np.ones((B, SK), bool)
    mask[1] = False
    *_, top = eqx_flash.flash_attention(q, k, v, mask, sinks=np.full((H,), 50.0, np.float32),
                                        return_max_scores=True, **BLOCKS)
    *_, no_sink = eqx_flash.flash_attention(q, k, v, mask, return_max_scores=True, **BLOCKS)
    np.testing.assert_array_equal(np.asarray(top), np.asarray(no_sink))
    assert np.all(np.isneginf(np.asarray(top[1])))
    assert np.all(np.asarray(top[0]) < 50.0)


def test_score_mod_and_mask_mod_are_in_the_final_scores():
    q, k, v = qkv(3, (B, H, SQ, D), (B, KH, SK, D))

    def score_mod(s, b, h, i, j):
        return s + 0.5 * h.astype(s.dtype) - 0.01 * jnp.abs(i - j).astype(s.dtype)

    def mask_mod(b, h, i, j):
        return (j <= i + SK - SQ) & (j % 3 != 0)

    *_, top = eqx_flash.flash_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                                        return_max_scores=True, **BLOCKS)
    s = np.einsum("bhqd,bhkd->bhqk", np.asarray(q, np.float64),
                  np.repeat(np.asarray(k, np.float64), H // KH, axis=1)) / np.sqrt(D)
    h, i, j = (np.arange(n).reshape(shape) for n, shape in
               ((H, (1, H, 1, 1)), (SQ, (1, 1, SQ, 1)), (SK, (1, 1, 1, SK))))
    s = s + 0.5 * h - 0.01 * np.abs(i - j)
    expected = np.where((j <= i + SK - SQ) & (j % 3 != 0), s, -np.inf).max(-1)
    _assert_max_close(top, expected)


def test_decoding_lanes_reduce_the_max():
    """One query against many keys runs flash-decoding's split-K lanes (`split_k_forward`),
    whose per-lane maxima are reduced with the merge."""
    q, k, v = qkv(4, (2, 2, 1, 16), (2, 2, 4096, 16))
    lengths = jnp.array([4000, 300])
    *_, top = eqx_flash.flash_attention(q, k, v, kv_lengths=lengths, return_max_scores=True)
    _assert_max_close(top, _oracle_max(q, k, q_lengths=[1, 1], kv_lengths=[4000, 300]))


def test_no_derivative_flows_and_other_derivatives_are_unchanged():
    q, k, v = qkv(5, (B, H, SQ, D), (B, KH, SK, D))
    fn = functools.partial(eqx_flash.flash_attention, causal=True, return_max_scores=True,
                           **BLOCKS)

    def loss(q, k, v, asked):
        out, lse, *_ = eqx_flash.flash_attention(q, k, v, causal=True,
                                                 return_max_scores=asked, **BLOCKS)
        return jnp.sum(out**2) + jnp.sum(lse)

    @jax.jit
    def derivatives(q, k, v):  # one program (eagerly, each op of each was one)
        return (jax.grad(lambda q, k: jnp.sum(fn(q, k, v)[2]), argnums=(0, 1))(q, k),
                jax.grad(functools.partial(loss, asked=True), argnums=(0, 1, 2))(q, k, v),
                jax.grad(functools.partial(loss, asked=False), argnums=(0, 1, 2))(q, k, v),
                jax.jvp(lambda q: fn(q, k, v), (q,), (jnp.ones_like(q),))[1])

    grads, with_max, without, tangents = derivatives(q, k, v)
    assert all(np.all(np.asarray(g) == 0) for g in grads)
    for a, b in zip(with_max, without, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.all(np.asarray(tangents[2]) == 0) and np.any(np.asarray(tangents[0]) != 0)


def test_transforms():
    q, k, v = qkv(6, (B, H, SQ, D), (B, KH, SK, D))
    fn = functools.partial(eqx_flash.flash_attention, causal=True, return_max_scores=True,
                           **BLOCKS)
    expected = fn(q, k, v)[2]
    # jit, and vmap and checkpoint compiled whole (eagerly, each op was a program).
    for got in (jax.jit(fn)(q, k, v)[2], jax.jit(jax.vmap(fn))(q, k, v)[2],
                jax.jit(jax.checkpoint(fn))(q, k, v)[2]):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_modules():
    q, k, v = qkv(7, (H, SQ, D), (KH, SK, D))
    out, top = eqx_flash.FlashAttention(causal=True, **BLOCKS)(q, k, v, return_max_scores=True)
    _assert_max_close(top, _oracle_max(q[None], k[None], causal=True)[0])
    assert out.shape == (H, SQ, D)
    mha = eqx_flash.FlashMultiheadAttention(H, 16, num_kv_heads=KH, causal=True,
                                            key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (SQ, 16))
    out, top = mha(x, x, x, return_max_scores=True)
    assert out.shape == (SQ, 16) and top.shape == (H, SQ)
    assert_close(out, mha(x, x, x))
    heads = lambda proj, n: jax.vmap(proj)(x).reshape(SQ, n, -1).swapaxes(0, 1)  # noqa: E731
    qh, kh = heads(mha.query_proj, H), heads(mha.key_proj, KH)
    _assert_max_close(top, _oracle_max(qh[None], kh[None], causal=True)[0])


def test_ring_on_one_device():
    from jax.sharding import Mesh, PartitionSpec

    q, k, v = qkv(8, (B, H, 16, D), (B, KH, 16, D))
    seq = PartitionSpec(None, None, "seq")
    lse_spec = PartitionSpec(None, None, "seq")
    mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
    ring = jax.jit(jax.shard_map(
        lambda q, k, v: eqx_flash.ring_flash_attention(
            q, k, v, axis_name="seq", causal=True, return_max_scores=True, **BLOCKS),
        mesh=mesh, in_specs=(seq, seq, seq), out_specs=(seq, lse_spec, lse_spec)))
    _assert_max_close(ring(q, k, v)[2], _oracle_max(q, k, causal=True))
    *_, top = eqx_flash.sharded_flash_attention(q, k, v, mesh=mesh, seq_axis="seq",
                                                causal=True, return_max_scores=True)
    _assert_max_close(top, _oracle_max(q, k, causal=True))


@examples(20)
@given(attention_inputs(dtypes=[jnp.float32], max_seq=64, lengths=None))
def test_property_kernels_agree_with_the_reference(inputs):
    """Over the strategy's masks, causal settings, score terms, softcap, dropout and block
    sizes: the kernels' running max equals the reference's max over its score matrix."""
    kwargs = dict(inputs.kwargs)
    ref_kwargs = {n: x for n, x in kwargs.items() if n not in ("block_q", "block_k")}
    # Compiled whole (non-array options static): faster than op by op, the same numbers.
    flash, plain = (eqx.filter_jit(f) for f in (eqx_flash.flash_attention,
                                                eqx_flash.plain_attention))
    *_, top = flash(inputs.q, inputs.k, inputs.v, return_max_scores=True, **kwargs)
    *_, ref = plain(inputs.q, inputs.k, inputs.v, return_max_scores=True, **ref_kwargs)
    _assert_max_close(top, ref, inputs.q.dtype)


def test_bad_flag_is_refused_naming_it():
    q, k, v = qkv(9, (H, SQ, D), (KH, SK, D))
    for fn in (eqx_flash.flash_attention, eqx_flash.plain_attention):
        with pytest.raises(TypeError, match="return_max_scores must be a bool"):
            fn(q, k, v, return_max_scores="yes")
    layer = eqx_flash.FlashAttention()
    with pytest.raises(TypeError, match="return_max_scores"):
        layer(q, k, v, return_max_scores="yes")
    assert isinstance(eqx.filter_eval_shape(lambda: layer(q, k, v)), jax.ShapeDtypeStruct)


@examples(5)
@given(attention_inputs(dtypes=[jnp.float32], max_seq=32, lengths=None))
def test_check_attention_compares_max_scores_when_asked(inputs):
    from eqx_flash.testing import check_attention

    check_attention(eqx_flash.flash_attention, inputs, grads=False, max_scores=True)

    def off_by_one(q, k, v, *args, return_max_scores=False, **kwargs):
        out, lse, top = eqx_flash.flash_attention(q, k, v, *args, return_max_scores=True,
                                                  **kwargs)
        wrong = jnp.where(jnp.isneginf(top), 0.0, top + 1.0)  # off in every entry
        return (out, lse, wrong) if return_max_scores else (out, lse)

    check_attention(off_by_one, inputs, grads=False)  # not asked: not compared
    with pytest.raises(AssertionError, match="max_scores"):
        check_attention(off_by_one, inputs, grads=False, max_scores=True)
