"""The accelerator set (marker `accelerator`): every public feature once against its
reference, on whatever backend JAX finds, compiled, at the stated matmul precision.

On a TPU or GPU, in one process (the chip takes one):

    python -m pytest -o addopts="" -p no:cacheprovider -m accelerator \\
        --jaxtyping-packages=eqx_flash,beartype.beartype tests

It runs on CPU in the ordinary suite too. Every comparison runs under
`jax.default_matmul_precision(PRECISION)` ("highest"; an autouse fixture below, besides
the session-wide setting of `conftest.py`) with the tolerance table widened by the
backend's one factor (`eqx_flash.testing.tolerance_for`). The problems are big enough to
run several blocks along each sequence (explicit `BLOCKS`, plus one call at the default
blocks at seq 2048) yet cheap on CPU; few distinct shapes, since each new program costs
seconds to compile on a TPU. The kernel tests run over `FAMILIES`; the rest take
`flash_attention`'s own choice (on a TPU the Pallas kernels wherever they cover the call).
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import PRECISION, assert_close, assert_lse_close, at_precision, seeded_normal
from jax.sharding import Mesh

import eqx_flash
from eqx_flash.testing import AttentionInputs, PrefixLM, RelativeBiasTable, check_attention

pytestmark = pytest.mark.accelerator

# The kernel families the kernel tests run over, passed as `kernels=` when not None (None:
# flash_attention's own choice). On a TPU both families, compiled; elsewhere the default
# (the Pallas kernels run interpreted off a TPU: `tests/test_pallas_tpu.py` covers them).
FAMILIES = ["xla", "pallas_tpu"] if jax.default_backend() == "tpu" else [None]

BATCH, HEADS, KV_HEADS, SEQ_Q, SEQ_K, DIM = 2, 4, 2, 512, 640, 64
# Several blocks along both sequences on every backend (the defaults would make one block
# of these lengths); multiples of 128, as TPU tiles like.
BLOCKS = {"block_q": 128, "block_k": 128}


@pytest.fixture(autouse=True)
def _stated_precision():
    with at_precision(PRECISION):
        yield


def flash(family: str | None):
    """`flash_attention`, with `kernels=family` unless `family` is None."""
    if family is None:
        return eqx_flash.flash_attention
    return functools.partial(eqx_flash.flash_attention, kernels=family)


def problem(dtype=jnp.float32, seq_q=SEQ_Q, seq_k=SEQ_K, batch=BATCH, **kwargs):
    """q `(batch, 4, seq_q, 64)`, k and v `(batch, 2, seq_k, 64)` (grouped-query) from
    fixed NumPy seeds, with `kwargs` (the block sizes `BLOCKS` unless given)."""
    q = seeded_normal(0, (batch, HEADS, seq_q, DIM), dtype)
    k = seeded_normal(1, (batch, KV_HEADS, seq_k, DIM), dtype)
    v = seeded_normal(2, (batch, KV_HEADS, seq_k, DIM), dtype)
    return AttentionInputs(q, k, v, {**BLOCKS, **kwargs})


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(100 + seed)


def _segments(seq: int) -> jax.Array:
    """Four packed documents of uneven lengths, the same fractions of q and of k."""
    edges = np.array([0.0, 0.1, 0.45, 0.8]) * seq
    return jnp.asarray(np.searchsorted(edges, np.arange(seq), side="right") - 1,
                       jnp.int32)[None].repeat(BATCH, axis=0)


def _features() -> dict[str, dict]:
    """One set of keyword arguments per feature (with `BLOCKS` added by `problem`)."""
    rng = _rng(0)
    relative = RelativeBiasTable(
        jnp.asarray(0.3 * rng.standard_normal((HEADS, SEQ_Q + SEQ_K - 1)), jnp.float32), SEQ_K)
    prefix = PrefixLM(64, SEQ_K - SEQ_Q)
    return {
        "key mask": {"mask": jnp.asarray(rng.random((BATCH, SEQ_K)) < 0.9)},
        "dense mask, causal window": {
            "attn_mask": jnp.asarray(rng.random((SEQ_Q, SEQ_K)) < 0.8), "causal": True,
            "window": (200, 0)},
        "segment ids": {"q_segment_ids": _segments(SEQ_Q), "kv_segment_ids": _segments(SEQ_K)},
        "lengths, causal": {"q_lengths": jnp.array([SEQ_Q, 300]),
                            "kv_lengths": jnp.array([SEQ_K, 333]), "causal": True},
        "positions, causal": {  # a chunk of 512 queries after 128 cached keys
            "q_positions": jnp.arange(128, 128 + SEQ_Q)[None].repeat(BATCH, axis=0),
            "kv_positions": jnp.arange(SEQ_K)[None].repeat(BATCH, axis=0), "causal": True},
        "softcap, scale": {"softcap": 5.0, "scale": 0.3},
        "bias": {
            "bias": jnp.asarray(rng.standard_normal((HEADS, SEQ_Q, SEQ_K)), jnp.float32)},
        "ALiBi per sequence, causal": {  # slopes (batch, heads)
            "alibi_slopes": jnp.asarray(2.0 ** -np.arange(1.0, HEADS + 1)
                                        * np.array([[1.0], [0.5]]), jnp.float32),
            "causal": True},
        "sinks": {"sinks": jnp.asarray([-1.0, 0.0, 1.0, 2.0], jnp.float32), "causal": True},
        "dropout": {"dropout_rate": 0.1, "key": jax.random.key(7)},
        "score_mod, mask_mod, block_mask": {
            "score_mod": relative, "mask_mod": prefix,
            "block_mask": eqx_flash.make_block_mask(prefix, (BATCH,), HEADS, SEQ_Q, SEQ_K,
                                                    kv_heads=KV_HEADS, **BLOCKS)},
    }


FEATURES = _features()


@pytest.mark.parametrize("family", FAMILIES)
def test_values_lse_grads_jvp_hvp_and_max_scores(family):
    """Causal grouped-query attention with unequal lengths: out, lse, the gradients of q,
    k, v, `jax.jvp`, a Hessian-vector product and the max scores. (The Pallas family's
    second order runs the xla family's kernels, so on a TPU its case checks theirs too:
    the xla case leaves it out, a program that took ~15 s to compile there.)"""
    check_attention(flash(family), problem(causal=True), jvp=True,
                    second_order=family != "xla", max_scores=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_default_blocks_at_seq_2048(family):
    inputs = problem(seq_q=2048, seq_k=2048, batch=1)
    check_attention(flash(family), AttentionInputs(inputs.q, inputs.k, inputs.v))


# On a TPU the XLA family (the fallback; every feature of it is checked on CPU in the
# ordinary suite) runs the two features whose code differs most from the plain case:
# each of its programs took ~10 s to compile there (2026-12-07, 2026-12-08), and the set
# has 6 minutes.
XLA_FEATURES_ON_ACCELERATORS = ("dropout", "score_mod, mask_mod, block_mask")


@pytest.mark.parametrize("family, feature", [
    (family, feature) for family in FAMILIES for feature in FEATURES
    if family != "xla" or feature in XLA_FEATURES_ON_ACCELERATORS])
def test_feature_values_and_grads(family, feature):
    """Each option's out, lse and gradients (of q, k, v and of its own floating arrays:
    the bias, the ALiBi slopes, the sinks, the score_mod's table). A family asked for
    explicitly that does not cover an option raises `NotImplementedError` saying so (with
    `kernels=None` the call falls back): checked, then skipped with that reason."""
    inputs = problem(**FEATURES[feature])
    if family is not None:
        chosen, reason = eqx_flash.kernel_family(inputs.q, inputs.k, inputs.v,
                                                 **inputs.kwargs, kernels=family)
        if chosen is None:
            with pytest.raises(NotImplementedError, match=family):
                flash(family)(inputs.q, inputs.k, inputs.v, **inputs.kwargs)
            pytest.skip(reason)
    check_attention(flash(family), inputs)


def test_jvp_through_options():
    options = {**FEATURES["lengths, causal"], "softcap": 5.0,
               **FEATURES["ALiBi per sequence, causal"], **FEATURES["bias"]}
    check_attention(eqx_flash.flash_attention, problem(**options), grads=False, jvp=True)


def test_bfloat16():
    inputs = problem(jnp.bfloat16, causal=True)
    out = eqx_flash.flash_attention(inputs.q, inputs.k, inputs.v, **inputs.kwargs)[0]
    assert out.dtype == jnp.bfloat16
    check_attention(eqx_flash.flash_attention, inputs)


def test_merge_attention_of_key_halves():
    inputs = problem()
    q, k, v = inputs.q, inputs.k, inputs.v
    half = SEQ_K // 2
    parts = [eqx_flash.flash_attention(q, k[..., s, :], v[..., s, :], **BLOCKS)
             for s in (slice(0, half), slice(half, SEQ_K))]
    out, lse = jax.jit(eqx_flash.merge_attention)(jnp.stack([p[0] for p in parts]),
                                                  jnp.stack([p[1] for p in parts]))
    ref, ref_lse = jax.jit(eqx_flash.plain_attention)(q, k, v)
    assert_close(out, ref, name="out")
    assert_lse_close(lse, ref_lse)


def _out_and_grads(fn, *args):
    """`fn(*args)` and the gradients of a fixed random linear function of it with respect
    to every argument (floating leaves of PyTrees), as one compiled program."""
    shape = eqx.filter_eval_shape(fn, *args).shape
    weights = seeded_normal(5, shape)

    def loss(args):
        out = fn(*args)
        return jnp.sum(out.astype(jnp.float32) * weights), out

    grads, out = eqx.filter_jit(eqx.filter_grad(loss, has_aux=True))(args)
    return out, grads


def _assert_trees_close(got, expected, kind="grad", scale=1.0):
    leaves, ref_leaves = jax.tree.leaves(got), jax.tree.leaves(expected)
    assert len(leaves) == len(ref_leaves)
    for a, b in zip(leaves, ref_leaves, strict=True):
        assert_close(a, b, kind=kind, scale=scale * max(1.0, float(jnp.max(jnp.abs(b)))))


def test_sharded_flash_attention_on_every_device():
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("seq",))
    seq = 256 * len(devices)  # zigzag: two chunks per device
    inputs = problem(seq_q=seq, seq_k=seq)

    def sharded(q, k, v):
        return eqx_flash.sharded_flash_attention(q, k, v, mesh=mesh, seq_axis="seq",
                                                 causal=True, **BLOCKS)[0]

    def plain(q, k, v):
        return eqx_flash.plain_attention(q, k, v, causal=True)[0]

    out, grads = _out_and_grads(sharded, inputs.q, inputs.k, inputs.v)
    ref, ref_grads = _out_and_grads(plain, inputs.q, inputs.k, inputs.v)
    assert_close(out, ref, name="out")
    _assert_trees_close(grads, ref_grads)


def test_flash_multihead_attention_against_equinox():
    """Outputs and the gradients of every weight and input, against
    `eqx.nn.MultiheadAttention` with the same weights and a causal mask."""
    mha = eqx.nn.MultiheadAttention(HEADS, HEADS * DIM, key=jax.random.key(0))
    layer = eqx_flash.FlashMultiheadAttention.from_eqx(mha, causal=True, **BLOCKS)
    x = seeded_normal(6, (SEQ_Q, HEADS * DIM))
    causal = jnp.tril(jnp.ones((SEQ_Q, SEQ_Q), bool))
    out, grads = _out_and_grads(lambda m, x: m(x, x, x), layer, x)
    ref, ref_grads = _out_and_grads(lambda m, x: m(x, x, x, causal), mha, x)
    assert_close(out, ref, name="out")
    _assert_trees_close(grads, ref_grads)


def test_flash_attention_module():
    inputs = problem(causal=True, softcap=5.0)
    q, k, v = (x[0] for x in (inputs.q, inputs.k, inputs.v))  # one example: vmap for more
    module = eqx_flash.FlashAttention(causal=True, softcap=5.0, **BLOCKS)
    out = eqx.filter_jit(lambda m, q, k, v: m(q, k, v, inference=True))(module, q, k, v)
    ref, _ = jax.jit(functools.partial(eqx_flash.plain_attention, causal=True,
                                       softcap=5.0))(q, k, v)
    assert_close(out, ref, name="out")


def test_decode_with_a_kv_cache_equals_full_attention():
    """Prefill 504 tokens, then 8 steps of one token in a `jax.lax.scan` (flash-decoding
    against the cache), against the layer on the whole sequence."""
    layer = eqx_flash.FlashMultiheadAttention(HEADS, HEADS * DIM, num_kv_heads=KV_HEADS,
                                              causal=True, key=jax.random.key(1), **BLOCKS)
    x = seeded_normal(7, (SEQ_Q, HEADS * DIM))
    prefill = SEQ_Q - 8

    @eqx.filter_jit
    def decode(layer, x):
        first, cache = layer.decode(x[:prefill], layer.init_cache(max_len=SEQ_K))
        step = lambda cache, x_t: layer.decode(x_t[None], cache)[::-1]  # noqa: E731
        cache, rest = jax.lax.scan(step, cache, x[prefill:])
        return jnp.concatenate([first, rest[:, 0]]), cache.length

    out, length = decode(layer, x)
    assert int(length) == SEQ_Q
    assert_close(out, eqx.filter_jit(lambda m, x: m(x, x, x))(layer, x), name="decoded")


def test_dot_product_attention_against_jax_nn():
    q = jnp.swapaxes(problem().q, 1, 2)  # jax.nn's (batch, seq, heads, dim)
    k, v = (jnp.swapaxes(x, 1, 2) for x in (problem().k, problem().v))
    bias = seeded_normal(8, (BATCH, HEADS, SEQ_Q, SEQ_K))

    def ours(q, k, v, bias):
        return eqx_flash.dot_product_attention(q, k, v, bias, is_causal=True)

    def theirs(q, k, v, bias):
        return jax.nn.dot_product_attention(q, k, v, bias, is_causal=True,
                                            implementation="xla")

    out, grads = _out_and_grads(ours, q, k, v, bias)
    ref, ref_grads = _out_and_grads(theirs, q, k, v, bias)
    assert_close(out, ref, name="out")
    _assert_trees_close(grads, ref_grads)


def test_flash_attn_func_and_varlen_func():
    """FlashAttention-2's entry points: `flash_attn_func` on `(batch, seq, heads, dim)`,
    `flash_attn_varlen_func` on three packed sequences, each causal within its sequence,
    against `plain_attention` with the sequences as segments and positions."""
    inputs = problem()
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (inputs.q, inputs.k, inputs.v))
    out = jax.jit(functools.partial(eqx_flash.flash_attn_func, causal=True))(q, k, v)
    ref, _ = jax.jit(functools.partial(eqx_flash.plain_attention, causal=True))(
        inputs.q, inputs.k, inputs.v)
    assert_close(out, jnp.swapaxes(ref, 1, 2), name="flash_attn_func")

    lengths = np.array([100, 256, SEQ_Q - 356])
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    ids = jnp.asarray(np.repeat(np.arange(3), lengths), jnp.int32)
    positions = jnp.asarray(np.concatenate([np.arange(n) for n in lengths]), jnp.int32)
    packed = [x[0, :, :SEQ_Q] for x in (inputs.q, inputs.k, inputs.v)]  # (heads, seq, dim)

    def varlen(q, k, v):
        q, k, v = (jnp.swapaxes(x, 0, 1) for x in (q, k, v))  # (total, heads, dim)
        out = eqx_flash.flash_attn_varlen_func(q, k, v, cu, cu, 256, 256, causal=True)
        return jnp.swapaxes(out, 0, 1)

    def segments(q, k, v):
        return eqx_flash.plain_attention(q, k, v, causal=True, q_segment_ids=ids,
                                         kv_segment_ids=ids, q_positions=positions,
                                         kv_positions=positions)[0]

    out, grads = _out_and_grads(varlen, *packed)
    ref, ref_grads = _out_and_grads(segments, *packed)
    assert_close(out, ref, name="flash_attn_varlen_func")
    _assert_trees_close(grads, ref_grads)


def test_flax_attention_against_jax_nn():
    """`flax_attention` needs no Flax to run (eqx_flash never imports it): Flax's layout
    `[batch..., length, heads, depth]` with two batch axes and a mask, against jax.nn."""
    inputs = problem(seq_k=SEQ_Q)
    q, k, v = (jnp.swapaxes(x, 1, 2)[:, None] for x in (inputs.q, inputs.k, inputs.v))
    k, v = (jnp.repeat(x, HEADS // KV_HEADS, axis=-2) for x in (k, v))  # Flax: no GQA
    mask = jnp.asarray(_rng(1).random((SEQ_Q, SEQ_Q)) < 0.8)[None, None, None]
    out = jax.jit(functools.partial(eqx_flash.flax_attention, deterministic=True))(
        q, k, v, mask=mask)
    ref = jax.jit(functools.partial(jax.nn.dot_product_attention, implementation="xla"))(
        q[:, 0], k[:, 0], v[:, 0], mask=mask[0])
    assert_close(out[:, 0], ref, name="out")
