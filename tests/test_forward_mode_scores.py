"""Forward-mode AD through flash attention with score terms (`bias`, `alibi_slopes`) and
modifications (`score_mod`, `mask_mod`, `block_mask`): tangents of `out` and `lse` along
tangents of q, k, v, the bias, the slopes and the score_mod's arrays, some of them zero,
against forward mode through `plain_attention`; reverse mode still transposes into the
backward kernel, skipping the cotangents of constant score terms."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import examples, seeded_normal, seeded_qkv
from hypothesis import given

from eqx_flash import (
    RelativePositionBias,
    causal_flash_attention,
    flash_attention,
    make_block_mask,
    plain_attention,
)
from eqx_flash.testing import attention_inputs, check_attention

B, H, KH, SQ, SK, D = 2, 4, 2, 21, 27, 8
BLOCKS = dict(block_q=8, block_k=8)  # several blocks, neither length a multiple


def _plain(q, k, v, block_q=None, block_k=None, **kwargs):
    del block_q, block_k
    return plain_attention(q, k, v, **kwargs)


def _qkv():
    return seeded_qkv((B, H, SQ, D), (B, KH, SK, D))


def _assert_tangents_close(got, expected, atol=2e-5):
    """`(out, lse), (d_out, d_lse)` of both; -inf lse rows compared by their pattern."""
    for name, a, b in zip(("out", "lse", "d_out", "d_lse"), jax.tree.leaves(got),
                          jax.tree.leaves(expected), strict=True):
        a, b = np.asarray(a), np.asarray(b)  # (on the host: jnp compiled per shape)
        finite = np.isfinite(b)
        np.testing.assert_array_equal(np.isfinite(a), finite, err_msg=name)
        scale = max(float(np.max(np.abs(np.where(finite, b, 0.0)))), 1.0)
        np.testing.assert_allclose(np.where(finite, a, 0.0), np.where(finite, b, 0.0),
                                   atol=atol * scale, rtol=0, err_msg=name)


def _jvp(fn, args, nonzero, **kwargs):
    """`jax.jvp` of `fn(q, k, v, bias=, alibi_slopes=, **kwargs)` along random tangents of
    the arguments `nonzero` names (the others are constants: symbolic zeros)."""
    names = ("q", "k", "v", "bias", "alibi_slopes")
    diff = [n for n in names if n in nonzero]
    values = dict(zip(names, args, strict=True))

    def call(*xs):
        full = {**values, **dict(zip(diff, xs, strict=True))}
        return fn(full["q"], full["k"], full["v"], bias=full["bias"],
                  alibi_slopes=full["alibi_slopes"], **kwargs)

    primals = tuple(values[n] for n in diff)
    tangents = tuple(seeded_normal(10 + i, x.shape) for i, x in enumerate(primals))
    return jax.jit(lambda p, t: jax.jvp(call, p, t))(primals, tangents)


CASES = {
    # name: (bias shape, slopes shape, non-zero tangents, options)
    "full_bias_all": ((B, H, SQ, SK), None, "q k v bias", {}),
    "shared_bias_only": ((SQ, SK), None, "bias", {"causal": True}),
    "query_bias_and_slopes": ((B, 1, SQ, 1), (H,), "q alibi_slopes", {"causal": True}),
    "batch_slopes_window_softcap": (None, (B, H), "k v alibi_slopes",
                                    {"window": (9, 2), "softcap": 3.0}),
    "head_bias_masks_dropout": ((H, 1, 1), (H,), "v bias", {
        "mask": jnp.asarray(np.random.default_rng(3).random((B, SK)) < 0.8),
        "q_segment_ids": jnp.asarray(np.sort(np.random.default_rng(4).integers(0, 2, (B, SQ)))),
        "kv_segment_ids": jnp.asarray(np.sort(np.random.default_rng(5).integers(0, 2, (B, SK)))),
        "dropout_rate": 0.3, "key": jax.random.key(6),
    }),
}


@pytest.mark.parametrize("name", list(CASES))
def test_jvp_matches_plain_attention(name):
    bias_shape, slopes_shape, nonzero, options = CASES[name]
    bias = None if bias_shape is None else seeded_normal(7, bias_shape)
    slopes = None if slopes_shape is None else 0.1 + jnp.abs(seeded_normal(8, slopes_shape)) * 0.2
    args = (*_qkv(), bias, slopes)
    got = _jvp(flash_attention, args, nonzero.split(), **BLOCKS, **options)
    expected = _jvp(plain_attention, args, nonzero.split(), **options)
    _assert_tangents_close(got, expected)


def test_causal_flash_attention_and_linearize():
    q, k, v = _qkv()
    bias, slopes = seeded_normal(7, (H, SQ, SK)), jnp.asarray([0.3, 0.2, 0.1, 0.05])

    def flash(q, bias, slopes):
        return causal_flash_attention(q, k, v, bias=bias, alibi_slopes=slopes, **BLOCKS)

    def plain(q, bias, slopes):
        return plain_attention(q, k, v, bias=bias, alibi_slopes=slopes, causal=True)

    args = (q, bias, slopes)
    tangents = tuple(seeded_normal(20 + i, x.shape) for i, x in enumerate(args))
    primal, lin = jax.linearize(flash, *args)
    # The reference compiled whole (eagerly each of its ops was a program).
    expected = jax.jit(lambda args, tangents: jax.jvp(plain, args, tangents))(args, tangents)
    _assert_tangents_close((primal, lin(*tangents)), expected)


def test_jacfwd_with_respect_to_the_bias():
    q, k, v = _qkv()
    q, k, v = q[:1, :2, :5, :4], k[:1, :1, :6, :4], v[:1, :1, :6, :4]
    bias = seeded_normal(9, (5, 6))

    def jac(fn, **kwargs):
        return jax.jit(jax.jacfwd(lambda b: fn(q, k, v, bias=b, causal=True, **kwargs)))(bias)

    got, expected = jac(flash_attention, block_q=2, block_k=4), jac(plain_attention)
    assert got[0].shape == (1, 2, 5, 4, 5, 6)
    np.testing.assert_allclose(got[0], expected[0], atol=1e-5)
    np.testing.assert_allclose(got[1], expected[1], atol=1e-5)


def _linear_calls(jaxpr) -> list[tuple[bool, tuple[bool, ...]]]:
    """`(transposed, which)` of every forward-mode linear kernel call in a jaxpr."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "eqx_flash_attention_linear":
            found.append((eqn.params["transposed"], eqn.params["which"]))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _linear_calls(sub)
    return found


@pytest.mark.parametrize("argnums", [(0,), (0, 3), (4,)], ids=str)
def test_grad_runs_the_backward_kernel_for_what_is_asked(argnums):
    """Reverse mode is one call of the backward kernel, asked only for the cotangents of
    the differentiated arguments: a constant bias or slopes cost no accumulation (the
    kernel's `mods_wanted` comes from `which`). (The values: test_score_mods.py.)"""
    q, k, v = _qkv()
    args = (q, k, v, seeded_normal(7, (H, SQ, SK)), jnp.asarray([0.3, 0.2, 0.1, 0.05]))

    def loss(*a):
        out, _ = flash_attention(*a[:3], bias=a[3], alibi_slopes=a[4], causal=True, **BLOCKS)
        return jnp.sum(out**2)

    calls = _linear_calls(jax.make_jaxpr(jax.grad(loss, argnums=argnums))(*args).jaxpr)
    # leaves: q, k, v, bias, slopes
    assert calls == [(True, tuple(i in argnums for i in range(5)))], calls


def test_hessian_through_the_bias():
    q, k, v = _qkv()
    q, k, v = q[:1, :1, :3, :2], k[:1, :1, :4, :2], v[:1, :1, :4, :2]

    def f(fn, bias):
        return jnp.sum(fn(q, k, v, bias=bias, block_q=2, block_k=2)[0] ** 2)

    bias = seeded_normal(9, (3, 4))
    got = jax.jit(jax.hessian(functools.partial(f, flash_attention)))(bias)
    expected = jax.jit(jax.hessian(functools.partial(f, _plain)))(bias)
    np.testing.assert_allclose(got, expected, atol=2e-5)


# --- score_mod, mask_mod, block_mask ----------------------------------------------------------


def _table_bias(table):
    """A learned bias per head and relative distance (a closure over a traced array)."""
    return lambda s, b, h, i, j: s + table[h, i - j + SK]


def _causal_prefix(b, h, i, j):
    return (j < 3) | (j <= i + SK - SQ)


@pytest.mark.parametrize("with_block_mask", [False, True])
def test_jvp_with_score_mod_and_mask_mod(with_block_mask):
    """Tangents along q, v and the score_mod's array (a learned relative bias), with a
    mask_mod (and its block_mask), a bias and a softcap applied after the score_mod."""
    q, k, v = _qkv()
    table = 0.5 * seeded_normal(5, (H, SQ + SK + 1))
    bias = seeded_normal(7, (SQ, SK))
    block_mask = (make_block_mask(_causal_prefix, B, H, SQ, SK, kv_heads=KH, **BLOCKS)
                  if with_block_mask else None)

    def call(fn, **kwargs):
        def f(q, v, table):
            return fn(q, k, v, bias=bias, score_mod=_table_bias(table),
                      mask_mod=_causal_prefix, softcap=4.0, **kwargs)

        return f

    args = (q, v, table)
    tangents = tuple(seeded_normal(30 + i, x.shape) for i, x in enumerate(args))
    got = jax.jit(lambda a, t: jax.jvp(call(flash_attention, block_mask=block_mask,
                                            **BLOCKS), a, t))(args, tangents)
    # The reference compiled whole (eagerly each of its ops was a program).
    expected = jax.jit(lambda a, t: jax.jvp(call(plain_attention), a, t))(args, tangents)
    _assert_tangents_close(got, expected)


def test_scm_pattern_with_a_learned_position_bias():
    """A jvp along the leaf of an `eqx.Module` score_mod (`RelativePositionBias.table`),
    and the sCM/MeanFlow step (grad of a loss on the jvp's primal, target from its tangent
    under stop_gradient) with that module and a bias trained: as through plain attention."""
    q, k, v = _qkv()
    rpb = RelativePositionBias(H, num_buckets=8, max_distance=16, key=jax.random.key(0))
    rpb = eqx.tree_at(lambda m: m.table, rpb, 3.0 * rpb.table)
    bias = seeded_normal(7, (SQ, SK))

    @eqx.filter_jit
    def tangent_along_table(fn, **kwargs):
        return jax.jvp(lambda m: fn(q, k, v, score_mod=m, causal=True, **kwargs), (rpb,),
                       (jax.tree.map(jnp.ones_like, rpb),))

    _assert_tangents_close(tangent_along_table(flash_attention, **BLOCKS),
                           tangent_along_table(plain_attention))

    def loss(fn, **kwargs):
        def f(params, q):
            rpb, bias = params

            def model(q, t):
                return fn(q * t, k, v, bias=bias, score_mod=rpb, causal=True, **kwargs)[0]

            u, du = jax.jvp(model, (q, jnp.asarray(0.7)), (jnp.sin(q), jnp.asarray(1.0)))
            target = jax.lax.stop_gradient(u - 0.5 * du)
            return jnp.mean((u - target) ** 2) + jnp.mean(u**2)

        return eqx.filter_jit(eqx.filter_grad(f))((rpb, bias), q)

    got, expected = loss(flash_attention, **BLOCKS), loss(plain_attention)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5 * max(float(jnp.abs(b).max()), 1.0))


@given(attention_inputs(bias=None, alibi=None, score_mod=None, mask_mod=None,
                        dtypes=(jnp.float32,), max_seq=48, dims=(8,)))
@examples(3)
def test_jvp_property(inputs):
    """Over the strategy, with every other feature drawn too: `check_attention(jvp=True)`
    perturbs the bias, the slopes and the score_mod's arrays along with q, k, v."""
    check_attention(flash_attention, inputs, grads=False, jvp=True)
