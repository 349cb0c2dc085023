"""`merge_attention`: results over disjoint key sets combine into the result over their
union, exactly, in both derivative modes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, assert_lse_close, enable_x64, qkv

import eqx_flash


def _parts(q, k, v, cuts, mask=None):
    """Attention over each slice of the keys between `cuts` (and of the key `mask`),
    stacked."""
    edges = [0, *cuts, k.shape[-2]]
    results = [eqx_flash.flash_attention(q, k[..., a:b, :], v[..., a:b, :],
                                         None if mask is None else mask[..., a:b])
               for a, b in zip(edges[:-1], edges[1:], strict=True)]
    return jnp.stack([r[0] for r in results]), jnp.stack([r[1] for r in results])


@pytest.mark.parametrize("cuts", [(), (16,), (5, 20, 31)])
def test_merge_of_parts_is_attention_over_the_union(cuts):
    q, k, v = qkv(0, (2, 4, 13, 8), (2, 2, 40, 8))
    outs, lses = _parts(q, k, v, cuts)
    out, lse = eqx_flash.merge_attention(outs, lses)
    expected_out, expected_lse = eqx_flash.flash_attention(q, k, v)
    assert_close(out, expected_out)
    assert_lse_close(lse, expected_lse)


def test_empty_parts_contribute_nothing_and_all_empty_rows_are_zero():
    q, k, v = qkv(1, (1, 2, 6, 8), (1, 2, 12, 8))
    mask = jnp.zeros((1, 12), bool).at[:, :4].set(True)  # the second part sees nothing
    outs, lses = _parts(q, k, v, (6,), mask=mask)
    assert bool(jnp.all(lses[1] == -jnp.inf))
    out, lse = eqx_flash.merge_attention(outs, lses)
    assert_close(out, eqx_flash.flash_attention(q, k, v, mask)[0])
    empty_out, empty_lse = eqx_flash.merge_attention(jnp.zeros((3, 2, 6, 8)),
                                                     jnp.full((3, 2, 6), -jnp.inf))
    np.testing.assert_array_equal(np.asarray(empty_out), 0.0)
    assert bool(jnp.all(empty_lse == -jnp.inf))
    grads = jax.grad(lambda o, s: jnp.sum(eqx_flash.merge_attention(o, s)[0]),
                     argnums=(0, 1))(jnp.zeros((3, 2, 6, 8)), jnp.full((3, 2, 6), -jnp.inf))
    for g in grads:
        assert bool(jnp.all(g == 0.0))


def test_a_sink_is_the_part_zero_sink():
    q, k, v = qkv(2, (2, 4, 9, 8), (2, 4, 9, 8))
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0])
    out, lse = eqx_flash.flash_attention(q, k, v)
    sink_lse = jnp.broadcast_to(sinks[None, :, None], lse.shape)
    merged = eqx_flash.merge_attention(jnp.stack([out, jnp.zeros_like(out)]),
                                       jnp.stack([lse, sink_lse]))
    expected = eqx_flash.flash_attention(q, k, v, sinks=sinks)
    assert_close(merged[0], expected[0])
    assert_lse_close(merged[1], expected[1])


def test_derivatives_through_the_parts_match_the_whole_in_float64():
    with enable_x64():
        q, k, v = (x.astype(jnp.float64) for x in qkv(3, (1, 2, 7, 8), (1, 2, 20, 8)))

        def by_parts(q, k, v):
            return eqx_flash.merge_attention(*_parts(q, k, v, (8, 13)))

        def whole(q, k, v):
            return eqx_flash.flash_attention(q, k, v)

        def loss(fn):
            return lambda *a: jnp.sum(fn(*a)[0] ** 2) + jnp.sum(fn(*a)[1])

        for g, e in zip(jax.grad(loss(by_parts), argnums=(0, 1, 2))(q, k, v),
                        jax.grad(loss(whole), argnums=(0, 1, 2))(q, k, v), strict=True):
            np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-12)
        tangents = tuple(jnp.ones_like(x) * 0.1 for x in (q, k, v))
        for g, e in zip(jax.jvp(by_parts, (q, k, v), tangents)[1],
                        jax.jvp(whole, (q, k, v), tangents)[1], strict=True):
            np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("outs, lses, match", [
    (jnp.zeros((2, 4, 8)), jnp.zeros((2, 5)), "lses"),
    (jnp.zeros((2, 4, 8), jnp.int32), jnp.zeros((2, 4)), "outs"),
    (jnp.zeros((2, 4, 8)), jnp.zeros((2, 4), jnp.int32), "lses"),
    (jnp.zeros((0, 4, 8)), jnp.zeros((0, 4)), "outs"),
    (jnp.zeros((8,)), jnp.zeros(()), "outs"),
])
def test_bad_inputs_name_the_argument(outs, lses, match):
    with pytest.raises((TypeError, ValueError), match=match):
        eqx_flash.merge_attention(outs, lses)


def test_an_empty_part_with_nonfinite_out_contributes_nothing():
    """A part with lse -inf contributes nothing whatever its out holds (#41: NaN or inf
    there made every row NaN, weight 0 times NaN): values, gradients and tangents as
    without it, zero cotangent to the empty part's out."""
    q, k, v = qkv(4, (1, 2, 6, 8), (1, 2, 12, 8))
    outs, lses = _parts(q, k, v, (6,))
    expected = eqx_flash.merge_attention(outs, lses)
    for poison in (jnp.nan, jnp.inf, -jnp.inf):
        # A third part: rows 0-2 empty with garbage out, rows 3-5 empty too.
        junk = jnp.full(outs.shape[1:], poison).at[..., 3:, :].set(1e30)
        all_outs = jnp.concatenate([outs, junk[None]])
        all_lses = jnp.concatenate([lses, jnp.full(lses.shape[1:], -jnp.inf)[None]])
        out, lse = eqx_flash.merge_attention(all_outs, all_lses)
        assert_close(out, expected[0])
        assert_lse_close(lse, expected[1])

        def loss(o, s):
            out, lse = eqx_flash.merge_attention(o, s)
            return jnp.sum(out ** 2) + jnp.sum(lse)

        d_outs, d_lses = jax.grad(loss, argnums=(0, 1))(all_outs, all_lses)
        e_outs, e_lses = jax.grad(loss, argnums=(0, 1))(outs, lses)
        assert_close(d_outs[:2], e_outs, kind="grad")
        assert_close(d_lses[:2], e_lses, kind="grad")
        np.testing.assert_array_equal(np.asarray(d_outs[2]), 0.0)
        np.testing.assert_array_equal(np.asarray(d_lses[2]), 0.0)
        tangent = jax.jvp(eqx_flash.merge_attention, (all_outs, all_lses),
                          (jnp.ones_like(all_outs), jnp.zeros_like(all_lses)))[1]
        assert_close(tangent[0], jax.jvp(eqx_flash.merge_attention, (outs, lses),
                                         (jnp.ones_like(outs), jnp.zeros_like(lses)))[1][0])
