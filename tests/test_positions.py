"""Position ids (`q_positions`/`kv_positions`): causal, the window and ALiBi measured on
absolute positions, against the independent float64 oracle (`helpers.oracle_attention`),
on every single-device entry point (the multi-device ones: `test_ring.py`)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, assert_lse_close, enable_x64, examples, oracle_attention, qkv
from hypothesis import given

import eqx_flash
from eqx_flash._core.config import KernelConfig
from eqx_flash._core.operands import Operands
from eqx_flash._core.options import Window
from eqx_flash._kernels.schedule import band_ranges, position_limits
from eqx_flash.testing import attention_inputs, check_attention

B, H, KH, SQ, SK, D = 2, 4, 2, 37, 45, 8
BLOCKS = dict(block_q=8, block_k=8)


def _positions(pattern: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    if pattern == "offset":  # a chunk of queries 10 tokens into the keys
        q_pos = np.broadcast_to(np.arange(SQ) + 10, (B, SQ))
        kv_pos = np.broadcast_to(np.arange(SK), (B, SK))
    elif pattern == "sorted":
        q_pos = np.sort(rng.integers(0, 60, (B, SQ)), axis=-1)
        kv_pos = np.sort(rng.integers(0, 60, (B, SK)), axis=-1)
    else:  # unsorted: blocks hold scattered positions
        q_pos, kv_pos = rng.integers(0, 60, (B, SQ)), rng.integers(0, 60, (B, SK))
    return jnp.asarray(q_pos, jnp.int32), jnp.asarray(kv_pos, jnp.int32)


def _inputs(seed=0, dtype=jnp.float32):
    return qkv(seed, (B, H, SQ, D), (B, KH, SK, D), dtype=dtype)


CASES = {
    "causal": dict(causal=True),
    "window": dict(window=(5, 3)),
    "left_only": dict(window=(7, None)),
    "causal_alibi_softcap": dict(causal=True, alibi=True, softcap=3.0),
    "window_mask_segments": dict(window=(9, 0), mask=True, segments=True),
    "causal_lengths": dict(causal=True, lengths=True),
    "alibi_only": dict(alibi=True),
}


def _call_arguments(case: dict, q_pos, kv_pos, seed=1, dtype=jnp.float32):
    """The keywords of one case, for `flash_attention` and the oracle alike."""
    rng = np.random.default_rng(seed)
    kwargs: dict = dict(q_positions=q_pos, kv_positions=kv_pos)
    for name in ("causal", "window", "softcap"):
        if name in case:
            kwargs[name] = case[name]
    if case.get("alibi"):
        kwargs["alibi_slopes"] = jnp.asarray(0.3 * rng.random(H), dtype)
    if case.get("mask"):
        mask = rng.random((B, SK)) > 0.3
        mask[1, :] = False  # batch element 1 attends nothing
        kwargs["mask"] = jnp.asarray(mask)
    if case.get("segments"):
        kwargs["q_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (B, SQ)), axis=-1),
                                              jnp.int32)
        kwargs["kv_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (B, SK)), axis=-1),
                                               jnp.int32)
    if case.get("lengths"):
        kwargs.update(q_lengths=jnp.array([SQ, 20]), kv_lengths=jnp.array([30, SK]))
    return kwargs


# At the default block sizes too (one block here): every window and option but `causal`
# and `alibi_only`, whose options run there within `causal_alibi_softcap` and
# `causal_lengths` (ALiBi is elementwise: no block is skipped for it).
DEFAULT_BLOCKS = ("window", "left_only", "causal_alibi_softcap", "window_mask_segments",
                  "causal_lengths")


@pytest.mark.parametrize("pattern", ["offset", "sorted", "unsorted"])
@pytest.mark.parametrize("name", list(CASES))
def test_values_and_lse_match_the_independent_reference(name, pattern):
    q, k, v = _inputs()
    q_pos, kv_pos = _positions(pattern)
    ours = _call_arguments(CASES[name], q_pos, kv_pos)
    expected_out, expected_lse, _ = oracle_attention(q, k, v, **ours)
    calls = [(eqx_flash.flash_attention, BLOCKS), (eqx_flash.plain_attention, {})]
    if name in DEFAULT_BLOCKS:
        calls.append((eqx_flash.flash_attention, {}))
    for fn, blocks in calls:
        out, lse = fn(q, k, v, **ours, **blocks)
        assert_close(out, expected_out)
        assert_lse_close(lse, expected_lse)


# Three of `CASES` in two programs: `causal_lengths` joins `causal_alibi_softcap`.
GRADIENT_CASES = {
    "causal_alibi_softcap_lengths": dict(CASES["causal_alibi_softcap"], lengths=True),
    "window_mask_segments": CASES["window_mask_segments"],
}


@pytest.mark.parametrize("name", list(GRADIENT_CASES))
def test_gradients_and_tangents_in_float64(name):
    """Gradients of q, k, v and the ALiBi slopes, and tangents, against the reference's
    own derivatives, in float64 (unsorted positions: skipped and masked blocks mixed)."""
    with enable_x64():
        q, k, v = (x.astype(jnp.float64) for x in _inputs(2))
        q_pos, kv_pos = _positions("unsorted", 3)
        ours = _call_arguments(GRADIENT_CASES[name], q_pos, kv_pos, dtype=jnp.float64)
        rng = np.random.default_rng(4)
        w = jnp.asarray(rng.standard_normal((B, H, SQ, D)))
        u = jnp.asarray(rng.standard_normal((B, H, SQ)))
        slopes = ours.pop("alibi_slopes", None)

        def ours_fn(q, k, v, slopes):
            return eqx_flash.flash_attention(q, k, v, alibi_slopes=slopes, **ours, **BLOCKS)

        def theirs_fn(q, k, v, slopes):
            return oracle_attention(q, k, v, alibi_slopes=slopes, **ours, xp=jnp)[:2]

        def loss(fn):
            def f(*args):
                out, lse = fn(*args)
                return jnp.sum(out * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse * u, 0.0))
            return f

        argnums = (0, 1, 2, 3) if slopes is not None else (0, 1, 2)
        args = (q, k, v, slopes)
        tangents = tuple(jnp.asarray(rng.standard_normal(x.shape)) for x in (q, k, v))

        @jax.jit
        def derivatives(args, tangents):  # each side compiled whole, gradients and tangents
            return (jax.grad(loss(ours_fn), argnums=argnums)(*args),
                    jax.jvp(lambda q, k, v: ours_fn(q, k, v, args[3]), args[:3], tangents)[1],
                    jax.grad(loss(theirs_fn), argnums=argnums)(*args),
                    jax.jvp(lambda q, k, v: theirs_fn(q, k, v, args[3]), args[:3], tangents)[1])

        got, got_tangents, expected, expected_tangents = jax.tree.map(
            np.asarray, derivatives(args, tangents))
        for g, e in zip(got, expected, strict=True):
            assert g.shape == e.shape and g.dtype == e.dtype
            np.testing.assert_allclose(g, e, rtol=1e-9, atol=1e-11)
        for g, e in zip(got_tangents, expected_tangents, strict=True):
            np.testing.assert_allclose(np.where(np.isfinite(e), g, 0.0),
                                       np.where(np.isfinite(e), e, 0.0), rtol=1e-9, atol=1e-11)


def test_indices_as_positions_are_the_index_masks():
    """Positions equal to the bottom-right aligned indices give `causal=True`, a window
    and ALiBi on indices (the float64 oracle on indices), with positions per batch element
    and `(1, seq)` broadcast over the batch."""
    q, k, v = _inputs(5)
    q_pos = np.arange(SQ, dtype=np.int32)[None] + (SK - SQ)
    kv_pos = np.arange(SK, dtype=np.int32)[None]
    per_batch = (np.repeat(q_pos, B, axis=0), np.repeat(kv_pos, B, axis=0))
    slopes = np.linspace(0.1, 0.4, H, dtype=np.float32)
    # (The first two programs are those of `CASES`' causal and window.)
    for options, (qp, kp) in ((dict(causal=True), per_batch), (dict(window=(5, 3)), per_batch),
                              (dict(causal=True, alibi_slopes=slopes), (q_pos, kv_pos))):
        expected = oracle_attention(q, k, v, **options)
        got = eqx_flash.flash_attention(q, k, v, q_positions=qp, kv_positions=kp, **options,
                                        **BLOCKS)
        assert_close(got[0], expected[0])
        assert_lse_close(got[1], expected[1])


def test_packed_documents_equal_per_document_attention():
    """Three documents packed in one row, positions restarting at each, causal + ALiBi
    on positions + segment ids: each document's rows equal attention on it alone (the
    float64 oracle on that document)."""
    seq, lengths = 48, (13, 20, 15)
    q, k, v = qkv(6, (1, H, seq, D), (1, KH, seq, D))
    ids = np.repeat(np.arange(3), lengths).astype(np.int32)[None]
    positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)[None]
    slopes = np.linspace(0.1, 0.4, H, dtype=np.float32)
    out, lse = eqx_flash.flash_attention(
        q, k, v, causal=True, alibi_slopes=slopes, q_segment_ids=ids, kv_segment_ids=ids,
        q_positions=positions, kv_positions=positions, **BLOCKS)
    q, k, v, out, lse = (np.asarray(x) for x in (q, k, v, out, lse))
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        alone = oracle_attention(q[..., part, :], k[..., part, :], v[..., part, :],
                                 causal=True, alibi_slopes=slopes)
        assert_close(out[..., part, :], alone[0])
        assert_lse_close(lse[..., part], alone[1])
        start += n


def test_rows_with_nothing_to_attend_are_zero_with_finite_gradients():
    """Causal on positions where some queries precede every key: out 0, lse -inf, zero
    finite gradients."""
    q, k, v = _inputs(7)
    q_pos = np.broadcast_to(np.arange(SQ, dtype=np.int32) - 10, (B, SQ))
    kv_pos = np.broadcast_to(np.arange(SK, dtype=np.int32), (B, SK))

    def loss(q, k, v):
        out, lse = eqx_flash.flash_attention(q, k, v, causal=True, q_positions=q_pos,
                                             kv_positions=kv_pos, **BLOCKS)
        return jnp.sum(out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), (out, lse)

    grads, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    (dq, dk, dv), out, lse = jax.tree.map(np.asarray, (grads, out, lse))
    np.testing.assert_array_equal(out[..., :10, :], 0.0)
    assert np.all(np.isneginf(lse[..., :10]))
    assert np.all(np.isfinite(lse[..., 10:]))
    assert all(np.all(np.isfinite(g)) for g in (dq, dk, dv))
    np.testing.assert_array_equal(dq[..., :10, :], 0.0)


def test_causal_positions_visit_the_blocks_causal_visits():
    """The run-time limits of causal on `arange` positions are the static causal band:
    the same key blocks visited, the same ones whole (so no more work than `causal=True`);
    a block out of reach by position is never visited."""
    seq, block = 64, 16
    index = jnp.asarray(np.arange(seq, dtype=np.int32))
    ops = Operands(q_positions=index.reshape(1, seq, 1), kv_positions=index.reshape(1, 1, seq))
    causal = KernelConfig(seq, seq, block, block, Window(None, 0), scale=1.0)
    on_positions = KernelConfig(seq, seq, block, block, Window(None, 0), scale=1.0,
                                positions=True)
    limits_of = jax.jit(position_limits, static_argnums=(0, 2))  # one program, not op by op
    for by in ("q", "k"):
        bands = band_ranges(causal, by=by)
        limits = limits_of(on_positions, ops, by)
        assert limits is not None
        lo, hi, full_lo, full_hi = (np.asarray(x) for x in limits)
        np.testing.assert_array_equal(lo, bands.lo)
        np.testing.assert_array_equal(hi, bands.hi)
        for o in range(len(lo)):  # the same whole blocks (an empty run may sit anywhere)
            assert (set(range(full_lo[o], full_hi[o]))
                    == set(range(bands.full_lo[o], bands.full_hi[o]))), (by, o)


def test_score_mod_receives_indices_and_can_capture_positions():
    """`score_mod` sees indices; closing over the positions gives a bias on them."""
    q, k, v = _inputs(8)
    q_pos, kv_pos = _positions("sorted", 9)

    def on_positions(s, b, h, i, j):
        return s - 0.2 * jnp.abs(q_pos[b, i] - kv_pos[b, j]).astype(s.dtype)

    got = eqx_flash.flash_attention(q, k, v, causal=True, q_positions=q_pos,
                                    kv_positions=kv_pos, score_mod=on_positions, **BLOCKS)
    expected = oracle_attention(q, k, v, causal=True, q_positions=q_pos, kv_positions=kv_pos,
                                alibi_slopes=np.full((H,), 0.2))  # ALiBi on the positions
    assert_close(got[0], expected[0])
    assert_lse_close(got[1], expected[1])


def test_split_k_decoding_on_positions():
    """A few queries against a long cache (the split-K kernel) with a window on
    positions."""
    q, k, v = qkv(10, (1, H, 3, D), (1, KH, 512, D))
    q_pos = jnp.asarray([[300, 301, 302]], jnp.int32)
    kv_pos = jnp.arange(512, dtype=jnp.int32)[None]
    out, lse = eqx_flash.flash_attention(q, k, v, window=(100, 0), q_positions=q_pos,
                                         kv_positions=kv_pos, block_k=32)
    expected_out, expected_lse, _ = oracle_attention(q, k, v, window=(100, 0), q_positions=q_pos,
                                                     kv_positions=kv_pos)
    assert_close(out, expected_out)
    assert_lse_close(lse, expected_lse)


def test_modules_take_positions_per_call():
    q, k, v = (np.asarray(x)[:1] for x in _inputs(11))
    q_pos, kv_pos = (np.asarray(x)[:1] for x in _positions("offset"))
    layer = eqx_flash.FlashAttention(causal=True, **BLOCKS)
    expected = oracle_attention(q, k, v, causal=True, q_positions=q_pos, kv_positions=kv_pos)[0]
    q1, k1, v1, qp1, kp1 = (jnp.asarray(x[0]) for x in (q, k, v, q_pos, kv_pos))
    got = layer(q1, k1, v1, q_positions=qp1, kv_positions=kp1)
    assert_close(got, expected[0])
    mha = eqx_flash.FlashMultiheadAttention(H, 16, num_kv_heads=KH, causal=True,
                                            key=jax.random.key(0))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 24, 16)), jnp.float32)
    positions = np.broadcast_to(np.r_[np.arange(10), np.arange(14)].astype(np.int32), (2, 24))
    ids = np.repeat(np.arange(2), [10, 14])
    same_doc = jnp.asarray(ids[:, None] == ids[None, :])
    parts = (slice(0, 10), slice(10, 24))

    @eqx.filter_jit  # every call below in one program
    def calls(mha, x, positions):
        packed = jax.vmap(lambda x, p: mha(x, x, x, same_doc, q_positions=p, kv_positions=p))(
            x, positions)
        alone = [jax.vmap(lambda x, part=part: mha(x[part], x[part], x[part]))(x)
                 for part in parts]
        # Positions alone (no document mask): causal on positions is the mask `p_k <= p_q`.
        on_positions = jax.vmap(lambda x, p: mha(x, x, x, q_positions=p, kv_positions=p))(
            x, positions)
        # (Equal positions lift the layer's causal mask, leaving the mask alone.)
        zeros = jnp.zeros(24, jnp.int32)
        by_mask = jax.vmap(lambda x, p: mha(x, x, x, p[None, :] <= p[:, None],
                                            q_positions=zeros, kv_positions=zeros))(x, positions)
        return packed, alone, on_positions, by_mask

    packed, alone, on_positions, by_mask = jax.tree.map(np.asarray, calls(mha, x, positions))
    for part, each in zip(parts, alone, strict=True):  # each document as if alone
        assert_close(packed[:, part], each)
    assert_close(on_positions, by_mask)


def test_positions_check_through_gradients_and_second_order():
    """`check_attention` with gradients and second order (HVP) on positions (the tangents:
    `test_gradients_and_tangents_in_float64`, and in float32 the property below)."""
    inputs = eqx_flash.testing.AttentionInputs(*_inputs(12), dict(
        causal=True, q_positions=_positions("unsorted")[0],
        kv_positions=_positions("unsorted")[1],
        alibi_slopes=jnp.asarray(np.linspace(0.1, 0.3, H), jnp.float32), **BLOCKS))
    check_attention(eqx_flash.flash_attention, inputs, second_order=True)


@examples(12)
@given(attention_inputs(positions=True, dtypes=[jnp.float32], alibi=None, lengths=None,
                        sinks=None, segment_ids=None))
def test_property_against_the_reference(inputs):
    check_attention(eqx_flash.flash_attention, inputs, jvp=True)


@pytest.mark.parametrize("kwargs, match", [
    (dict(q_positions=jnp.zeros((B, SQ), jnp.int32)), "kv_positions"),
    (dict(kv_positions=jnp.zeros((B, SK), jnp.int32)), "q_positions"),
    (dict(q_positions=jnp.zeros((B, SQ)), kv_positions=jnp.zeros((B, SK), jnp.int32)),
     "q_positions"),
    (dict(q_positions=jnp.zeros((B, SQ + 1), jnp.int32),
          kv_positions=jnp.zeros((B, SK), jnp.int32)), "q_positions"),
    (dict(q_positions=jnp.zeros((B, SQ), jnp.int32),
          kv_positions=jnp.zeros((3, SK), jnp.int32)), "kv_positions"),
])
def test_bad_positions_name_the_argument(kwargs, match):
    q, k, v = _inputs()
    for fn in (eqx_flash.flash_attention, eqx_flash.plain_attention):
        with pytest.raises((TypeError, ValueError), match=match):
            fn(q, k, v, causal=True, **kwargs)


def test_positions_under_jit_and_vmap():
    q, k, v = _inputs(13)
    q_pos, kv_pos = _positions("sorted", 14)

    def one(q, k, v, qp, kp):
        return eqx_flash.flash_attention(q, k, v, causal=True, q_positions=qp,
                                         kv_positions=kp, **BLOCKS)

    batched = jax.jit(jax.vmap(one))(q, k, v, q_pos, kv_pos)
    direct = one(q, k, v, q_pos, kv_pos)
    assert_close(batched[0], direct[0])
    assert eqx.filter_jit(one)(q, k, v, q_pos, kv_pos)[0].shape == direct[0].shape


INT32_MAX, INT32_MIN = 2**31 - 1, -(2**31)


def _wide_reference(q, k, v, q_pos, kv_pos, *, left=None, right=None, slopes=None):
    """Float64 NumPy attention on positions of any size (float64 holds every int32 and
    their differences exactly): the window and ALiBi of `flash_attention`, no int32
    arithmetic anywhere. `q_pos`, `kv_pos` `(seq,)`, shared by the batch."""
    groups = q.shape[1] // k.shape[1]
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    s = np.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(q.shape[-1])
    rel = np.asarray(kv_pos, np.float64)[None, :] - np.asarray(q_pos, np.float64)[:, None]
    if slopes is not None:
        s = s - np.asarray(slopes, np.float64)[None, :, None, None] * np.abs(rel)
    allowed = np.ones(rel.shape, bool)
    if left is not None:
        allowed &= rel >= -left
    if right is not None:
        allowed &= rel <= right
    s = np.where(allowed, s, -np.inf)
    top = np.max(s, axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.exp(s - top)
    total = e.sum(-1)
    out = np.einsum("bhqk,bhkd->bhqd", e / np.where(total > 0, total, 1.0)[..., None], v)
    with np.errstate(divide="ignore"):
        return out, np.where(total > 0, np.log(total) + top[..., 0], -np.inf)


EXTREME_POSITIONS = {
    # A window at the top of int32: `q_pos + right` passed INT32_MAX and wrapped round,
    # every row came back empty.
    "top_window": (np.arange(SQ) + INT32_MAX - SQ + 1, np.arange(SK) + INT32_MAX - SK + 1,
                   dict(window=(4, 2))),
    "bottom_window": (np.arange(SQ) + INT32_MIN, np.arange(SK) + INT32_MIN,
                      dict(window=(3, 5))),
    "top_causal_window": (np.arange(SQ) + INT32_MAX - SQ + 1,
                          np.arange(SK) + INT32_MAX - SK + 1, dict(causal=True, window=(6, 0))),
    # Positions at both ends of int32: distances past int32 (ALiBi, a window of 3e9).
    "both_ends_alibi": (np.where(np.arange(SQ) % 2 == 0, INT32_MAX - np.arange(SQ),
                                 INT32_MIN + np.arange(SQ)),
                        np.where(np.arange(SK) % 3 == 0, INT32_MAX - np.arange(SK),
                                 INT32_MIN + np.arange(SK)),
                        dict(alibi_slopes=np.array([1e-9, 2e-9, 0.5, 1e-10]))),
    "both_ends_wide_window": (np.where(np.arange(SQ) % 2 == 0, INT32_MAX - np.arange(SQ),
                                       INT32_MIN + np.arange(SQ)),
                              np.where(np.arange(SK) % 3 == 0, INT32_MAX - np.arange(SK),
                                       INT32_MIN + np.arange(SK)),
                              dict(window=(3_000_000_000, 10))),
}


@pytest.mark.parametrize("name", list(EXTREME_POSITIONS))
def test_positions_at_the_int32_limits(name):
    """int32 positions within a window of INT32_MAX/MIN, and pairs further apart than
    int32 holds: the window and ALiBi exact (no wrap round), the kernels (small blocks:
    the run-time block limits too) and `plain_attention` against the float64 reference
    (#41)."""
    q, k, v = _inputs(20)
    q_pos, kv_pos, options = EXTREME_POSITIONS[name]
    window = options.get("window", (None, None))
    left, right = window
    if options.get("causal"):
        right = 0
    slopes = options.get("alibi_slopes")
    expected_out, expected_lse = _wide_reference(q, k, v, q_pos, kv_pos, left=left,
                                                 right=right, slopes=slopes)
    assert np.isfinite(expected_lse).any()
    kw = dict(options, q_positions=np.asarray(q_pos, np.int32),
              kv_positions=np.asarray(kv_pos, np.int32))
    if slopes is not None:
        kw["alibi_slopes"] = jnp.asarray(slopes, jnp.float32)
    for fn, blocks in ((eqx_flash.flash_attention, BLOCKS), (eqx_flash.plain_attention, {})):
        out, lse = fn(q, k, v, **kw, **blocks)
        assert_close(out, expected_out, name=fn.__name__)
        assert_lse_close(lse, expected_lse)


def test_windows_past_int32_are_what_they_say():
    """A window side of 2^31 or more (past int32) on indices and on positions: the
    attention it describes, not an OverflowError (a side of 2^32 - 1 or more reaches
    everything: unbounded) (#41)."""
    q, k, v = _inputs(21)
    lengths = dict(q_lengths=jnp.array([SQ, 20]), kv_lengths=jnp.array([SK, 30]))
    for window, same_as, extra in (((2**31, 2**40), None, {}), ((None, 2**31 - 1), None, {}),
                                   ((2**31 + 7, 0), (None, 0), {}),
                                   ((2**31 + 7, 2**31), None, lengths)):
        expected = eqx_flash.plain_attention(q, k, v, window=same_as, **extra)
        for fn in (eqx_flash.flash_attention, eqx_flash.plain_attention):
            out, lse = fn(q, k, v, window=window, **extra)
            assert_close(out, expected[0], name=f"{fn.__name__} window={window}")
            assert_lse_close(lse, expected[1])
    with pytest.raises(ValueError, match="window must be"):
        eqx_flash.flash_attention(q, k, v, window=(-1, 3))


@pytest.mark.parametrize("dtype", [np.int64, np.uint32, np.uint64])
def test_positions_and_ids_past_int32_are_refused_not_wrapped(dtype):
    """Positions (and segment ids, and lengths) of a dtype wider than int32: concrete
    values that fit are taken, values that do not raise a `ValueError` naming the
    argument (they were cast with a silent wrap round, #41), and traced ones, which
    cannot be checked, a `TypeError` saying to pass int32."""
    q, k, v = _inputs(22)
    fits = np.arange(SK).astype(dtype)
    expected = eqx_flash.flash_attention(q, k, v, causal=True, q_positions=fits[-SQ:],
                                         kv_positions=np.arange(SK, dtype=np.int32))
    got = eqx_flash.flash_attention(q, k, v, causal=True, q_positions=fits[-SQ:],
                                    kv_positions=fits)
    assert_close(got[0], expected[0])
    past = fits + np.asarray(2**31, dtype)
    for fn in (eqx_flash.flash_attention, eqx_flash.plain_attention):
        with pytest.raises(ValueError, match=r"kv_positions must fit int32.*got values from "
                                             r"2147483648 to 2147483692"):
            fn(q, k, v, causal=True, q_positions=fits[-SQ:], kv_positions=past)
        with pytest.raises(ValueError, match="q_segment_ids must fit int32"):
            fn(q, k, v, q_segment_ids=past[-SQ:], kv_segment_ids=fits)
    too_long = 2**32 + 5 if np.iinfo(dtype).bits == 64 else 2**31 + 5  # (wrapped to 5)
    with pytest.raises(ValueError, match=r"kv_lengths must lie in \[0, 45\]"):
        eqx_flash.flash_attention(q, k, v, kv_lengths=np.array([too_long, 7], dtype))
    if dtype == np.uint32:  # (a traced int64/uint64 array needs jax_enable_x64)
        with pytest.raises(TypeError, match="kv_positions has dtype uint32.*traced.*int32"):
            jax.jit(lambda p: eqx_flash.flash_attention(
                q, k, v, q_positions=fits[-SQ:].astype(np.int32), kv_positions=p))(
                jnp.asarray(fits))
