"""The blockwise kernels against `plain_attention`: values, lse and gradients (through
both `out` and `lse`) over the configurations the kernels special-case for speed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, assert_lse_close, qkv, tolerance

from eqx_flash import flash_attention, plain_attention

# (name, seq_q, seq_k, heads, kv_heads, keywords, blocks)
CASES = [
    ("dense", 100, 130, 2, 2, {}, (32, 48)),
    ("dense_one_block", 7, 7, 2, 1, {}, (None, None)),
    ("causal", 130, 130, 2, 2, {"causal": True}, (32, 32)),
    ("causal_rect", 100, 130, 2, 1, {"causal": True}, (32, 48)),
    ("causal_short_k", 130, 100, 2, 2, {"causal": True}, (48, 32)),
    ("window", 130, 130, 2, 2, {"window": (20, 5)}, (32, 32)),
    ("gqa_key_mask", 100, 130, 4, 2, {"key_mask": True}, (32, 48)),
    ("segments_causal", 130, 130, 2, 2, {"segments": True, "causal": True}, (32, 32)),
    # Segment ids narrow each block's range of partner blocks at run time: sorted ids
    # (documents), unsorted ones (the range test must stay conservative), per-head ids
    # under GQA, and ids whose documents differ between queries and keys, with a window.
    ("segments_sorted", 130, 130, 2, 2, {"segments": "sorted"}, (16, 16)),
    ("segments_unsorted", 100, 130, 2, 2, {"segments": "unsorted"}, (16, 32)),
    ("segments_per_head_gqa", 100, 130, 4, 2, {"segments": "per_head", "causal": True},
     (16, 16)),
    ("segments_rect_window", 100, 130, 2, 1, {"segments": "rect", "window": (40, 3)},
     (16, 32)),
    ("softcap_dropout", 100, 130, 2, 2, {"softcap": 5.0, "dropout_rate": 0.3}, (32, 48)),
    ("default_blocks_1500", 1500, 1500, 1, 1, {"causal": True, "key_mask": True},
     (None, None)),
]


def _inputs(seq_q, seq_k, heads, kv_heads, dtype, seed=0):
    """q, k, v with a batch of 2 and head dim 16, and a dropout key."""
    data, dropout = jax.random.split(jax.random.key(seed))
    return (*qkv(data, (2, heads, seq_q, 16), (2, kv_heads, seq_k, 16), dtype=dtype), dropout)


def _keywords(spec, seq_q, seq_k, key):
    # Masks and ids built in NumPy (eagerly in jax.numpy, each op compiled per shape).
    kw = dict(spec)
    if kw.pop("key_mask", False):
        mask = np.arange(seq_k)[None, :] < np.array([[seq_k - 37], [seq_k // 3]])
        # The second batch row masks a whole block range; the first row's last key too.
        kw["mask"] = mask
    segments = kw.pop("segments", False)
    if segments is True:
        ids = (np.arange(seq_q) // 45).astype(np.int32)
        kw["q_segment_ids"] = np.broadcast_to(ids, (2, seq_q))
        kw["kv_segment_ids"] = np.broadcast_to((np.arange(seq_k) // 45).astype(np.int32),
                                               (2, seq_k))
    elif segments:
        kw["q_segment_ids"], kw["kv_segment_ids"] = _segment_ids(segments, seq_q, seq_k)
    if kw.get("dropout_rate"):
        kw["key"] = key
    return kw


def _segment_ids(kind, seq_q, seq_k):
    """Integer ids `(batch, [heads,] seq)`; the two batch rows differ."""
    qi, ki = np.arange(seq_q), np.arange(seq_k)
    if kind == "sorted":  # documents of 20 and of 33 tokens
        return (np.stack([qi // 20, qi // 33]).astype(np.int32),
                np.stack([ki // 20, ki // 33]).astype(np.int32))
    if kind == "unsorted":  # ids recur far apart
        return ((np.stack([qi * 7 % 5, qi % 3])).astype(np.int32),
                (np.stack([ki * 7 % 5, ki % 3])).astype(np.int32))
    if kind == "per_head":  # (batch, heads=4, seq): each head its own document length
        lengths = np.array([10, 25, 40, 200])[None, :, None]
        offset = np.array([0, 3])[:, None, None]
        return ((qi[None, None] + offset) // lengths).astype(np.int32), \
            ((ki[None, None] + offset) // (lengths + 5)).astype(np.int32)
    assert kind == "rect"  # keys' documents are longer than the queries'
    return (np.stack([qi // 25, qi // 50]).astype(np.int32),
            np.stack([ki // 32, ki // 65]).astype(np.int32))


def _loss(fn, kw):
    """`(value, (out, lse)), (dq, dk, dv)` of a nonlinear loss of out and the finite lse,
    in one compiled program (forward and backward)."""

    def loss(q, k, v):
        out, lse = fn(q, k, v, **kw)
        finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
        out32 = out.astype(jnp.float32)
        return jnp.sum(out32 * jnp.cos(out32)) + jnp.sum(jnp.sin(finite)), (out, lse)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _blocked(bq, bk):
    return lambda *a, **kw: flash_attention(*a, block_q=bq, block_k=bk, **kw)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_plain(case):
    _, seq_q, seq_k, heads, kv_heads, spec, (bq, bk) = case
    q, k, v, kd = _inputs(seq_q, seq_k, heads, kv_heads, jnp.float32)
    kw = _keywords(spec, seq_q, seq_k, kd)
    (value, (out, lse)), grads = _loss(_blocked(bq, bk), kw)(q, k, v)
    (ref_value, (ref_out, ref_lse)), ref_grads = _loss(plain_attention, kw)(q, k, v)
    np.testing.assert_allclose(out, ref_out, **tolerance(jnp.float32, "out"))
    # rtol_scale: lse's bound stays atol=2e-5 with numpy's default rtol 1e-7, as before.
    assert_lse_close(lse, ref_lse, rtol_scale=0.005)
    np.testing.assert_allclose(value, ref_value, rtol=1e-4)
    for g, r in zip(grads, ref_grads, strict=True):
        assert np.all(np.isfinite(np.asarray(g)))
        np.testing.assert_allclose(g, r, **tolerance(jnp.float32, "grad"))


def test_fully_masked_rows():
    q, k, v, _ = _inputs(70, 70, 2, 2, jnp.float32)
    mask = np.zeros((2, 70), bool)
    mask[0, :10] = True  # batch 1 sees no key at all
    seg_q = np.broadcast_to(np.where(np.arange(70) < 35, 1, 7), (2, 70)).astype(np.int32)
    seg_k = np.broadcast_to(np.where(np.arange(70) < 35, 1, 2), (2, 70)).astype(np.int32)
    kw = dict(mask=mask, q_segment_ids=seg_q, kv_segment_ids=seg_k, causal=True)
    (_, (out, lse)), grads = _loss(_blocked(16, 16), kw)(q, k, v)
    assert np.all(np.asarray(out)[1] == 0) and np.all(np.isneginf(np.asarray(lse)[1]))
    assert np.all(np.asarray(out)[0, :, 35:] == 0)
    _, ref_grads = _loss(plain_attention, kw)(q, k, v)
    for g, r in zip(grads, ref_grads, strict=True):
        assert np.all(np.isfinite(np.asarray(g)))
        np.testing.assert_allclose(g, r, **tolerance(jnp.float32, "grad"))


@pytest.fixture(params=["cpu_float32", "native"])
def low_precision_path(request, monkeypatch):
    """Both ways low-precision inputs can run: on CPU the kernels compute in float32
    (`_kernels.xla.policy.kernel_dtype`); accelerators keep the input dtype, which this
    forces."""
    from eqx_flash._api import flash as _flash
    from eqx_flash._kernels.xla import policy

    if request.param == "native":
        monkeypatch.setattr(policy, "kernel_dtype", lambda dtype, backend: jnp.dtype(dtype))
    _flash._blockwise.clear_cache()  # the dtype is chosen while tracing
    yield request.param
    _flash._blockwise.clear_cache()


@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16(causal, low_precision_path):
    q, k, v, _ = _inputs(100, 130, 4, 2, jnp.bfloat16)
    (_, (out, lse)), grads = _loss(_blocked(32, 48), {"causal": causal})(q, k, v)
    (_, (ref_out, ref_lse)), ref = _loss(plain_attention, {"causal": causal})(q, k, v)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    # Explicit factors keep the bounds as they were: out 3e-2, lse atol 3e-2, grads 0.1.
    assert_close(out, ref_out, dtype=jnp.bfloat16, scale=1.5, name="out")
    np.testing.assert_allclose(lse, ref_lse, atol=1.5 * tolerance(jnp.bfloat16)["atol"])
    for g, r in zip(grads, ref, strict=True):
        assert g.dtype == jnp.bfloat16
        assert_close(g, r, dtype=jnp.bfloat16, kind="grad", scale=2.5)


def test_segment_limits_follow_documents():
    """With packed documents, each block is scheduled against the blocks of its own
    documents only, so the work grows with document sizes, not with seq**2."""
    from eqx_flash._core.config import KernelConfig
    from eqx_flash._core.operands import Operands
    from eqx_flash._core.options import Window
    from eqx_flash._kernels.schedule import segment_limits

    seq, block, doc = 256, 16, 64  # 4 documents of 4 blocks each, then a padded block
    ids = jnp.arange(seq + block) // doc
    masks = Operands(q_segment_ids=ids.reshape(1, -1, 1), kv_segment_ids=ids.reshape(1, 1, -1))
    cfg = KernelConfig(seq_q=seq, seq_k=seq, block_q=block, block_k=block, window=Window(),
                       scale=1.0)
    for by in ("q", "k"):
        limits = segment_limits(cfg, masks, by=by)
        assert limits is not None
        lo, hi = (np.asarray(x) for x in limits)
        outer = np.arange(len(lo))
        document = np.minimum(outer * block, seq - 1) // doc
        # The padded 17th block holds only padding: its ids are ignored, so it gets nothing.
        np.testing.assert_array_equal(lo[:-1], (document * doc // block)[:-1])
        np.testing.assert_array_equal(hi[:-1], ((document + 1) * doc // block)[:-1])
        assert hi[-1] == lo[-1]
        assert np.sum(hi - lo) == 4 * 4 * 4  # 4 documents x 4 x 4 block pairs, not 17 x 17


def _loop_bodies(hlo: str, trips: int) -> list[list[str]]:
    """The instructions of the bodies of the while loops in compiled HLO text that run
    `trips` times."""
    computations: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            name = line.split()[0].lstrip("%")
            computations[name] = []
        elif name is not None:
            computations[name].append(line)
    bodies = [line.split("body=%")[1].split(",")[0] for lines in computations.values()
              for line in lines if f'"known_trip_count":{{"n":"{trips}"}}' in line]
    return [computations[b] for b in bodies]


@pytest.mark.parametrize("kernel", ["forward", "backward"])
def test_one_inner_block_stays_off_the_outer_loop(kernel):
    """With one block along a kernel's inner loop (one key block for the forward, one
    query block for the backward), that block's tile is computed only where it is
    visited: no block product in the outer loop's body, where XLA's loop-invariant code
    motion used to hoist it (computing it for every outer block, visited or not)."""
    from helpers import optimised_compilation

    inner, outer = 64, 8 * 64  # one inner block against 8 outer ones
    positions = np.arange(outer, dtype=np.int32)[None]
    if kernel == "forward":  # queries outer, a causal band on positions skips some
        q, k, v = qkv(jax.random.key(0), (1, 1, outer, 16), (1, 1, inner, 16))
        kw = dict(q_positions=positions, kv_positions=positions[:, :inner])
    else:
        q, k, v = qkv(jax.random.key(0), (1, 1, inner, 16), (1, 1, outer, 16))
        kw = dict(q_positions=positions[:, 64:128], kv_positions=positions)

    def attend(q, k, v):
        return flash_attention(q, k, v, causal=True, block_q=64, block_k=64, **kw)[0]

    fn = jax.jit(attend) if kernel == "forward" else jax.jit(jax.grad(
        lambda q, k, v: jnp.sum(attend(q, k, v)), argnums=(0, 1, 2)))
    with optimised_compilation():
        hlo = fn.lower(q, k, v).compile().as_text()
    bodies = _loop_bodies(hlo, 8)
    assert bodies, "no loop over the 8 outer blocks found"
    for body in bodies:
        products = [line for line in body if " dot(" in line or "kind=kCustom" in line]
        assert not products, products
    # And the results are right.
    expected = jax.jit(lambda q, k, v: plain_attention(q, k, v, causal=True, **kw)[0])(q, k, v)
    assert_close(jax.jit(attend)(q, k, v), expected)
