"""`merge_attention`: results over disjoint key sets combine into the result over their
union, exactly, in both derivative modes.

Each comparison is one compiled program (the parts, their merge and the whole call):
eagerly, each op of each part compiled a program of its own."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, assert_lse_close, enable_x64, seeded_qkv

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
    q, k, v = seeded_qkv((2, 4, 13, 8), (2, 2, 40, 8))

    @jax.jit
    def merged_and_whole(q, k, v):
        return eqx_flash.merge_attention(*_parts(q, k, v, cuts)), eqx_flash.flash_attention(
            q, k, v)

    (out, lse), (expected_out, expected_lse) = merged_and_whole(q, k, v)
    assert_close(out, expected_out)
    assert_lse_close(lse, expected_lse)


def test_empty_parts_contribute_nothing_and_all_empty_rows_are_zero():
    q, k, v = seeded_qkv((1, 2, 6, 8), (1, 2, 12, 8))
    mask = jax.device_put(np.arange(12)[None] < 4)  # the second part sees nothing

    @jax.jit
    def parts_merged_and_whole(q, k, v, mask):
        outs, lses = _parts(q, k, v, (6,), mask=mask)
        return lses, eqx_flash.merge_attention(outs, lses), eqx_flash.flash_attention(
            q, k, v, mask)

    lses, (out, lse), (expected_out, _) = parts_merged_and_whole(q, k, v, mask)
    assert np.all(np.isneginf(np.asarray(lses[1])))
    assert_close(out, expected_out)

    # Every part empty: zero out, -inf lse, zero gradients.
    @jax.jit
    def all_empty(outs, lses):
        merged = eqx_flash.merge_attention(outs, lses)
        grads = jax.grad(lambda o, s: jnp.sum(eqx_flash.merge_attention(o, s)[0]),
                         argnums=(0, 1))(outs, lses)
        return merged, grads

    (empty_out, empty_lse), grads = all_empty(
        jax.device_put(np.zeros((3, 2, 6, 8), np.float32)),
        jax.device_put(np.full((3, 2, 6), -np.inf, np.float32)))
    np.testing.assert_array_equal(np.asarray(empty_out), 0.0)
    assert np.all(np.isneginf(np.asarray(empty_lse)))
    for g in grads:
        np.testing.assert_array_equal(np.asarray(g), 0.0)


def test_a_sink_is_the_part_zero_sink():
    q, k, v = seeded_qkv((2, 4, 9, 8), (2, 4, 9, 8))
    sinks = jax.device_put(np.asarray([0.5, -1.0, 2.0, 0.0], np.float32))

    @jax.jit
    def merged_and_with_sinks(q, k, v, sinks):
        out, lse = eqx_flash.flash_attention(q, k, v)
        sink_lse = jnp.broadcast_to(sinks[None, :, None], lse.shape)
        merged = eqx_flash.merge_attention(jnp.stack([out, jnp.zeros_like(out)]),
                                           jnp.stack([lse, sink_lse]))
        return merged, eqx_flash.flash_attention(q, k, v, sinks=sinks)

    merged, expected = merged_and_with_sinks(q, k, v, sinks)
    assert_close(merged[0], expected[0])
    assert_lse_close(merged[1], expected[1])


def test_derivatives_through_the_parts_match_the_whole_in_float64():
    with enable_x64():
        q, k, v = seeded_qkv((1, 2, 7, 8), (1, 2, 20, 8), dtype=jnp.float64)

        def by_parts(q, k, v):
            return eqx_flash.merge_attention(*_parts(q, k, v, (8, 13)))

        def whole(q, k, v):
            return eqx_flash.flash_attention(q, k, v)

        @jax.jit
        def derivatives(q, k, v):
            def of(fn):
                def loss(*a):
                    out, lse = fn(*a)
                    return jnp.sum(out ** 2) + jnp.sum(lse)

                tangents = tuple(jnp.full_like(x, 0.1) for x in (q, k, v))
                return (jax.grad(loss, argnums=(0, 1, 2))(q, k, v),
                        jax.jvp(fn, (q, k, v), tangents)[1])

            return of(by_parts), of(whole)

        got, expected = derivatives(q, k, v)
        for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
            assert g.dtype == jnp.float64
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
    q, k, v = seeded_qkv((1, 2, 6, 8), (1, 2, 12, 8))

    def loss(o, s):
        out, lse = eqx_flash.merge_attention(o, s)
        return jnp.sum(out ** 2) + jnp.sum(lse)

    def merged_grads_and_tangent(outs, lses):
        return (eqx_flash.merge_attention(outs, lses),
                jax.grad(loss, argnums=(0, 1))(outs, lses),
                jax.jvp(eqx_flash.merge_attention, (outs, lses),
                        (jnp.ones_like(outs), jnp.zeros_like(lses)))[1][0])

    @jax.jit
    def with_and_without_junk(q, k, v, poison):
        outs, lses = _parts(q, k, v, (6,))
        # A third part: rows 0-2 empty with garbage out, rows 3-5 empty too.
        junk = jnp.where(jnp.arange(6)[:, None] < 3, poison, 1e30)
        junk = jnp.broadcast_to(junk, outs.shape[1:])
        all_outs = jnp.concatenate([outs, junk[None]])
        all_lses = jnp.concatenate([lses, jnp.full(lses.shape[1:], -jnp.inf)[None]])
        return (merged_grads_and_tangent(all_outs, all_lses),
                merged_grads_and_tangent(outs, lses))

    for poison in (np.nan, np.inf, -np.inf):
        got, expected = with_and_without_junk(q, k, v, np.float32(poison))
        (out, lse), (d_outs, d_lses), tangent = got
        (e_out, e_lse), (e_outs, e_lses), e_tangent = expected
        assert_close(out, e_out)
        assert_lse_close(lse, e_lse)
        assert_close(d_outs[:2], e_outs, kind="grad")
        assert_close(d_lses[:2], e_lses, kind="grad")
        np.testing.assert_array_equal(np.asarray(d_outs[2]), 0.0)
        np.testing.assert_array_equal(np.asarray(d_lses[2]), 0.0)
        assert_close(tangent, e_tangent)
