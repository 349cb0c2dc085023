"""Hypothesis properties of `flash_attention`, each over `eqx_flash.testing.attention_inputs`.

Compilation dominates the cost (each drawn configuration is a new program), so the main
property gets the profile's full example count and the others a share of it.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from eqx_flash import flash_attention
from eqx_flash.testing import TOLERANCES, AttentionInputs, attention_inputs, check_attention

DTYPES = None  # all: float32, bfloat16, float16 (and float64 under jax_enable_x64)


def problems(**restrictions):
    return attention_inputs(**{"dtypes": DTYPES, **restrictions})


def share(fraction: float, floor: int = 3) -> settings:
    """The active profile with `fraction` of its examples (at least `floor`: 2 for the
    properties that fixed cases elsewhere check too)."""
    return settings(max_examples=max(floor, math.ceil(settings().max_examples * fraction)))


def with_kwargs(inputs: AttentionInputs, **changes) -> AttentionInputs:
    kwargs = {**inputs.kwargs, **changes}
    return dataclasses.replace(inputs, kwargs={n: x for n, x in kwargs.items() if x is not None})


def lead_of(inputs: AttentionInputs) -> tuple[int, ...]:
    return inputs.q.shape[:-2]


@functools.partial(jax.jit, static_argnames=("static",))
def _linear_grads(q, k, v, arrays, w, u, *, static):
    def call(q, k, v):
        return flash_attention(q, k, v, **arrays, **dict(static))

    (out, lse), vjp = jax.vjp(call, q, k, v)
    d_lse = jnp.where(jnp.isfinite(lse), u, 0.0).astype(lse.dtype)
    return out, lse, vjp((w.astype(out.dtype), d_lse))


def linear_grads(inputs: AttentionInputs, seed: int = 0):
    """`out`, `lse` and the gradients of a random linear function of them (finite lse),
    in one compiled program that problems of the same shapes share."""
    arrays, static = split_static(inputs)
    rng = np.random.default_rng(seed)
    lse_shape = inputs.q.shape[:-1]
    w = jax.device_put(rng.standard_normal((*lse_shape, inputs.v.shape[-1]), np.float32))
    u = jax.device_put(rng.standard_normal(lse_shape, np.float32))
    static = tuple(static.items())
    return _linear_grads(inputs.q, inputs.k, inputs.v, arrays, w, u, static=static)


def split_static(inputs: AttentionInputs):
    arrays = {n: x for n, x in inputs.kwargs.items() if isinstance(x, jax.Array)}
    static = {n: x for n, x in inputs.kwargs.items() if n not in arrays}
    return arrays, static


@given(problems())
def test_matches_reference(inputs):
    check_attention(flash_attention, inputs)


# (Lengths with causal, windows, key masks and GQA against the reference: `test_lengths`;
# with every feature, values and gradients: `test_nonfinite`'s padding property.)
@share(0.3, floor=2)
@given(problems(lengths=True))
def test_matches_reference_with_lengths(inputs):
    """Variable lengths composed with every other feature (masks, ids, causal, window,
    GQA, dtypes), values and gradients."""
    check_attention(flash_attention, inputs)


# (Block sizes against the reference: `test_against_reference.test_matches_reference`.)
@share(0.2, floor=2)
@given(problems(), st.sampled_from([8, 16, 32, None]), st.sampled_from([8, 16, None]))
def test_independent_of_block_sizes(inputs, block_q, block_k):
    def reblocked(q, k, v, **kwargs):
        return flash_attention(q, k, v, **{**kwargs, "block_q": block_q, "block_k": block_k})

    check_attention(flash_attention, inputs, reference=reblocked, grads=False)


# (Masked keys reach nothing, fixed cases: `test_nonfinite.test_masked_positions_reach_nothing`,
# `test_semantics.test_fully_masked_rows_give_zero_and_neg_inf`.)
@share(0.2, floor=2)
@given(problems(mask=True), st.integers(0, 2**31 - 1))
def test_masked_keys_do_not_matter(inputs, seed):
    # In NumPy: eager jax ops would each compile a program for every new shape.
    heads, kv_heads = inputs.q.shape[-3], inputs.k.shape[-3]
    mask = np.asarray(inputs.kwargs["mask"]) != 0
    if mask.ndim == inputs.q.ndim - 2:  # no heads axis: shared by all heads
        mask = mask[..., None, :]
    mask = np.broadcast_to(mask, (*lead_of(inputs), mask.shape[-1]))
    grouped = mask.reshape(*mask.shape[:-2], kv_heads, heads // kv_heads, mask.shape[-1])
    dead = ~grouped.any(axis=-2)[..., None]  # keys that no query head of the group sees

    rng = np.random.default_rng(seed)

    def noisy(x):
        noise = (10 * rng.standard_normal(x.shape)).astype(x.dtype)
        return jax.device_put(np.where(dead, noise, np.asarray(x)))

    changed = dataclasses.replace(inputs, k=noisy(inputs.k), v=noisy(inputs.v))
    out, lse, (_, dk, dv) = linear_grads(inputs)
    out2, lse2, _ = linear_grads(changed)  # same shapes: the same compiled program
    np.testing.assert_array_equal(np.asarray(out2, np.float32), np.asarray(out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))
    assert not np.any(np.where(dead, np.asarray(dk, np.float32), 0) != 0), (
        "dk is non-zero at masked keys")
    assert not np.any(np.where(dead, np.asarray(dv, np.float32), 0) != 0), (
        "dv is non-zero at masked keys")


@share(0.2)
@given(
    problems(mask=False, attn_mask=False, segment_ids=False),
    st.sampled_from(["mask", "attn_mask", "segment_ids"]),
)
def test_trivial_masks_change_nothing(inputs, which):
    lead, seq_q, seq_k = lead_of(inputs), inputs.q.shape[-2], inputs.k.shape[-2]
    if which == "mask":  # (NumPy, placed on the device: no eager op to compile)
        extra = dict(mask=np.ones((*lead, seq_k), bool))
    elif which == "attn_mask":
        extra = dict(attn_mask=np.ones((seq_q, seq_k), bool))
    else:
        extra = dict(
            q_segment_ids=np.full((*lead[:-1], seq_q), 3, np.int32),
            kv_segment_ids=np.full((*lead[:-1], seq_k), 3, np.int32),
        )
    extra = jax.device_put(extra)

    def without_extra(q, k, v, **kwargs):
        return flash_attention(q, k, v, **{n: x for n, x in kwargs.items() if n not in extra})

    masked = with_kwargs(inputs, **extra)
    check_attention(flash_attention, masked, reference=without_extra, grads=False)


# (Bottom-right causal against the reference: `test_against_reference`'s causal cases.)
@share(0.2, floor=2)
@given(
    problems(causal=False, window=False, attn_mask=False),
    st.sampled_from(["tril", "window"]),
)
def test_causal_is_bottom_right_tril_and_a_window(inputs, form):
    seq_q, seq_k = inputs.q.shape[-2], inputs.k.shape[-2]
    if form == "tril":
        same = dict(attn_mask=jax.device_put(np.tri(seq_q, seq_k, seq_k - seq_q, dtype=bool)))
    else:
        same = dict(window=(None, 0))

    def equivalent(q, k, v, **kwargs):
        return flash_attention(q, k, v, **{**kwargs, "causal": False, **same})

    causal = with_kwargs(inputs, causal=True)
    check_attention(flash_attention, causal, reference=equivalent, grads=False)


# (GQA against the reference: `test_against_reference`'s "everything", "mqa-4-to-1".)
@share(0.2, floor=2)
@given(problems(heads=[(2, 1), (4, 2), (4, 1)]))
def test_gqa_equals_mha_with_repeated_kv(inputs):
    groups = inputs.q.shape[-3] // inputs.k.shape[-3]

    def repeated(q, k, v, **kwargs):
        k, v = jnp.repeat(k, groups, axis=-3), jnp.repeat(v, groups, axis=-3)
        return flash_attention(q, k, v, **kwargs)

    check_attention(flash_attention, inputs, reference=repeated)


@share(0.2)
@given(problems(causal=False, window=False), st.integers(0, 2**31 - 1))
def test_permuting_keys_and_values_together_changes_nothing(inputs, seed):
    perm = jax.device_put(np.random.default_rng(seed).permutation(inputs.k.shape[-2]))
    key_axis_last = ("mask", "attn_mask", "kv_segment_ids")

    def permuted(q, k, v, **kwargs):
        for name in key_axis_last:
            if name in kwargs and kwargs[name].shape[-1] != 1:
                kwargs[name] = jnp.take(kwargs[name], perm, axis=-1)
        k, v = jnp.take(k, perm, axis=-2), jnp.take(v, perm, axis=-2)
        return flash_attention(q, k, v, **kwargs)

    check_attention(flash_attention, inputs, reference=permuted, grads=False)


def assert_same(got, expected, inputs: AttentionInputs):
    atol, rtol = TOLERANCES[jnp.dtype(inputs.q.dtype)].out
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(
            np.asarray(g, np.float64), np.asarray(e, np.float64), atol=atol, rtol=rtol
        )


def assert_convex_combinations(out, lse, inputs: AttentionInputs):
    """Every output row lies between the least and the greatest value of its kv head, and
    a row with no key to attend is zero."""
    heads, kv_heads = inputs.q.shape[-3], inputs.k.shape[-3]
    lead, seq_q, dim_v = lead_of(inputs), out.shape[-2], out.shape[-1]
    v = np.asarray(inputs.v, np.float64)
    grouped = np.asarray(out, np.float64).reshape(
        *lead[:-1], kv_heads, heads // kv_heads, seq_q, dim_v
    )
    low, high = (f(v, axis=-2)[..., None, None, :] for f in (np.min, np.max))
    atol, rtol = TOLERANCES[jnp.dtype(inputs.q.dtype)].out
    margin = atol + rtol * np.maximum(np.abs(low), np.abs(high))
    empty = np.isneginf(np.asarray(lse)).reshape(*grouped.shape[:-1])[..., None]
    assert np.all(empty | (grouped >= low - margin)), "an output is below every value"
    assert np.all(empty | (grouped <= high + margin)), "an output is above every value"
    assert np.all(~empty | (grouped == 0)), "a row with no key to attend is not zero"


@share(0.2)
@given(problems())
def test_vmap_and_jit_equal_separate_eager_calls_whose_rows_are_convex_combinations(inputs):
    """vmap over two problems equals two eager calls, and so does `jax.jit` of one call
    (`test_transforms.test_jit_equals_eager` checks a fixed float32 case at 1e-6); the
    rows of the eager call are convex combinations of the values (one problem for both:
    the same compiled programs)."""
    arrays, static = split_static(inputs)

    def call(q, k, v, arrays):
        return flash_attention(q, k, v, **arrays, **static)

    # A second problem of the same shapes: reversed queries and values, negated keys.
    # (Made in NumPy: eager jax ops would each compile a program for every new shape.)
    q, k, v = (np.asarray(x) for x in (inputs.q, inputs.k, inputs.v))
    second = jax.device_put((q[..., ::-1, :], -k, v[..., ::-1, :], arrays))
    first = (inputs.q, inputs.k, inputs.v, arrays)
    stacked = jax.tree.map(lambda a, b: jax.device_put(np.stack([a, b])), first, second)
    batched = jax.vmap(call)(*stacked)
    eager = [call(*problem) for problem in (first, second)]
    for i in range(2):
        assert_same([np.asarray(x)[i] for x in batched], eager[i], inputs)
    assert_same(jax.jit(call)(*first), eager[0], inputs)
    assert_convex_combinations(*eager[0], inputs)
