"""A NaN or infinity in q, k or v reaches exactly the outputs that attend it (#22.1).

Which rows attend a key is measured independently of any masking code: on the clean
problem, the jvp of the reference along that key's value row is non-zero exactly in the
rows that give the key a positive weight. A NaN put there must make those output rows
NaN (and their lse too, for a NaN key), leave every other row as it was, and do so
whatever the block sizes and on every path: the blockwise kernels, flash-decoding's
split-K lanes, the reference, the ring and the modules. Padding and masked positions
(lengths, key masks, segment ids, causal, windows, pair masks) reach nothing.
"""

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, assert_lse_close, examples, seeded_qkv
from hypothesis import given
from hypothesis import strategies as st

import eqx_flash
from eqx_flash import flash_attention, plain_attention
from eqx_flash.testing import AttentionInputs, attention_inputs

BLOCKS = ("block_q", "block_k")


def _reference_kwargs(inputs: AttentionInputs) -> dict:
    return {n: x for n, x in inputs.kwargs.items() if n not in BLOCKS}


@eqx.filter_jit
def _reference_and_reach(q, k, v, tangent, kwargs):
    """`plain_attention`'s `(out, lse)` and, bool `(*batch, heads, seq_q)`, the rows whose
    output moves along the value tangent `tangent`, compiled as one program."""
    (out, lse), (d_out, _) = jax.jvp(lambda v: plain_attention(q, k, v, **kwargs), (v,),
                                     (tangent,))
    return out, lse, jnp.any(d_out != 0, axis=-1)


def _value_row_tangent(inputs: AttentionInputs, kv_index: tuple[int, ...] | None) -> jax.Array:
    """A tangent of `v` that is 1 in value row `kv_index` (`(*batch, kv_head, key)`)."""
    tangent = np.zeros(inputs.v.shape, np.float32)
    if kv_index is not None:
        tangent[kv_index] = 1.0
    return jax.device_put(tangent.astype(inputs.v.dtype))


def _with(x: jax.Array, index: tuple[int, ...], value: float) -> jax.Array:
    y = np.array(x)
    y[index] = value
    return jax.device_put(y)  # (`jnp.asarray` would compile a program per shape)


def _assert_only_rows_nan(out, lse, clean, nan_rows, lse_nan: bool):
    """`out` NaN in whole rows exactly at `nan_rows`, equal to `clean` elsewhere; `lse`
    NaN at `nan_rows` if `lse_nan`, else equal to the clean lse everywhere."""
    out, lse = np.asarray(out, np.float32), np.asarray(lse, np.float32)
    clean_out, clean_lse = (np.asarray(x, np.float32) for x in clean)
    np.testing.assert_array_equal(np.isnan(out).any(-1), nan_rows, "rows with a NaN")
    np.testing.assert_array_equal(np.isnan(out).all(-1), nan_rows, "rows wholly NaN")
    assert_close(out[~nan_rows], clean_out[~nan_rows])
    if lse_nan:
        np.testing.assert_array_equal(np.isnan(lse), nan_rows, "lse NaN")
        assert_lse_close(lse[~nan_rows], clean_lse[~nan_rows])
    else:
        assert_lse_close(lse, clean_lse)


def _draw_position(draw, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(draw(st.integers(0, n - 1)) for n in shape)


# (Fixed cases: the causal, split-K, masked-position, ring and module tests below.)
@examples(20)
@given(attention_inputs(dtypes=[jnp.float32], max_seq=64, lengths=None),
       st.sampled_from(["q", "k", "v"]), st.sampled_from(["q", "k", "v"]),
       st.sampled_from([np.inf, -np.inf]), st.data())
def test_property_a_nan_reaches_its_rows_and_an_infinity_as_in_the_reference(
        inputs, where, inf_where, inf_value, data):
    """A NaN reaches exactly the rows that attend it. An infinite score is NaN (`inf -
    inf`) or a weight of 0 (`-inf`), a soft-capped one finite: the kernels agree with the
    reference on every row, for any block size. (One problem for both: the same compiled
    programs.)"""
    target = getattr(inputs, where)
    index = _draw_position(data.draw, target.shape)
    # Compiled whole (non-array options static): faster than op by op, the same numbers.
    # The reference and the rows that attend the key are one program, which the broken
    # problems (the same shapes) run again.
    flash = eqx.filter_jit(flash_attention)
    tangent = _value_row_tangent(inputs, None if where == "q" else index[:-1])
    clean = flash(inputs.q, inputs.k, inputs.v, **inputs.kwargs)
    *reference_clean, reach = _reference_and_reach(inputs.q, inputs.k, inputs.v, tangent,
                                                   _reference_kwargs(inputs))
    if where == "q":  # that row, if it attends anything
        nan_rows = np.zeros(inputs.q.shape[:-1], bool)
        row = index[:-1]
        nan_rows[row] = np.isfinite(np.asarray(reference_clean[1])[row])
    else:
        nan_rows = np.asarray(reach)
    broken = dataclasses.replace(inputs, **{where: _with(target, index, np.nan)})
    out, lse = flash(broken.q, broken.k, broken.v, **broken.kwargs)
    _assert_only_rows_nan(out, lse, clean, nan_rows, lse_nan=where != "v")
    out, lse, _ = _reference_and_reach(broken.q, broken.k, broken.v, tangent,
                                       _reference_kwargs(broken))
    _assert_only_rows_nan(out, lse, reference_clean, nan_rows, lse_nan=where != "v")

    target = getattr(inputs, inf_where)
    index = _draw_position(data.draw, target.shape)
    broken = dataclasses.replace(inputs, **{inf_where: _with(target, index, inf_value)})
    out, lse = flash(broken.q, broken.k, broken.v, **broken.kwargs)
    ref_out, ref_lse, _ = _reference_and_reach(broken.q, broken.k, broken.v, tangent,
                                               _reference_kwargs(broken))
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref_out))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
    finite = ~np.isnan(np.asarray(ref_out)).any(-1)
    assert_close(np.asarray(out)[finite], np.asarray(ref_out)[finite])


# (Fixed cases in the diagonal block: `test_causal_tangent_reaches_only_later_rows`,
# `test_causal_value_reaches_no_earlier_gradient`.)
@examples(8)
@given(attention_inputs(dtypes=[jnp.float32], max_seq=64, lengths=None), st.data())
def test_property_a_nan_value_reaches_the_derivatives_the_reference_does(inputs, data):
    """A NaN value row: the gradients (the backward kernel) are NaN exactly where
    `plain_attention`'s are, and the tangents of `jax.jvp` (the one-pass kernel) and of
    `jax.linearize` (the tangent kernel) in exactly the rows whose output is NaN, whatever
    the masks and block sizes: a masked pair's weight 0 never multiplies the NaN into a
    row that does not attend it. (The reference's tangent of a NaN row is 0, not NaN:
    its NaN is a `where`, whose derivative does not carry it.)"""
    index = _draw_position(data.draw, inputs.v.shape)
    v = _with(inputs.v, index, np.nan)
    args = (inputs.q, inputs.k, v)

    def grads(fn, kwargs):  # (compiled whole: faster than op by op)
        def loss(q, k, v):
            return jnp.sum(fn(q, k, v, **kwargs)[0])
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)

    expected = grads(plain_attention, _reference_kwargs(inputs))
    for name, g, w in zip(("dq", "dk", "dv"), grads(flash_attention, inputs.kwargs), expected,
                          strict=True):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), name)

    def attend(q, k, v):
        return flash_attention(q, k, v, **inputs.kwargs)

    tangents = tuple(jnp.cos(x) for x in (inputs.q, inputs.k, inputs.v))
    (out, _), (d_out, _) = jax.jit(lambda *a: jax.jvp(attend, a, tangents))(*args)
    linear_d_out = jax.jit(lambda *a: jax.linearize(attend, *a)[1](*tangents)[0])(*args)
    nan_rows = np.isnan(np.asarray(out)).any(-1)
    for name, t in (("jvp", d_out), ("linearize", linear_d_out)):
        np.testing.assert_array_equal(np.isnan(np.asarray(t)).any(-1), nan_rows, name)


def test_the_issues_example_is_nan_for_every_block_size():
    q, k, v = seeded_qkv((2, 16, 8), (2, 16, 8))
    k = _with(k, (0, 5, 1), np.nan)
    for blocks in ({}, {"block_q": 4, "block_k": 4}, {"block_q": 8, "block_k": 2}):
        out, lse = (np.asarray(x) for x in flash_attention(q, k, v, **blocks))
        assert np.isnan(out[0]).all() and np.isnan(lse[0]).all()
        assert np.isfinite(out[1]).all() and np.isfinite(lse[1]).all()


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_causal_value_reaches_only_later_rows(value):
    """Within one diagonal block too: a masked pair's weight 0 times NaN must not reach."""
    q, k, v = seeded_qkv((1, 2, 32, 8), (1, 2, 32, 8))
    v = _with(v, (0, 0, 9, 3), value)
    for blocks in ({}, {"block_q": 16, "block_k": 16}, {"block_q": 4, "block_k": 8}):
        out, lse = (np.asarray(x) for x in eqx_flash.causal_flash_attention(q, k, v, **blocks))
        rows = np.isnan(out[0, 0]).any(-1)
        np.testing.assert_array_equal(rows, np.arange(32) >= 9)
        assert np.isfinite(out[0, 1]).all() and np.isfinite(lse).all()


@pytest.mark.parametrize("where", ["k", "v"])
def test_split_k_decoding_lanes(where):
    """One query against many keys runs flash-decoding's lanes; a NaN key past the
    valid length (an unwritten cache slot) reaches nothing, one inside reaches the row."""
    q, k, v = seeded_qkv((2, 4, 1, 16), (2, 2, 512, 16))
    lengths = jnp.array([300, 512])
    clean = flash_attention(q, k, v, kv_lengths=lengths)
    arrays = {"k": k, "v": v}
    arrays[where] = _with(_with(arrays[where], (0, 1, 400), np.nan), (1, 0, 10, 2), np.nan)
    out, lse = flash_attention(q, arrays["k"], arrays["v"], kv_lengths=lengths)
    nan_rows = np.zeros((2, 4, 1), bool)
    nan_rows[1, 0:2] = True  # kv head 0 of batch 1 serves query heads 0 and 1
    _assert_only_rows_nan(out, lse, clean, nan_rows, lse_nan=where == "k")


@pytest.mark.parametrize("masking", ["mask", "attn_mask", "segment_ids", "window"])
def test_masked_positions_reach_nothing(masking):
    q, k, v = seeded_qkv((1, 2, 24, 8), (1, 2, 24, 8))
    key_mask = np.arange(24) != 7
    ids = (np.arange(24) >= 12).astype(np.int32)[None]
    kwargs = {  # NumPy, placed on the device: no eager op to compile
        "mask": {"mask": np.broadcast_to(key_mask, (1, 24))},
        "attn_mask": {"attn_mask": np.broadcast_to(key_mask, (24, 24))},
        "segment_ids": {"q_segment_ids": ids, "kv_segment_ids": ids},
        "window": {"window": (2, 2)},
    }[masking]
    kwargs = {n: jax.device_put(x) if isinstance(x, np.ndarray) else x
              for n, x in kwargs.items()}
    clean = flash_attention(q, k, v, block_q=8, block_k=8, **kwargs)
    broken_v = _with(v, (0, slice(None), 7), np.nan)
    out, lse = flash_attention(q, k, broken_v, block_q=8, block_k=8, **kwargs)
    ref_out, _ = eqx.filter_jit(plain_attention)(q, k, broken_v, **kwargs)
    reaches = {"mask": np.zeros(24, bool), "attn_mask": np.zeros(24, bool),
               "segment_ids": np.arange(24) < 12,
               "window": np.abs(np.arange(24) - 7) <= 2}[masking]
    nan_rows = np.broadcast_to(reaches, (1, 2, 24))
    _assert_only_rows_nan(out, lse, clean, nan_rows, lse_nan=False)
    np.testing.assert_array_equal(np.isnan(ref_out).any(-1), nan_rows)


def test_ring_on_one_device_and_the_module():
    from jax.sharding import Mesh, PartitionSpec

    q, k, v = seeded_qkv((1, 2, 16, 8), (1, 2, 16, 8))
    v = _with(v, (0, 1, 4, 0), np.nan)
    expected = np.zeros((1, 2, 16), bool)
    expected[0, 1, 4:] = True
    seq = PartitionSpec(None, None, "seq")
    mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
    ring = jax.jit(jax.shard_map(  # compiled whole: eagerly, each op of the ring compiles
        lambda q, k, v: eqx_flash.ring_flash_attention(q, k, v, axis_name="seq", causal=True),
        mesh=mesh, in_specs=(seq, seq, seq), out_specs=(seq, seq)))
    module = eqx_flash.FlashAttention(causal=True)
    for out in (ring(q, k, v)[0], module(q[0], k[0], v[0])[None]):
        np.testing.assert_array_equal(np.isnan(np.asarray(out)).any(-1), expected)


# (Fixed cases, values, gradients and tangents: `test_lengths.test_nan_padding_reaches_nothing`.)
@examples(12)
@given(attention_inputs(dtypes=[jnp.float32], max_seq=64, lengths=True),
       st.sampled_from([np.nan, np.inf, -np.inf]))
def test_property_padding_reaches_nothing(inputs, value):
    """NaN or an infinity in every position past the drawn lengths, in q, k and v alike,
    changes no output, no lse and no gradient (over the strategy's masks, causal
    settings, score terms and block sizes)."""
    kw = inputs.kwargs
    q_len = kw.get("q_lengths", inputs.q.shape[-2])
    kv_len = kw.get("kv_lengths", inputs.k.shape[-2])

    def poison(x, length):  # NumPy: it broadcasts the ranks freely
        pad = np.arange(x.shape[-2])[:, None] >= np.asarray(length)[..., None, None, None]
        return jax.device_put(np.where(pad, np.asarray(value, x.dtype), np.asarray(x)))

    poisoned = (poison(inputs.q, q_len), poison(inputs.k, kv_len), poison(inputs.v, kv_len))

    def loss(q, k, v):
        out, lse = flash_attention(q, k, v, **kw)
        return jnp.sum(out * out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    (clean_grads, clean), (dirty_grads, dirty) = grad(inputs.q, inputs.k, inputs.v), grad(*poisoned)
    for c, d in zip(jax.tree.leaves((clean, clean_grads)), jax.tree.leaves((dirty, dirty_grads)),
                    strict=True):
        c, d = np.asarray(c), np.asarray(d)
        np.testing.assert_array_equal(np.isnan(d), np.isnan(c))
        np.testing.assert_array_equal(d, c)


@pytest.mark.parametrize("where", ["v", "dv"])
def test_causal_tangent_reaches_only_later_rows(where):
    """Forward mode (the one-pass kernel): a NaN value or value tangent at key 9 reaches
    the tangents of exactly the rows that attend it, and a NaN tangent leaves the primal
    output finite; in a diagonal block too, for any block size."""
    q, k, v = seeded_qkv((1, 2, 32, 8), (1, 2, 32, 8))
    dv = jax.device_put(np.cos(np.asarray(v)))
    if where == "v":
        v = _with(v, (0, 0, 9, 3), np.nan)
    else:
        dv = _with(dv, (0, 0, 9, 3), np.nan)
    for blocks in ({}, {"block_q": 16, "block_k": 16}, {"block_q": 4, "block_k": 8}):
        attend = functools.partial(eqx_flash.causal_flash_attention, q, k, **blocks)
        (out, lse), (d_out, d_lse) = jax.jvp(attend, (v,), (dv,))
        # `jax.linearize` runs the forward and then the tangent kernel: the same rows.
        linear_d_out = jax.linearize(attend, v)[1](dv)[0]
        for tangent in (np.asarray(d_out), np.asarray(linear_d_out)):
            rows = np.isnan(tangent[0, 0]).any(-1)
            np.testing.assert_array_equal(rows, np.arange(32) >= 9)
            assert np.isfinite(tangent[0, 1]).all()
        assert np.isfinite(d_lse).all() and np.isfinite(lse).all()
        assert np.isfinite(out).all() == (where == "dv")


def test_causal_value_reaches_no_earlier_gradient():
    """Reverse mode: a NaN value at key 9 leaves the gradients of a loss on rows 0-8
    (which never attend it) finite, in a diagonal block too, as `plain_attention`'s."""
    q, k, v = seeded_qkv((1, 2, 32, 8), (1, 2, 32, 8))
    v = _with(v, (0, 0, 9, 3), np.nan)

    def grads(fn, **blocks):  # compiled whole: faster than op by op
        def loss(q, k, v):
            return jnp.sum(fn(q, k, v, causal=True, **blocks)[0][..., :9, :])
        return [np.asarray(g) for g in jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)]

    expected = grads(plain_attention)
    for blocks in ({}, {"block_q": 16, "block_k": 16}, {"block_q": 4, "block_k": 8}):
        got = grads(flash_attention, **blocks)
        for g, want in zip(got, expected, strict=True):
            np.testing.assert_array_equal(np.isnan(g), np.isnan(want))
            finite = ~np.isnan(want)
            assert_close(g[finite], want[finite], kind="grad")
        assert np.isfinite(got[0][0, 0, :9]).all()
