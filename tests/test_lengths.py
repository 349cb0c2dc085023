"""Variable lengths (`q_lengths`, `kv_lengths`) and the flash-decoding path: values and
gradients against `plain_attention` and against attention on the unpadded slices, work
that follows the lengths, NaN-safe padding, errors, and `jit`/`vmap`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, assert_lse_close, qkv, values_and_grads

import eqx_flash
from eqx_flash import causal_flash_attention, flash_attention, plain_attention

B, H, KV, D = 3, 4, 2, 8


def _qkv(seq_q, seq_k, seed=0, heads=H, kv_heads=KV):
    return qkv(seed, (B, heads, seq_q, D), (B, kv_heads, seq_k, D))


OPTIONS = [{}, {"causal": True}, {"window": (5, 3)}, {"causal": True, "window": 6}]


# Causal or not, a window or not, and more keys than queries or fewer: every pair of these
# in four cases, not the grid of eight (each of the four options with more keys than
# queries: `test_lengths_equal_unpadded_slices`; drawn shapes: `test_properties`).
@pytest.mark.parametrize(("options", "seq_q", "seq_k", "blocks"), [
    ({}, 40, 70, (16, 16)), ({"causal": True, "window": 6}, 40, 70, (16, 16)),
    ({"causal": True}, 70, 40, (16, 32)), ({"window": (5, 3)}, 70, 40, (16, 32)),
], ids=str)
def test_lengths_against_reference(options, seq_q, seq_k, blocks):
    q, k, v = _qkv(seq_q, seq_k)
    lengths = {"q_lengths": jnp.array([seq_q, seq_q // 2 + 1, 0]),
               "kv_lengths": jnp.array([seq_k, seq_k // 3, 5])}
    kw = {**options, **lengths}
    # (`values_and_grads`: fixed NumPy weights, no random-number program in each compile.)
    (out, lse), grads = values_and_grads(
        flash_attention, q, k, v, block_q=blocks[0], block_k=blocks[1], **kw
    )
    (ref_out, ref_lse), ref_grads = values_and_grads(plain_attention, q, k, v, **kw)
    assert_close(out, ref_out, name="out")
    assert_lse_close(lse, ref_lse)
    for g, r, name in zip(grads, ref_grads, "qkv", strict=True):
        assert_close(g, r, scale=5, name=f"d{name}")


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_lengths_equal_unpadded_slices(options):
    """Each batch element equals attention on its valid slice, with causal/window aligned
    bottom-right on the valid lengths; padded query rows give 0, -inf and zero grads."""
    q, k, v = _qkv(24, 50)
    q_len, kv_len = [24, 9, 3], [50, 20, 17]

    @jax.jit  # the outputs and the gradients, one compiled program
    def grads_and_outputs(q, k, v):
        def loss(q, k, v):
            out, lse = flash_attention(q, k, v, q_lengths=jnp.array(q_len),
                                       kv_lengths=jnp.array(kv_len), block_q=8, block_k=8,
                                       **options)
            return jnp.sum(out**2), (out, lse)

        return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)

    # Sliced in NumPy: an eager slice of each shape would compile a program.
    (dq, dk, dv), (out, lse) = jax.tree.map(np.asarray, grads_and_outputs(q, k, v))
    q, k, v = (np.asarray(x) for x in (q, k, v))

    @jax.jit  # every slice in one compiled program, not one per eager op
    def references(subs):
        def reference(*sub):
            refs = jax.grad(lambda *a: jnp.sum(plain_attention(*a, **options)[0] ** 2),
                            argnums=(0, 1, 2))(*sub)
            return plain_attention(*sub, **options), refs

        return [reference(*sub) for sub in subs]

    all_refs = references(jax.device_put(
        [(q[b, :, :lq], k[b, :, :lk], v[b, :, :lk]) for b, lq, lk in zip(
            range(B), q_len, kv_len, strict=True)]))
    for b in range(B):
        lq, lk = q_len[b], kv_len[b]
        (ref_out, ref_lse), refs = all_refs[b]
        assert_close(out[b, :, :lq], ref_out)
        assert_lse_close(lse[b, :, :lq], ref_lse)
        for g, r in zip((dq[b, :, :lq], dk[b, :, :lk], dv[b, :, :lk]), refs, strict=True):
            assert_close(g, r, scale=5)
        assert np.all(np.asarray(out[b, :, lq:]) == 0)
        assert np.all(np.isneginf(np.asarray(lse[b, :, lq:])))
        assert np.all(np.asarray(dq[b, :, lq:]) == 0)
        assert np.all(np.asarray(dk[b, :, lk:]) == 0)
        assert np.all(np.asarray(dv[b, :, lk:]) == 0)


@pytest.mark.parametrize("fn", [flash_attention, plain_attention])
@pytest.mark.parametrize("seq_q", [1, 20])
def test_nan_padding_reaches_nothing(fn, seq_q):
    """NaN/inf past the lengths, or in keys hidden by the key mask, change no output and
    no gradient (an uninitialised cache)."""
    q, k, v = _qkv(seq_q, 48, seed=3)
    # Inputs in NumPy, placed on the device: no eager op to compile.
    q_len = np.array([seq_q, max(seq_q // 2, 1), 1], np.int32)
    kv_len = np.array([48, 30, 7], np.int32)
    key_mask = np.ones((B, 48), bool)
    key_mask[:, 2] = False
    q_pos = np.arange(seq_q)[None, None, :, None]
    k_pos = np.arange(48)[None, None, :, None]
    q_pad = q_pos >= q_len[:, None, None, None]
    k_pad = (k_pos >= kv_len[:, None, None, None]) | (k_pos == 2)
    q, k, v = (np.asarray(x) for x in (q, k, v))
    poisoned = jax.device_put((np.where(q_pad, np.nan, q), np.where(k_pad, np.inf, k),
                               np.where(k_pad, np.nan, v)))
    tangents = tuple(np.ones(x.shape, np.float32) for x in (q, k, v))
    dirty_tangents = jax.device_put(tuple(np.where(pad, np.nan, t) for pad, t in
                                          zip((q_pad, k_pad, k_pad), tangents, strict=True)))
    q, k, v, tangents, q_len, kv_len, key_mask = jax.device_put(
        (q, k, v, tangents, q_len, kv_len, key_mask))
    kw = {"q_lengths": q_len, "kv_lengths": kv_len, "causal": True}
    if fn is flash_attention:
        kw.update(block_q=8, block_k=16)

    def loss(q, k, v):
        out, lse = fn(q, k, v, key_mask, **kw)
        return jnp.sum(out * out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    @jax.jit  # compiled whole (faster than op by op); the poisoned inputs run it again
    def evaluate(q, k, v, tangents):
        # Evaluated alone (no derivative: the decoding kernel reads the raw cache) and in
        # forward mode (the tangents of the padding are poisoned too).
        return (jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v),
                fn(q, k, v, key_mask, **kw)[0],
                jax.jvp(lambda *a: fn(*a, key_mask, **kw)[0], (q, k, v), tangents))

    clean = evaluate(q, k, v, tangents)
    dirty = evaluate(*poisoned, dirty_tangents)
    for c, d in zip(jax.tree.leaves(clean), jax.tree.leaves(dirty), strict=True):
        assert np.all(np.isfinite(np.asarray(d)))
        np.testing.assert_allclose(np.asarray(d), np.asarray(c), rtol=1e-6, atol=1e-6)


def test_lengths_broadcast_jit_vmap():
    q, k, v = _qkv(10, 30)
    kv_len = jnp.array([30, 12, 4])
    # The references compiled whole: faster than op by op.
    plain = eqx.filter_jit(plain_attention)
    ref = plain(q, k, v, kv_lengths=kv_len, causal=True)[0]
    jitted = jax.jit(lambda q, k, v, n: causal_flash_attention(q, k, v, kv_lengths=n))
    assert_close(jitted(q, k, v, kv_len)[0], ref)
    mapped = jax.vmap(lambda q, k, v, n: causal_flash_attention(q, k, v, kv_lengths=n))
    assert_close(mapped(q, k, v, kv_len)[0], ref)
    # leading axes may be 1 or missing: one length for the whole batch
    one = flash_attention(q, k, v, kv_lengths=jnp.array(12))[0]
    assert_close(one, plain(q, k, v, kv_lengths=jnp.full((B,), 12))[0])
    q4, k4, v4 = jax.device_put([np.asarray(x)[None] for x in (q, k, v)])  # (no eager op)
    out4 = flash_attention(q4, k4, v4, kv_lengths=jax.device_put(np.asarray(kv_len)[None]),
                           causal=True)[0]
    assert_close(np.asarray(out4).reshape(ref.shape), ref)


@pytest.mark.parametrize("fn", [flash_attention, plain_attention])
def test_length_errors_name_the_argument(fn):
    q, k, v = _qkv(10, 30)
    with pytest.raises(TypeError, match="kv_lengths must have an integer dtype"):
        fn(q, k, v, kv_lengths=jnp.array([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match=r"q_lengths must have shape \(\*batch,\)"):
        fn(q, k, v, q_lengths=jnp.array([1, 2]))
    with pytest.raises(ValueError, match=r"q_lengths must have shape"):
        fn(q, k, v, q_lengths=jnp.ones((B, H), jnp.int32))
    with pytest.raises(ValueError, match=r"kv_lengths must lie in \[0, 30\]"):
        fn(q, k, v, kv_lengths=jnp.array([1, 31, 3]))
    with pytest.raises(ValueError, match=r"q_lengths must lie in \[0, 10\]"):
        fn(q, k, v, q_lengths=jnp.array([-1, 2, 3]))
    with pytest.raises(ValueError, match=r"kv_lengths must lie in \[0, 30\]"):
        fn(q, k, v, kv_lengths=np.array([1, 31, 3]))  # NumPy: concrete too
    with pytest.raises(ValueError, match=r"q_lengths must lie in \[0, 10\]"):
        fn(q, k, v, q_lengths=11)


@pytest.mark.parametrize("fn", [flash_attention, plain_attention])
def test_traced_out_of_range_lengths_are_clamped(fn):
    """Under `jax.jit` a length cannot be checked without a runtime error that could abort
    a multi-device program, so it is clamped into `[0, seq]`, as `jax.nn` masks do."""
    q, k, v = _qkv(10, 30)
    jitted = jax.jit(lambda ql, kl: fn(q, k, v, causal=True, q_lengths=ql, kv_lengths=kl))
    out, lse = jitted(jnp.array([12, -2, 4]), jnp.array([1, 40, -3]))
    # The same program on the clamped lengths (eagerly, in-range lengths: the rest of
    # this file).
    ref_out, ref_lse = jitted(jnp.array([10, 0, 4]), jnp.array([1, 30, 0]))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref_out))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(ref_lse))
    assert eqx.is_array(jitted(jnp.array([10, 3, 4]), jnp.array([1, 30, 3]))[0])


def test_length_limits_follow_lengths():
    """Key blocks wholly past a batch element's kv length (and query blocks past its q
    length) are never visited: the block pairs visited grow with the valid lengths."""
    from eqx_flash._core.config import KernelConfig
    from eqx_flash._core.operands import Operands
    from eqx_flash._core.options import Window
    from eqx_flash._kernels.schedule import length_limits, run_limits

    seq, block = 256, 16
    for q_len, kv_len, window in ((64, 64, Window()), (256, 100, Window()),
                                  (64, 64, Window(None, 0)), (64, 200, Window(None, 0)),
                                  (0, 100, Window()), (40, 0, Window()),
                                  (64, 64, Window(20, 0))):
        masks = Operands(q_lengths=jnp.full((1, 1, 1), q_len, jnp.int32),
                      kv_lengths=jnp.full((1, 1, 1), kv_len, jnp.int32))
        cfg = KernelConfig(seq_q=seq, seq_k=seq, block_q=block, block_k=block, window=window,
                           scale=1.0, lengths=True)
        # brute force: the block pairs holding at least one attending pair
        i = np.arange(seq)[:, None]
        j = np.arange(seq)[None, :]
        p = i + kv_len - q_len
        ok = (i < q_len) & (j < kv_len)
        if window.left is not None:
            ok &= j >= p - window.left
        if window.right is not None:
            ok &= j <= p + window.right
        pairs = ok.reshape(seq // block, block, seq // block, block).any(axis=(1, 3))
        for by, need in (("q", pairs), ("k", pairs.T)):
            limits = length_limits(cfg, masks, by=by)
            assert limits is not None
            lo, hi = (np.asarray(x) for x in limits)
            visited = (np.arange(need.shape[1]) >= lo[:, None]) & (
                np.arange(need.shape[1]) < hi[:, None])
            np.testing.assert_array_equal(visited, need, err_msg=f"{q_len=} {kv_len=} {by=}")
            assert run_limits(cfg, masks, by) is not None
    # padded to 4x its length, an element visits a sixteenth of the block pairs
    masks = Operands(q_lengths=jnp.full((1, 1, 1), 64, jnp.int32),
                  kv_lengths=jnp.full((1, 1, 1), 64, jnp.int32))
    cfg = KernelConfig(seq_q=seq, seq_k=seq, block_q=block, block_k=block, window=Window(),
                       scale=1.0, lengths=True)
    lo, hi = (np.asarray(x) for x in length_limits(cfg, masks, by="q"))
    assert np.sum(hi - lo) == 4 * 4  # not 16 x 16


# Each option set with one query count, cycling through 1, 3 and 16 queries (compiling the
# full cross product costs minutes for no extra path): every pair of a query count,
# causal, a key mask and lengths meets in some case.
@pytest.mark.parametrize(("seq_q", "options"), [
    (1, {}), (3, {"causal": True}), (16, {"causal": True, "key_mask": True}),
    (1, {"window": (40, 0)}), (3, {"lengths": True}), (16, {"lengths": True}),
    (1, {"causal": True, "lengths": True, "key_mask": True}),
], ids=str)
def test_decode_path_matches_reference(seq_q, options):
    options = dict(options)
    q, k, v = _qkv(seq_q, 300, seed=5, heads=8, kv_heads=2)
    kw: dict = {k_: v_ for k_, v_ in options.items() if k_ in ("causal", "window")}
    args = [q, k, v]
    if options.get("key_mask"):
        args.append(jax.device_put(np.random.default_rng(1).random((B, 300)) < 0.8))
    if options.get("lengths"):
        kw["kv_lengths"] = jnp.array([300, 130, 3])
        kw["q_lengths"] = jnp.array([seq_q, seq_q, 1])
    (out, lse), grads = values_and_grads(flash_attention, *args[:3], block_k=32,
                                         **kw) if len(args) == 3 else \
        values_and_grads(lambda q, k, v, **a: flash_attention(q, k, v, args[3], **a),
                         *args[:3], block_k=32, **kw)
    ref_fn = plain_attention if len(args) == 3 else (
        lambda q, k, v, **a: plain_attention(q, k, v, args[3], **a))
    (r_out, r_lse), r_grads = values_and_grads(ref_fn, *args[:3], **kw)
    assert_close(out, r_out)
    assert_lse_close(lse, r_lse)
    for g, r in zip(grads, r_grads, strict=True):
        assert_close(g, r, scale=5)


def test_decode_path_is_taken(monkeypatch):
    """Few queries against many key blocks run `split_k_forward` (flash-decoding), others
    the regular forward."""
    from eqx_flash._core.config import KernelConfig
    from eqx_flash._core.options import Window
    from eqx_flash._kernels import dispatch
    from eqx_flash._kernels.xla.policy import SPLIT_K_MAX_Q, num_splits

    calls = []
    xla = dispatch.FAMILIES["xla"]
    original = xla.split_k_forward
    assert original is not None

    def spy(cfg, *args):
        calls.append(cfg)
        return original(cfg, *args)

    monkeypatch.setitem(dispatch.FAMILIES, "xla", xla._replace(split_k_forward=spy))
    jax.clear_caches()

    def trace(seq_q):  # the kernel is chosen while tracing: nothing needs compiling
        q, k, v = (jax.ShapeDtypeStruct(shape, jnp.float32) for shape in (
            (B, H, seq_q, D), (B, KV, 3 * 64 + 5, D), (B, KV, 3 * 64 + 5, D)))
        jax.eval_shape(lambda q, k, v: flash_attention(q, k, v, block_k=64), q, k, v)

    for seq_q in (1, 3, 16):
        trace(seq_q)
    assert [c.seq_q for c in calls] == [1, 3, 16]
    assert all(c.splits == 4 for c in calls)
    trace(SPLIT_K_MAX_Q + 1)
    assert len(calls) == 3
    cfg = KernelConfig(seq_q=1, seq_k=64, block_q=1, block_k=64, window=Window(), scale=1.0)
    assert num_splits(cfg) == 1  # a single key block: nothing to split


def _scalar_length_entry_points():
    """Each entry point taking one scalar length per call, as `f(q_lengths, kv_lengths)`."""
    q, k, v = (x[0, 0] for x in _qkv(12, 10))  # unbatched (seq, dim)
    fa = eqx.nn.inference_mode(eqx_flash.FlashAttention(causal=True))
    mha = eqx_flash.FlashMultiheadAttention(2, 8, key=jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (12, 8))
    return {
        "flash_attention": lambda ql, kl: flash_attention(q, k, v, q_lengths=ql,
                                                          kv_lengths=kl)[0],
        "causal_flash_attention": lambda ql, kl: causal_flash_attention(
            q, k, v, q_lengths=ql, kv_lengths=kl)[0],
        "plain_attention": lambda ql, kl: plain_attention(q, k, v, q_lengths=ql,
                                                          kv_lengths=kl)[0],
        "FlashAttention": lambda ql, kl: fa(q[None], k[None], v[None], q_lengths=ql,
                                            kv_lengths=kl),
        "FlashMultiheadAttention": lambda ql, kl: mha(x, x[:10], x[:10], q_lengths=ql,
                                                      kv_lengths=kl),
    }


@pytest.mark.parametrize("entry", list(_scalar_length_entry_points()))
def test_scalar_lengths_accept_python_and_numpy_ints(entry):
    """`q_lengths`/`kv_lengths` as integer scalars: a Python int, a NumPy int32 and a JAX
    array give the same result."""
    fn = _scalar_length_entry_points()[entry]
    expected = fn(jnp.int32(7), jnp.int32(6))
    for ql, kl in ((7, 6), (np.int32(7), np.int32(6)), (np.int64(7), 6)):
        np.testing.assert_array_equal(np.asarray(fn(ql, kl)), np.asarray(expected))
    assert not np.array_equal(np.asarray(fn(12, 10)), np.asarray(expected))
    with pytest.raises(TypeError, match="kv_lengths must have an integer dtype"):
        fn(7, 6.0)
