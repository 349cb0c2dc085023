"""`score_mod`, `mask_mod` and `block_mask` (`make_block_mask`): values, lse and gradients
(q, k, v and the score_mod's arrays) against `plain_attention` and a hand-written jnp
reference; causal and softcap written as modifications equal the built-in options (the
causal one computing exactly the same blocks); clear errors naming the argument."""

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_close,
    examples,
    seeded_linear_loss,
    seeded_normal,
    seeded_qkv,
    values_and_grads,
)
from hypothesis import given

import eqx_flash
from eqx_flash import (
    ALiBi,
    RelativePositionBias,
    causal_flash_attention,
    flash_attention,
    make_block_mask,
    plain_attention,
)
from eqx_flash._mods.position_bias import relative_position_bucket
from eqx_flash.testing import attention_inputs, check_attention

B, H, KH, SQ, SK, D = 2, 4, 2, 40, 56, 16
BLOCKS = dict(block_q=16, block_k=24)  # several blocks, neither length a multiple
OFFSET = SK - SQ


def _qkv(heads=H, kv_heads=KH, seq_q=SQ, seq_k=SK):
    return seeded_qkv((B, heads, seq_q, D), (B, kv_heads, seq_k, D))


def _flash(*args, **kwargs):
    return flash_attention(*args, **BLOCKS, **kwargs)


def _values_and_grads(fn, q, k, v, params, make_kwargs):
    """out, lse and gradients w.r.t. q, k, v and `params` (what `make_kwargs(params)`
    closes over) of `seeded_linear_loss`."""
    return values_and_grads(lambda q, k, v, p: fn(q, k, v, **make_kwargs(p)), q, k, v, params)


def _assert_all_close(got, expected, atol=2e-5, rtol=2e-5):
    (out, lse), grads = got
    (ref_out, ref_lse), ref_grads = expected
    np.testing.assert_allclose(out, ref_out, atol=atol, rtol=rtol)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(ref_lse)[finite],
                               atol=atol, rtol=rtol)
    grads, ref_grads = jax.tree.leaves(grads), jax.tree.leaves(ref_grads)
    assert len(grads) == len(ref_grads)
    for name, g, e in zip(("dq", "dk", "dv", "dparams"), grads, ref_grads, strict=False):
        assert g.shape == e.shape and g.dtype == e.dtype, name
        assert np.all(np.isfinite(g)), name
        scale = max(float(np.max(np.abs(e))), 1.0)
        np.testing.assert_allclose(g, e, atol=1e-4 * scale, rtol=1e-4, err_msg=name)


# --- a few modifications, as closures over arrays ------------------------------------------


def relative_table(table):
    """A learned bias per head and relative distance (a closure over a traced array)."""
    return lambda s, b, h, i, j: s + table[h, i - j + SK]


def head_scaling(scales):
    """Each head's logits multiplied by its own (learned) factor."""
    return lambda s, b, h, i, j: s * scales[h]


def document_mask(q_docs, kv_docs):
    return lambda b, h, i, j: q_docs[b, i] == kv_docs[b, j]


def prefix_lm(prefix):
    return lambda b, h, i, j: (j < prefix) | (j <= i + OFFSET)


SCORE_MODS = {
    "relative_table": (relative_table, lambda: 0.5 * seeded_normal(5, (H, SQ + SK + 1))),
    "head_scaling": (head_scaling, lambda: 1.0 + 0.3 * seeded_normal(6, (H,))),
}


# Each modification once, each way round (the other pairs: `relative_table` causal in
# `test_with_lengths_and_block_mask`, `head_scaling` not in
# `test_checker_compares_score_mod_gradients`).
@pytest.mark.parametrize("name, causal", [("relative_table", False), ("head_scaling", True)])
def test_score_mod_matches_reference(name, causal):
    """Values, lse and the gradients of q, k, v and the closed-over array (GQA)."""
    q, k, v = _qkv()
    make, init = SCORE_MODS[name]
    params = init()

    def kwargs(p):
        return dict(score_mod=make(p), causal=causal)

    _assert_all_close(_values_and_grads(_flash, q, k, v, params, kwargs),
                      _values_and_grads(plain_attention, q, k, v, params, kwargs))


def _by_hand(q, k, v, score, allowed):
    """Attention written out in jnp for MHA `(B, H, S, D)` inputs, with `score(s, b, h, i,
    j)` applied to the scaled logits and `allowed(b, h, i, j)` masking."""
    b = jnp.arange(q.shape[0]).reshape(-1, 1, 1, 1)
    h = jnp.arange(q.shape[1]).reshape(1, -1, 1, 1)
    i = jnp.arange(q.shape[2]).reshape(1, 1, -1, 1)
    j = jnp.arange(k.shape[2]).reshape(1, 1, 1, -1)
    s = score(jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(q.shape[-1]), b, h, i, j)
    ok = jnp.broadcast_to(allowed(b, h, i, j), s.shape)
    s = jnp.where(ok, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.where(ok, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    return jnp.einsum("bhqk,bhkd->bhqd", p, v), lse


def test_against_hand_written_reference():
    """A relative-position score_mod with a document mask_mod, by hand in jnp."""
    q, k, v = _qkv(kv_heads=H)
    table = 0.5 * seeded_normal(5, (H, SQ + SK + 1))
    q_docs = jnp.asarray(np.sort(np.random.default_rng(7).integers(0, 3, (B, SQ))))
    kv_docs = jnp.asarray(np.sort(np.random.default_rng(8).integers(0, 3, (B, SK))))

    def kwargs(t):
        return dict(score_mod=relative_table(t), mask_mod=document_mask(q_docs, kv_docs))

    def by_hand(q, k, v, score_mod, mask_mod):
        return _by_hand(q, k, v, score_mod, mask_mod)

    _assert_all_close(_values_and_grads(_flash, q, k, v, table, kwargs),
                      _values_and_grads(by_hand, q, k, v, table, kwargs), atol=3e-5)


MASK_MODS = {
    "prefix_lm": lambda: prefix_lm(10),
    "document": lambda: document_mask(
        jnp.asarray(np.sort(np.random.default_rng(9).integers(0, 4, (B, SQ)))),
        jnp.asarray(np.sort(np.random.default_rng(10).integers(0, 4, (B, SK))))),
    "dilated": lambda: (lambda b, h, i, j: (i + OFFSET - j) % (h + 2) == 0),
    "random_blocks": lambda: (lambda b, h, i, j: jnp.asarray(
        np.random.default_rng(11).random((B, H, 3, 3)) < 0.4)[b, h, i // 16, j // 24]),
}


# Each mask_mod once, with a block_mask where no other test gives it one; without one
# (the call summarises the mask_mod itself), `prefix_lm` runs in
# `test_score_and_mask_mod_with_everything`, `document` in
# `test_against_hand_written_reference`, and a mask_mod reading the head (as `dilated`
# does) in `test_derived_summary_follows_batch_and_heads`.
@pytest.mark.parametrize("name, with_block_mask", [
    ("prefix_lm", True), ("document", True), ("dilated", True), ("random_blocks", False)])
def test_mask_mod_matches_reference(name, with_block_mask):
    """GQA, a key mask and a window too; gradients of q, k, v and of a bias."""
    q, k, v = _qkv()
    mask_mod = MASK_MODS[name]()
    block_mask = (make_block_mask(mask_mod, (B,), H, SQ, SK, **BLOCKS, kv_heads=KH)
                  if with_block_mask else None)
    key_mask = jnp.asarray(np.random.default_rng(12).random((B, SK)) < 0.9)

    def kwargs(bias):
        return dict(mask_mod=mask_mod, bias=bias, mask=key_mask, window=(30, None))

    def flash(*a, **kw):
        return _flash(*a, block_mask=block_mask, **kw)

    bias = seeded_normal(13, (SQ, SK))
    _assert_all_close(_values_and_grads(flash, q, k, v, bias, kwargs),
                      _values_and_grads(plain_attention, q, k, v, bias, kwargs))


def test_score_and_mask_mod_with_everything():
    """Both modifications with bias, ALiBi, segment ids, softcap and dropout."""
    q, k, v = _qkv()
    extra = dict(
        q_segment_ids=jnp.asarray(np.sort(np.random.default_rng(9).integers(0, 2, (B, SQ)))),
        kv_segment_ids=jnp.asarray(np.sort(np.random.default_rng(10).integers(0, 2, (B, SK)))),
        alibi_slopes=jnp.asarray([0.3, 0.2, 0.1, 0.05]), softcap=5.0, dropout_rate=0.2,
        key=jax.random.key(3), bias=seeded_normal(14, (B, 1, SQ, SK)),
    )

    def kwargs(p):
        return dict(score_mod=relative_table(p), mask_mod=prefix_lm(8), **extra)

    table = 0.5 * seeded_normal(5, (H, SQ + SK + 1))
    _assert_all_close(_values_and_grads(_flash, q, k, v, table, kwargs),
                      _values_and_grads(plain_attention, q, k, v, table, kwargs), atol=3e-5)


def test_softcap_as_score_mod():
    q, k, v = _qkv()
    cap = 3.0

    def kwargs(softcap):
        return lambda _: ({"softcap": cap} if softcap else
                          {"score_mod": lambda s, *_: cap * jnp.tanh(s / cap)})

    _assert_all_close(_values_and_grads(_flash, q, k, v, None, kwargs(False)),
                      _values_and_grads(_flash, q, k, v, None, kwargs(True)), atol=1e-6)


# --- causal as a mask_mod: same values, same computed blocks -----------------------------


class _BlockCounter:
    """Counts the block pairs the forward and backward kernels compute, with a debug
    callback in their per-block update (patched in; compiled programs are dropped first so
    every kernel is traced with it)."""

    def __init__(self, monkeypatch):
        from eqx_flash._kernels.xla import backward as _backward
        from eqx_flash._kernels.xla import forward as _forward

        self.counts = {"forward": 0, "backward": 0}
        for name, module, tile in (("forward", _forward, "_forward_tile"),
                                   ("backward", _backward, "_backward_tile")):
            monkeypatch.setattr(module, tile, self._counting(name, getattr(module, tile)))
        jax.clear_caches()

    def _counting(self, name, update):
        def counted(*args):
            jax.debug.callback(lambda: self.counts.__setitem__(name, self.counts[name] + 1))
            return update(*args)

        return counted

    def run(self, fn):
        return self.run_with_result(fn)[0]

    def run_with_result(self, fn):
        """`(counts, fn())`."""
        self.counts.update(forward=0, backward=0)
        result = jax.block_until_ready(fn())
        jax.effects_barrier()
        return dict(self.counts), result


@pytest.mark.parametrize("seq_q, seq_k", [(64, 64), (SQ, SK)])
def test_causal_as_mask_mod(monkeypatch, seq_q, seq_k):
    """`mask_mod = j <= i + seq_k - seq_q` gives causal=True's values and gradients, and
    computes exactly as many blocks, forward and backward, with or without a block_mask."""
    q, k, v = _qkv(seq_q=seq_q, seq_k=seq_k)
    causal = lambda b, h, i, j: j <= i + seq_k - seq_q  # noqa: E731
    block_mask = make_block_mask(causal, (), 1, seq_q, seq_k, **BLOCKS)
    variants = {
        "causal": dict(causal=True),
        "mask_mod": dict(mask_mod=causal),
        "block_mask": dict(mask_mod=causal, block_mask=block_mask),
    }
    # One program per variant gives both its values and gradients and its block counts.
    counter = _BlockCounter(monkeypatch)
    counts, results = {}, {}
    for name, kw in variants.items():
        counts[name], results[name] = counter.run_with_result(
            lambda kw=kw: _values_and_grads(_flash, q, k, v, None, lambda _: kw))
    for name in ("mask_mod", "block_mask"):
        _assert_all_close(results[name], results["causal"], atol=1e-6, rtol=1e-6)
    per_head = B * KH
    num_q, num_k = -(-seq_q // 16), -(-seq_k // 24)
    assert 0 < counts["causal"]["forward"] < per_head * num_q * num_k
    assert counts["causal"]["backward"] > 0
    assert counts["mask_mod"] == counts["causal"], counts
    assert counts["block_mask"] == counts["causal"], counts


def test_block_mask_skips_empty_blocks(monkeypatch):
    """A block-sparse mask_mod computes only its non-empty blocks, and `make_block_mask`
    matches a brute-force summary of the mask."""
    q, k, v = _qkv(kv_heads=H, seq_q=64, seq_k=96)
    keep = np.random.default_rng(15).random((4, 4)) < 0.3
    keep[:, 0] = True  # every query block sees some key block
    mask_mod = lambda b, h, i, j: jnp.asarray(keep)[i // 16, j // 24]  # noqa: E731
    block_mask = make_block_mask(mask_mod, (), 1, 64, 96, **BLOCKS)
    np.testing.assert_array_equal(block_mask.flags[0], np.where(keep, 2, 0))
    assert float(block_mask.sparsity) == pytest.approx(1 - keep.mean())

    counter = _BlockCounter(monkeypatch)
    counts, (out, _) = counter.run_with_result(
        lambda: _flash(q, k, v, mask_mod=mask_mod, block_mask=block_mask))
    assert counts["forward"] == B * H * keep.sum()
    # Without a block_mask the call summarises the mask_mod itself: the same blocks.
    assert counter.run(lambda: _flash(q, k, v, mask_mod=mask_mod)) == counts
    ref, _ = jax.jit(functools.partial(plain_attention, mask_mod=mask_mod))(q, k, v)
    assert_close(out, ref)


def test_derived_summary_follows_batch_and_heads(monkeypatch):
    """Without a block_mask, a mask_mod that depends on the batch element and the head is
    summarised per (batch, head): values as the reference's, and the same blocks computed
    as with `make_block_mask` for the full batch and heads."""
    q, k, v = _qkv(kv_heads=H)
    mask_mod = lambda b, h, i, j: (j <= i + h * 20 - 30) & (b == 0) | (j < 4)  # noqa: E731
    block_mask = make_block_mask(mask_mod, (B,), H, SQ, SK, **BLOCKS)
    counter = _BlockCounter(monkeypatch)
    given = counter.run(lambda: _flash(q, k, v, mask_mod=mask_mod, block_mask=block_mask))
    assert 0 < given["forward"] < B * H * 9
    derived, (out, lse) = counter.run_with_result(lambda: _flash(q, k, v, mask_mod=mask_mod))
    assert derived == given
    ref, ref_lse = jax.jit(functools.partial(plain_attention, mask_mod=mask_mod))(q, k, v)
    assert_close(out, ref)
    assert_close(lse, ref_lse)


def test_make_block_mask_partial_and_heads():
    """Per-head flags: empty, partial and full blocks where a brute force finds them; GQA
    folds the heads of a kv head (empty/full only when so for all of them)."""
    mask_mod = lambda b, h, i, j: (j <= i + h * 20) & (b == 0) | (j < 4)  # noqa: E731
    bm = make_block_mask(mask_mod, (2,), 4, 40, 56, **BLOCKS)
    assert bm.flags.shape == (2, 4, 3, 3) and bm.flags.dtype == jnp.int8
    b = np.arange(2).reshape(-1, 1, 1, 1)
    h = np.arange(4).reshape(1, -1, 1, 1)
    i = np.arange(48).reshape(1, 1, -1, 1)
    j = np.arange(72).reshape(1, 1, 1, -1)
    dense = np.asarray((j <= i + h * 20) & (b == 0) | (j < 4))
    valid = (i < 40) & (j < 56)
    blocks = lambda x: x.reshape(2, 4, 3, 16, 3, 24)  # noqa: E731
    some = blocks(dense & valid).any(axis=(3, 5))
    every = blocks(dense | ~valid).all(axis=(3, 5))
    np.testing.assert_array_equal(bm.flags, np.where(some, np.where(every, 2, 1), 0))
    from eqx_flash._core.shapes import shapes_of
    from eqx_flash._mods.block_mask import block_flags_for

    q, k, v = _qkv()
    folded = np.asarray(block_flags_for(bm, mask_mod, shapes_of(q, k, v), 16, 24))
    assert folded.shape == (2, 2, 1, 3, 3)
    flags = np.asarray(bm.flags).reshape(2, 2, 2, 3, 3)
    expected = np.where(flags.max(2) == 0, 0, np.where(flags.min(2) == 2, 2, 1))
    np.testing.assert_array_equal(folded[:, :, 0], expected)


# --- edge rows -------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["mask_mod", "score_mod"])
def test_emptied_rows(how):
    """A row that a mask_mod empties, or whose score_mod scores are all -inf: out 0, lse
    -inf, finite gradients, zero for that query."""
    q, k, v = _qkv()
    if how == "mask_mod":
        kwargs = dict(mask_mod=lambda b, h, i, j: (i != 3) | (h == 1))
    else:
        kwargs = dict(score_mod=lambda s, b, h, i, j: jnp.where((i == 3) & (h != 1), -jnp.inf, s))
    for fn in (_flash, plain_attention):
        (out, lse), grads = values_and_grads(fn, q, k, v, **kwargs)
        out, lse, grads = np.asarray(out), np.asarray(lse), [np.asarray(g) for g in grads]
        assert np.all(out[:, [0, 2, 3], 3] == 0)
        assert np.all(np.isneginf(lse[:, [0, 2, 3], 3]))
        assert np.all(np.isfinite(lse[:, 1]))
        assert all(np.all(np.isfinite(g)) for g in grads)
        assert np.all(grads[0][:, [0, 2, 3], 3] == 0)


# --- PyTrees, transformations -------------------------------------------------------------


def test_module_score_mod_gradients():
    """An `eqx.Module` score_mod: its leaves get gradients (`eqx.filter_grad`), under
    `jit` and eagerly, equal to those through `plain_attention`."""
    q, k, v = _qkv()
    rpb = RelativePositionBias(H, num_buckets=16, max_distance=32, key=jax.random.key(0))

    def loss(fn, mod):
        return seeded_linear_loss(fn, q, k, v, score_mod=mod)[0]

    got = eqx.filter_jit(eqx.filter_grad(lambda m: loss(_flash, m)))(rpb)
    eager = eqx.filter_grad(lambda m: loss(_flash, m))(rpb)
    expected = eqx.filter_jit(eqx.filter_grad(lambda m: loss(plain_attention, m)))(rpb)
    scale = float(np.abs(expected.table).max())
    assert scale > 0
    np.testing.assert_allclose(got.table, expected.table, atol=1e-4 * scale)
    np.testing.assert_allclose(eager.table, expected.table, atol=1e-4 * scale)


def test_vmap_and_closure_over_batched_arrays():
    """vmap over the batch with a mask_mod and score_mod closing over per-example arrays
    equals the batched call."""
    q, k, v = _qkv()
    docs = jnp.asarray(np.sort(np.random.default_rng(16).integers(0, 3, (B, SK))))
    gains = 1.0 + 0.2 * seeded_normal(17, (B,))

    def one(q, k, v, d, g):
        return _flash(q, k, v, mask_mod=lambda b, h, i, j: d[i + OFFSET] == d[j],
                      score_mod=lambda s, b, h, i, j: s * g)[0]

    mapped = jax.vmap(one)(q, k, v, docs, gains)
    batched, _ = _flash(q, k, v, mask_mod=lambda b, h, i, j: docs[b, i + OFFSET] == docs[b, j],
                        score_mod=lambda s, b, h, i, j: s * gains[b])
    np.testing.assert_allclose(mapped, batched, atol=2e-6)


def test_closures_over_shard_map_values_with_check_vma():
    """A `score_mod` and a `mask_mod` closing over arrays of the user's own
    `jax.shard_map` (check_vma=True, its default; one device here, the 4-device form in
    `multidevice_checks.py`): the traced modification was replayed with a cast recorded
    for an invariant score that arrives varying (#41: "pvary is a invariant->variant
    collective"). Values and the gradients of q, k, v and the closed-over table equal the
    unsharded call's."""
    from jax.sharding import Mesh, PartitionSpec

    q, k, v = _qkv()
    table = seeded_normal(18, (B, H))
    shift = jnp.asarray([1, 3], jnp.int32)

    def attention(q, k, v, table, shift):
        return _flash(q, k, v, causal=True,
                      score_mod=lambda s, b, h, i, j: s + 0.3 * table[b, h],
                      mask_mod=lambda b, h, i, j: (i - j) % 4 != shift[b])

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    mapped = jax.shard_map(attention, mesh=mesh, in_specs=(PartitionSpec("data"),) * 5,
                           out_specs=(PartitionSpec("data"),) * 2)

    def loss(fn):
        return jax.jit(jax.value_and_grad(
            lambda *a: seeded_linear_loss(lambda *b: fn(*b, shift), *a)[0],
            argnums=(0, 1, 2, 3)))(q, k, v, table)

    expected, got = loss(attention), loss(mapped)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        assert_close(a, b, kind="grad")


def test_causal_flash_attention_and_bare_inputs():
    """`causal_flash_attention` takes a score_mod; `(seq, dim)` inputs take a mask_mod."""
    q, k, v = _qkv()
    mod = relative_table(0.5 * seeded_normal(5, (H, SQ + SK + 1)))
    bare = [jnp.asarray(np.asarray(x)[0, 0]) for x in (q, k, v)]

    def references(q, k, v, bare):
        return (plain_attention(q, k, v, score_mod=mod, causal=True)[0],
                plain_attention(*bare, mask_mod=prefix_lm(5)))

    ref, (bare_ref, bare_ref_lse) = jax.jit(references)(q, k, v, bare)
    out, _ = causal_flash_attention(q, k, v, score_mod=mod, **BLOCKS)
    assert_close(out, ref)
    out, lse = _flash(*bare, mask_mod=prefix_lm(5))
    assert_close(out, bare_ref)
    assert_close(lse, bare_ref_lse)


# --- ready-made modifications ---------------------------------------------------------------


def test_alibi_module_equals_alibi_slopes():
    """The `ALiBi` module (run by the kernels as their own ALiBi, `flash.native_alibi`)
    equals `alibi_slopes` at the bottom-right offset, and the reference evaluating the
    module itself at any offset."""
    q, k, v = _qkv()
    alibi = ALiBi(H, offset=OFFSET)
    np.testing.assert_allclose(alibi.slopes, 2.0 ** -(2.0 * np.arange(1, 5)))
    np.testing.assert_allclose(ALiBi(6).slopes, [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])
    for causal in (False, True):
        out, lse = _flash(q, k, v, score_mod=alibi, causal=causal)
        ref, ref_lse = _flash(q, k, v, alibi_slopes=alibi.slopes, causal=causal)
        np.testing.assert_allclose(out, ref, atol=2e-6)
        np.testing.assert_allclose(lse, ref_lse, atol=2e-6)
    top_left = ALiBi(H)
    out, lse = jax.jit(lambda q, k, v: _flash(q, k, v, score_mod=top_left))(q, k, v)
    ref, ref_lse = jax.jit(lambda q, k, v: plain_attention(q, k, v, score_mod=top_left))(
        q, k, v)
    assert_close(out, ref)
    assert_close(lse, ref_lse)


def test_relative_position_bucket():
    """T5's buckets: exact up to half the range, logarithmic to max_distance, capped."""
    rel = jnp.asarray([0, 1, 2, 7, 8, 20, 127, 128, 1000, -1, -7, -8, -1000])
    bucket = jax.jit(relative_position_bucket, static_argnums=(1, 2, 3))  # not op by op
    got = bucket(rel, True, 32, 128)
    np.testing.assert_array_equal(got, [0, 17, 18, 23, 24, 26, 31, 31, 31, 1, 7, 8, 15])
    one_way = bucket(rel, False, 32, 128)
    np.testing.assert_array_equal(one_way[:9], 0)  # keys after the query
    np.testing.assert_array_equal(one_way[9:], [1, 7, 8, 31])


# --- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(score_mod=lambda s, *_: s.sum(-1)), ValueError, "score_mod.*shape"),
        (dict(score_mod=lambda s, *_: s.astype(jnp.float16)), TypeError, "score_mod.*dtype"),
        (dict(score_mod=lambda s, *_: s - s.max(-1, keepdims=True)), ValueError,
         "score_mod must be elementwise"),
        (dict(score_mod=lambda s, *_: jnp.cumsum(s, axis=1)), ValueError,
         "score_mod must be elementwise"),
        (dict(mask_mod=lambda b, h, i, j: j - i), TypeError, "mask_mod must return a boolean"),
        (dict(mask_mod=lambda b, h, i, j: jnp.ones((5, 5, 5, 5), bool)), ValueError,
         "mask_mod"),
        (dict(score_mod=3), TypeError, "score_mod"),
    ],
)
@pytest.mark.parametrize("fn", [_flash, plain_attention])
def test_errors_name_the_argument(kwargs, error, match, fn):
    q, k, v = _qkv()
    with pytest.raises(error, match=match):
        fn(q, k, v, **kwargs)


def test_block_mask_errors():
    q, k, v = _qkv()
    causal = lambda b, h, i, j: j <= i  # noqa: E731
    other_blocks = make_block_mask(causal, (), 1, SQ, SK, block_q=8, block_k=24)
    with pytest.raises(ValueError, match="block_mask was built for"):
        _flash(q, k, v, mask_mod=causal, block_mask=other_blocks)
    other_seq = make_block_mask(causal, (), 1, SQ + 1, SK, **BLOCKS)
    with pytest.raises(ValueError, match="block_mask was built for"):
        _flash(q, k, v, mask_mod=causal, block_mask=other_seq)
    other_heads = make_block_mask(causal, (B,), 3, SQ, SK, **BLOCKS)
    for fn in (_flash, plain_attention):
        with pytest.raises(ValueError, match="block_mask was built for"):
            fn(q, k, v, mask_mod=causal, block_mask=other_heads)
    good = make_block_mask(causal, (), 1, SQ, SK, **BLOCKS)
    with pytest.raises(ValueError, match="block_mask.*mask_mod"):
        _flash(q, k, v, block_mask=good)
    # the default block sizes are the kernels' defaults
    default = make_block_mask(causal, (), 1, SQ, SK, kv_heads=1)
    out, _ = flash_attention(q, k, v, mask_mod=causal, block_mask=default)
    assert out.shape == q.shape
    with pytest.raises(TypeError, match="mask_mod must return a boolean"):
        make_block_mask(lambda b, h, i, j: i - j, (), 1, SQ, SK)


def test_sharded_refuses_modifications():
    """(Forward mode with them works: tests/test_forward_mode_scores.py.)"""
    q, k, v = _qkv()
    mod = head_scaling(jnp.ones(H))
    # ring_flash_attention takes them (tests/test_ring.py); sharded_flash_attention does
    # not, and says so by name.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    for name in ("score_mod", "mask_mod"):
        with pytest.raises(NotImplementedError, match=name):
            eqx_flash.sharded_flash_attention(q, k, v, mesh=mesh, seq_axis="x", **{name: mod})


# --- modules ---------------------------------------------------------------------------------


def test_modules_take_modifications_as_fields_and_per_call():
    """A `RelativePositionBias` field of `FlashMultiheadAttention` trains through
    `eqx.filter_grad` of a `vmap`ped loss (as the reference's gradient); `FlashAttention`
    takes a mask_mod as a field or per call, with a block_mask."""
    heads, seq = 4, 20
    rpb = RelativePositionBias(heads, key=jax.random.key(1))
    causal = lambda b, h, i, j: j <= i  # noqa: E731
    mha = eqx_flash.FlashMultiheadAttention(heads, 16, num_kv_heads=2, score_mod=rpb,
                                            mask_mod=causal, block_q=8, block_k=8,
                                            key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(2), (3, seq, 16))

    def loss(model):
        return jnp.sum(jax.vmap(model)(x, x, x) ** 2)

    def reference_loss(model):
        def one(x):
            def heads_of(proj, n):
                return jax.vmap(proj)(x).reshape(seq, n, -1).swapaxes(0, 1)

            q, k, v = (heads_of(model.query_proj, heads), heads_of(model.key_proj, 2),
                       heads_of(model.value_proj, 2))
            out, _ = plain_attention(q, k, v, score_mod=model.score_mod, causal=True)
            return jax.vmap(model.output_proj)(out.swapaxes(0, 1).reshape(seq, -1))

        return jnp.sum(jax.vmap(one)(x) ** 2)

    got = eqx.filter_jit(eqx.filter_grad(loss))(mha)
    expected = eqx.filter_jit(eqx.filter_grad(reference_loss))(mha)
    assert isinstance(got.score_mod, RelativePositionBias)
    scale = float(np.abs(expected.score_mod.table).max())
    assert scale > 0
    np.testing.assert_allclose(got.score_mod.table, expected.score_mod.table,
                               atol=1e-4 * scale)
    np.testing.assert_allclose(got.query_proj.weight, expected.query_proj.weight,
                               atol=1e-4 * float(np.abs(expected.query_proj.weight).max()))

    converted = eqx_flash.FlashMultiheadAttention.from_eqx(
        eqx.nn.MultiheadAttention(heads, 16, key=jax.random.key(0)), score_mod=rpb)
    assert converted.score_mod.table is rpb.table

    q = jax.random.normal(jax.random.key(3), (heads, seq, 8))
    attn = eqx_flash.FlashAttention(block_q=8, block_k=8, mask_mod=causal)
    block_mask = make_block_mask(causal, (), 1, seq, seq, 8, 8)
    expected_out, _ = jax.jit(functools.partial(plain_attention, causal=True))(q, q, q)
    np.testing.assert_allclose(attn(q, q, q), expected_out, atol=2e-6)
    np.testing.assert_allclose(attn(q, q, q, block_mask=block_mask), expected_out, atol=2e-6)
    anti = eqx_flash.FlashAttention(block_q=8, block_k=8)(
        q, q, q, mask_mod=lambda b, h, i, j: j >= i, score_mod=ALiBi(heads))
    anti_expected, _ = jax.jit(functools.partial(
        plain_attention, window=(0, None), alibi_slopes=ALiBi(heads).slopes))(q, q, q)
    np.testing.assert_allclose(anti, anti_expected, atol=2e-6)


def test_gradient_of_vmapped_bias_and_score_mod():
    """`jax.grad` of a loss over `jax.vmap` of the attention (the usual training step) works
    with the reverse-mode-only paths: bias and score_mod."""
    q, k, v = _qkv()
    bias = seeded_normal(18, (B, H, SQ, SK))
    table = 0.5 * seeded_normal(5, (H, SQ + SK + 1))

    def loss(fn, q, bias, table):
        out = jax.vmap(lambda q, k, v, b: fn(q, k, v, bias=b,
                                             score_mod=relative_table(table))[0])(q, k, v, bias)
        return jnp.sum(out ** 2)

    got = jax.jit(jax.grad(lambda *a: loss(_flash, *a), argnums=(0, 1, 2)))(q, bias, table)
    expected = jax.jit(jax.grad(lambda *a: loss(plain_attention, *a), argnums=(0, 1, 2)))(
        q, bias, table)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, atol=1e-4 * max(float(np.abs(e).max()), 1.0))


# --- property test ------------------------------------------------------------------------------


@examples(8)  # the parametrized tests above cover each modification
@given(inputs=attention_inputs(score_mod=True, mask_mod=None, dtypes=(jnp.float32,),
                               max_seq=64))
def test_property_score_and_mask_mods(inputs):
    """Values, lse and gradients (q, k, v and the score_mod's arrays) against
    `plain_attention` over the strategy's families, with every other feature drawn too."""
    check_attention(flash_attention, inputs)


def test_checker_compares_score_mod_gradients():
    """`check_attention` differentiates the score_mod's arrays: a function that drops
    their gradients is caught, by name."""
    from eqx_flash.testing import AttentionInputs, HeadScaling

    q, k, v = _qkv()
    scaling = HeadScaling(1.0 + 0.3 * seeded_normal(6, (H,)))
    inputs = AttentionInputs(q, k, v, dict(score_mod=scaling))
    check_attention(flash_attention, inputs)

    def frozen(q, k, v, score_mod, **kwargs):
        return flash_attention(q, k, v, score_mod=jax.lax.stop_gradient(score_mod), **kwargs)

    with pytest.raises(AssertionError, match=r"dscore_mod\.scales"):
        check_attention(frozen, inputs)


def test_with_lengths_and_block_mask():
    """Variable lengths with a score_mod, a mask_mod and its block_mask."""
    q, k, v = _qkv()
    table = 0.5 * seeded_normal(5, (H, SQ + SK + 1))
    mask_mod = MASK_MODS["random_blocks"]()
    block_mask = make_block_mask(mask_mod, (B,), H, SQ, SK, **BLOCKS)
    lengths = dict(q_lengths=jnp.asarray([SQ, 17]), kv_lengths=jnp.asarray([30, SK]))

    def kwargs(p):
        return dict(score_mod=relative_table(p), mask_mod=mask_mod, causal=True, **lengths)

    def flash(*a, **kw):
        return _flash(*a, block_mask=block_mask, **kw)

    _assert_all_close(_values_and_grads(flash, q, k, v, table, kwargs),
                      _values_and_grads(plain_attention, q, k, v, table, kwargs))


def test_failing_score_mod_names_itself():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="score_mod failed on a block"):
        _flash(q, k, v, score_mod=lambda s, b, h, i, j: s + jnp.zeros((7, 5)))


def test_block_mask_schedule_follows_the_band():
    """With a block_mask, each outer block visits its flagged blocks, whole ones without
    masks: for causal, exactly `causal=True`'s band, with the same blocks whole."""
    from eqx_flash._core.config import KernelConfig
    from eqx_flash._core.operands import Operands
    from eqx_flash._core.options import Window
    from eqx_flash._kernels.schedule import band_ranges, run_limits
    from eqx_flash._kernels.xla.loops import over_band

    causal = lambda b, h, i, j: j <= i + OFFSET  # noqa: E731
    flags = make_block_mask(causal, (), 1, SQ, SK, **BLOCKS).flags.reshape(1, 3, 3)
    cfg = KernelConfig(SQ, SK, BLOCKS["block_q"], BLOCKS["block_k"], Window(), scale=1.0)
    for by in ("q", "k"):
        unmasked = band_ranges(cfg, by=by)  # no static band
        band = band_ranges(dataclasses.replace(cfg, window=Window(None, 0)), by=by)

        @jax.jit  # one program for every outer block
        def visits(outer, flags, unmasked=unmasked, by=by):
            return over_band(unmasked, outer, lambda c, j, masked: c.at[j, int(masked)].add(1),
                             jnp.zeros((3, 2), jnp.int32),
                             run_limits(cfg, Operands(block_flags=flags), by))

        for outer in range(3):
            seen = np.asarray(visits(jnp.int32(outer), flags))
            inner = np.arange(3)
            whole = (inner >= band.full_lo[outer]) & (inner < band.full_hi[outer])
            some = (inner >= band.lo[outer]) & (inner < band.hi[outer])
            np.testing.assert_array_equal(seen[:, 0], whole, err_msg=by)
            np.testing.assert_array_equal(seen[:, 1], some & ~whole, err_msg=by)


def test_frozen_score_mod_accumulates_no_cotangent():
    """Differentiated with respect to q alone, a `RelativePositionBias` is a constant: the
    backward kernel computes no cotangent for its table (no scatter-add in the program,
    where a trained table has one), and q's gradient is the reference's."""
    q, k, v = _qkv()
    rpb = RelativePositionBias(H, key=jax.random.key(4))

    def loss(q, m, attention):
        return jnp.sum(attention(q, k, v, score_mod=m)[0] ** 2)

    grad = jax.jit(jax.grad(loss), static_argnums=2)
    frozen = grad(q, rpb, _flash)
    assert_close(frozen, grad(q, rpb, plain_attention))
    only_q = grad.lower(q, rpb, _flash).as_text()
    both = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2).lower(
        q, rpb, _flash).as_text()
    assert "scatter" in both
    assert "scatter" not in only_q


@pytest.mark.parametrize("fn", [_flash, plain_attention])
def test_shared_block_mask_for_a_mask_mod_reading_head_or_batch_is_refused(fn):
    """A block mask built shared (`batch_shape=()`, `heads=1`) summarises the mask_mod at
    batch 0, head 0 only: for a mask_mod that reads `head` (or `batch`) it would be wrong,
    so the call refuses it naming `block_mask`; one that reads neither keeps working."""
    q, k, v = _qkv()
    per_head = lambda b, h, i, j: (j <= i + 4 * h)  # noqa: E731
    per_batch = lambda b, h, i, j: (j <= i + 8 * b)  # noqa: E731
    for mask_mod, what in ((per_head, "head"), (per_batch, "batch")):
        shared = make_block_mask(mask_mod, (), 1, SQ, SK, **BLOCKS)
        with pytest.raises(ValueError, match=f"block_mask was built shared over {what}"):
            fn(q, k, v, mask_mod=mask_mod, block_mask=shared)
    full = make_block_mask(per_head, (), H, SQ, SK, **BLOCKS)  # shared over batch only
    out, _ = fn(q, k, v, mask_mod=per_head, block_mask=full)
    expected, _ = fn(q, k, v, mask_mod=per_head)
    assert_close(out, expected)
    causal = lambda b, h, i, j: j <= i  # noqa: E731
    out, _ = fn(q, k, v, mask_mod=causal,
                block_mask=make_block_mask(causal, (), 1, SQ, SK, **BLOCKS))
    expected, _ = fn(q, k, v, mask_mod=causal)
    assert_close(out, expected)
