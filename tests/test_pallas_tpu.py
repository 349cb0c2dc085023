"""The Pallas TPU family: the same answers as the reference, on any host.

Off a TPU, `kernels="pallas_tpu"` runs the very kernels a TPU compiles, in Pallas'
interpreter (slow: small shapes here); `tests/test_pallas_tpu_lowering.py` proves, on any
host, that they lower to Mosaic kernels.
What the family does not cover raises with an explicit request and falls back with
`kernels=None`; `eqx_flash.kernel_family` says which family a call gets and why.
"""

import dataclasses
import functools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_close,
    assert_lse_close,
    capped_distance,
    examples,
    qkv,
    sliding_prefix,
)
from hypothesis import given
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import eqx_flash
from eqx_flash import flash_attention, plain_attention
from eqx_flash._core.config import KernelConfig
from eqx_flash._core.options import Window
from eqx_flash._kernels.pallas_tpu import _plan, _relative
from eqx_flash._kernels.pallas_tpu._plan import FIRST, FLAG, LAST, backward_plan, forward_plan
from eqx_flash._kernels.schedule import static_flags
from eqx_flash._mods.block_mask import EMPTY, FULL, PARTIAL, KnownSummary
from eqx_flash.testing import attention_inputs, check_attention

# Compiled on a TPU, interpreted elsewhere. The accelerator set (`pytest -m accelerator`,
# under 6 minutes on a TPU) takes the cases `tests/test_accelerator.py` does not: the
# kernels' own paths (row tiles, the relative term, split mods with traced arrays, the
# statistics written only where read, the batch-inner bias cotangent, non-finite values,
# bf16, transforms). Each case compiles several programs, ~3-30 s on a TPU: one per path.
ACCELERATOR = pytest.mark.accelerator


def _marked(values, chosen):
    """`values` as parameters, those in `chosen` in the accelerator set."""
    return [pytest.param(x, marks=ACCELERATOR) if x in chosen else x for x in values]

PALLAS = dict(kernels="pallas_tpu")
BLOCKS = dict(block_q=64, block_k=128)


def _loss(attention, q, k, v, **kwargs):
    out, lse = attention(q, k, v, **kwargs)
    w = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
    finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return jnp.sum(out.astype(jnp.float32) * w) + 0.3 * jnp.sum(finite)


def _compare(q, k, v, dtype=jnp.float32, grads=True, **kwargs):
    """Values, lse and gradients of q, k, v against `plain_attention`."""
    pallas = functools.partial(flash_attention, **PALLAS, **BLOCKS)
    out, lse = jax.jit(lambda q, k, v: pallas(q, k, v, **kwargs))(q, k, v)
    ref_out, ref_lse = jax.jit(lambda q, k, v: plain_attention(q, k, v, **kwargs))(q, k, v)
    assert_close(out, ref_out, dtype, name="out")
    assert_lse_close(lse, ref_lse, dtype)
    if not grads:
        return
    grad = functools.partial(jax.grad, argnums=(0, 1, 2))
    got = jax.jit(grad(lambda q, k, v: _loss(pallas, q, k, v, **kwargs)))(q, k, v)
    want = jax.jit(grad(lambda q, k, v: _loss(plain_attention, q, k, v, **kwargs)))(q, k, v)
    for name, a, b in zip("qkv", got, want, strict=True):
        assert_close(a, b, dtype, kind="grad", name=f"d{name}")


CASES = {
    "full": dict(),
    "causal": dict(causal=True),
    "window": dict(window=(50, 10)),
    "causal softcap": dict(causal=True, softcap=2.0),
    "sinks": dict(causal=True, sinks=jnp.linspace(-1.0, 1.0, 4)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_options_against_reference(name):
    """GQA (4 query heads on 2 kv heads), lengths that are not block multiples."""
    q, k, v = qkv(0, (2, 4, 200, 32), (2, 2, 300, 32))
    _compare(q, k, v, **CASES[name])


def test_masks_against_reference():
    q, k, v = qkv(1, (2, 2, 160, 32), (2, 2, 256, 32))
    key = jax.random.key(2)
    mask = jax.random.bernoulli(key, 0.7, (2, 256))
    ids_q = jnp.sort(jax.random.randint(key, (2, 160), 0, 3), axis=-1)
    ids_k = jnp.sort(jax.random.randint(jax.random.fold_in(key, 1), (2, 256), 0, 3), axis=-1)
    _compare(q, k, v, mask=mask, causal=True)
    _compare(q, k, v, q_segment_ids=ids_q, kv_segment_ids=ids_k, causal=True)
    _compare(q, k, v, q_lengths=jnp.array([160, 40]), kv_lengths=jnp.array([256, 10]),
             causal=True)
    pairs = jax.random.bernoulli(key, 0.6, (2, 1, 160, 256)).at[1, 0, 5].set(False)
    _compare(q, k, v, attn_mask=pairs, causal=True)  # int8 blocks; an empty row
    pos_q = jnp.tile(jnp.arange(160)[None] + 96, (2, 1))
    pos_k = jnp.tile(jnp.arange(256)[None], (2, 1))
    _compare(q, k, v, q_positions=pos_q, kv_positions=pos_k, window=(40, 0))


@pytest.mark.parametrize("options", [
    dict(causal=True),
    pytest.param(dict(causal=True, mask=jnp.arange(1200) % 7 != 3), marks=ACCELERATOR),
    dict(window=(600, 20), q_segment_ids=jnp.arange(1100) // 450,
         kv_segment_ids=jnp.arange(1200) // 490),
], ids=["causal", "causal and key mask", "window and segment ids"])
def test_blocks_the_band_crosses_in_row_tiles(options):
    """A query block of 1024 rows is taken in tiles of 512 rows where the band crosses
    it (`Tuning.partial_rows`): tiles it empties skipped, whole ones unmasked — with
    GQA (two query heads per tile) and bottom-right alignment (1200 keys, 1100 queries)."""
    q, k, v = qkv(9, (1, 4, 1100, 32), (1, 2, 1200, 32))
    pallas = functools.partial(flash_attention, **PALLAS, block_q=1024, block_k=256)
    out, lse = jax.jit(lambda q, k, v: pallas(q, k, v, **options))(q, k, v)
    ref_out, ref_lse = jax.jit(lambda q, k, v: plain_attention(q, k, v, **options))(q, k, v)
    assert_close(out, ref_out, jnp.float32, name="out")
    assert_lse_close(lse, ref_lse, jnp.float32)


ALIBI = {
    "per sequence, causal softcap": dict(slopes=(2, 4), causal=True, softcap=3.0),
    "positions, window": dict(slopes=(4,), window=(60, 0), positions=True),
}


@pytest.mark.parametrize("name", list(ALIBI))
def test_alibi_against_reference(name):
    """ALiBi computed in the kernels from the tile's indices (or the given positions):
    values, lse, the gradients of q, k, v and of the slopes, and a jvp along q and the
    slopes, against `plain_attention` (GQA 4/2; 200 queries on 300 keys)."""
    case = dict(ALIBI[name])
    shape, positions = case.pop("slopes"), case.pop("positions", False)
    q, k, v = qkv(12, (2, 4, 200, 32), (2, 2, 300, 32))
    slopes = jnp.linspace(0.05, 0.6, int(np.prod(shape))).reshape(shape)
    if positions:  # a chunk of queries after 100 cached keys, in two packed rows
        case.update(q_positions=jnp.tile(jnp.arange(100, 300)[None], (2, 1)),
                    kv_positions=jnp.tile(jnp.arange(300)[None], (2, 1)))
    _compare_with_array(q, k, v, case, "alibi_slopes", slopes, 0.3 * slopes)


def test_the_alibi_module_runs_in_the_kernels():
    """An `ALiBi` module given as the `score_mod` runs as the kernels' own ALiBi (its
    slopes and its offset, here top-left against bottom-right causal): values, lse and
    the gradients of q, k, v and of the module's slopes against `plain_attention`
    evaluating the module itself."""
    q, k, v = qkv(25, (2, 4, 200, 32), (2, 2, 300, 32))
    alibi = eqx_flash.ALiBi(4)
    assert eqx_flash.kernel_family(q, k, v, score_mod=alibi, kernels="pallas_tpu")[0] == (
        "pallas_tpu")

    def run(attention, alibi, q, k, v):
        def loss(alibi, q, k, v):
            return _loss(attention, q, k, v, score_mod=alibi, causal=True)

        out, lse = attention(q, k, v, score_mod=alibi, causal=True)
        return out, lse, jax.grad(loss, argnums=(0, 1, 2, 3))(alibi, q, k, v)

    pallas = functools.partial(flash_attention, **PALLAS, **BLOCKS)
    got = jax.jit(functools.partial(run, pallas))(alibi, q, k, v)
    want = jax.jit(functools.partial(run, plain_attention))(alibi, q, k, v)
    assert_close(got[0], want[0], name="out")
    assert_lse_close(got[1], want[1], jnp.float32)
    for name, a, b in zip(("d_slopes", "dq", "dk", "dv"), got[2], want[2], strict=True):
        a, b = (x.slopes if name == "d_slopes" else x for x in (a, b))
        assert_close(a, b, kind="grad", name=name)


BIASES = {
    "per query head and pair, window": dict(shape=(4, 200, 300), window=(60, 0)),
    "per sequence and key, causal softcap": dict(shape=(2, 1, 1, 300), causal=True,
                                                 softcap=3.0),
}  # (a bias per query: beside a relative term, `RELATIVE`)


@pytest.mark.parametrize("name", list(BIASES))
def test_bias_against_reference(name):
    """A bias read block by block in each kernel (transposed for the dk/dv kernel), its
    cotangent from the dq kernel summed where it broadcasts: values, lse, the gradients
    of q, k, v and of the bias, and a jvp along q and the bias, against
    `plain_attention` (GQA 4/2; 200 queries on 300 keys; blocks the band leaves empty
    keep a zero cotangent)."""
    case = dict(BIASES[name])
    bias = jax.random.normal(jax.random.key(15), case.pop("shape"))
    q, k, v = qkv(16, (2, 4, 200, 32), (2, 2, 300, 32))
    _compare_with_array(q, k, v, case, "bias", bias, jnp.sin(bias))

@ACCELERATOR
def test_a_bias_shared_by_the_batch_sums_its_cotangent_in_the_kernel():
    """A bias the batch broadcasts over (here bfloat16, per query head and pair) has its
    cotangent summed over the batch inside the dq kernel, from a float32 accumulator,
    and written in the bias's dtype: the reference's gradient of the same bias (batch
    3; causal, so some blocks are never visited and keep a zero cotangent)."""
    q, k, v = qkv(17, (3, 4, 200, 32), (3, 2, 300, 32))
    bias = jax.random.normal(jax.random.key(18), (4, 200, 300)).astype(jnp.bfloat16)

    def grads(attention):
        return jax.jit(jax.grad(lambda q, b: _loss(attention, q, k, v, bias=b, causal=True),
                                argnums=(0, 1)))(q, bias)

    (dq, d_bias), (ref_dq, ref_d_bias) = grads(functools.partial(
        flash_attention, **PALLAS, **BLOCKS)), grads(plain_attention)
    assert d_bias.dtype == jnp.bfloat16 and d_bias.shape == bias.shape
    assert_close(d_bias, ref_d_bias, jnp.bfloat16, kind="grad", name="d_bias")
    assert_close(dq, ref_dq, kind="grad", name="dq")


def _compare_with_array(q, k, v, case, argument, x, tangent):
    """`flash_attention(..., argument=x)` with the Pallas kernels against
    `plain_attention`: values, lse, the gradients of q, k, v and of `x` (in its own
    shape), and a jvp along q and `x` (tangents `cos(q)` and `tangent`)."""
    pallas = functools.partial(flash_attention, **case, **PALLAS, **BLOCKS)
    reference = functools.partial(plain_attention, **case)
    out, lse = jax.jit(lambda x: pallas(q, k, v, **{argument: x}))(x)
    ref_out, ref_lse = jax.jit(lambda x: reference(q, k, v, **{argument: x}))(x)
    assert_close(out, ref_out, name="out")
    assert_lse_close(lse, ref_lse, jnp.float32)

    def grads(attention):
        return jax.jit(jax.grad(lambda q, k, v, x: _loss(attention, q, k, v, **{argument: x}),
                                argnums=(0, 1, 2, 3)))(q, k, v, x)

    for label, a, b in zip(("dq", "dk", "dv", f"d_{argument}"), grads(pallas),
                           grads(reference), strict=True):
        assert a.shape == b.shape
        assert_close(a, b, kind="grad", name=label)

    def jvp(attention):
        return jax.jit(lambda q, x: jax.jvp(lambda q, x: attention(q, k, v, **{argument: x}),
                                            (q, x), (jnp.cos(q), tangent))[1])(q, x)

    (t_out, t_lse), (r_out, r_lse) = jvp(pallas), jvp(reference)
    assert_close(t_out, r_out, kind="grad", name="jvp out")
    assert_close(jnp.where(jnp.isfinite(lse), t_lse, 0.0),
                 jnp.where(jnp.isfinite(lse), r_lse, 0.0), kind="grad", name="jvp lse")

def test_score_and_mask_mods_against_reference():
    """A `score_mod` and a `mask_mod` evaluated in the kernels, per query head (GQA 4/2;
    200 queries on 300 keys): values, lse and the gradients of q, k, v through the fused
    backward; with a trained bias (the dq and dk/dv kernels) its gradient and a jvp too;
    rows the mask_mod empties give 0 and -inf."""
    q, k, v = qkv(21, (2, 4, 200, 32), (2, 2, 300, 32))
    _compare(q, k, v, score_mod=capped_distance, mask_mod=sliding_prefix, softcap=3.0)
    bias = jax.random.normal(jax.random.key(22), (200, 1))
    case = dict(score_mod=capped_distance, mask_mod=sliding_prefix, causal=True)
    _compare_with_array(q, k, v, case, "bias", bias, jnp.sin(bias))


@pytest.mark.parametrize("rows, cols", [
    (128, 128), pytest.param(256, 384, marks=ACCELERATOR), (384, 128)])
def test_toeplitz_term_and_its_adjoint(rows, cols):
    """The relative term's tile `T[r, c] = w[c - r + rows]`, built in a kernel from
    rotations and read from the window's diagonals, and its adjoint (each diagonal's sum
    of a cotangent) against index arithmetic."""
    width = rows + cols
    w = jnp.broadcast_to(jax.random.normal(jax.random.key(1), (1, width)), (8, width))
    ds = jax.random.normal(jax.random.key(2), (rows, cols))

    def kernel(w_ref, f_ref, ds_ref, t_ref, read_ref, dw_ref, acc_ref):
        t_ref[...] = _relative.toeplitz(w_ref[...], rows, cols)
        read_ref[...] = _relative.from_diagonals(f_ref, 0, 0, rows, cols)
        acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)
        _relative.add_to_diagonals(acc_ref, 0, 0, ds_ref[...])
        dw_ref[...] = jnp.broadcast_to(_relative.sum_diagonals(acc_ref, 0), (8, width))

    t, read, dw = pl.pallas_call(
        kernel, interpret=jax.default_backend() != "tpu",
        out_shape=(jax.ShapeDtypeStruct((rows, cols), jnp.float32),
                   jax.ShapeDtypeStruct((rows, cols), jnp.float32),
                   jax.ShapeDtypeStruct((8, width), jnp.float32)),
        scratch_shapes=[pltpu.VMEM((1, 128, width), jnp.float32)])(
        w, _relative.diagonals(w[:1]), ds)
    index = jnp.arange(cols)[None, :] - jnp.arange(rows)[:, None] + rows
    np.testing.assert_array_equal(t, w[0][index])
    np.testing.assert_array_equal(read, w[0][index])
    expected = jnp.zeros(width).at[index].add(ds)
    np.testing.assert_allclose(dw[0], expected, rtol=1e-5, atol=1e-5)


class _Clipped(eqx_flash.RelativeScoreMod):
    """A learned bias per head and clipped offset, in both directions."""

    table: jax.Array

    def bias(self, head, relative):
        return 2.0 * self.table[jnp.clip(relative + 8, 0, 16), head]


RELATIVE = {
    "T5 buckets, causal softcap": dict(causal=True, softcap=3.0),
    "T5 buckets, built from rotations": dict(causal=True, rotations=True),
    "clipped table, window, beside a bias": dict(window=(60, 20), bias=(200, 1),
                                                 module="clipped"),
    # Most tiles' windows lie past max_distance (long constant stretches of the vector).
    "T5 buckets, long sequences": dict(shapes=((1, 4, 520, 32), (1, 2, 700, 32))),
}


@pytest.mark.parametrize("name", _marked(RELATIVE, {"T5 buckets, causal softcap"}))
def test_relative_score_mods_against_reference(name, monkeypatch):
    """A `RelativeScoreMod` built in the kernels as a Toeplitz term of its bias vector:
    values, lse, the gradients of q, k, v and of its table (the dk/dv kernel's window
    cotangents), and a jvp along q and the table, against `plain_attention` calling the
    module per pair (GQA 4/2; 200 queries on 300 keys)."""
    case = dict(RELATIVE[name])
    if case.pop("rotations", False):  # past the diagonals' VMEM budget
        monkeypatch.setattr(_relative, "MAX_DIAGONAL_BYTES", 0)
    q, k, v = qkv(31, *case.pop("shapes", ((2, 4, 200, 32), (2, 2, 300, 32))))
    if case.pop("module", None) == "clipped":
        module: eqx.Module = _Clipped(jax.random.normal(jax.random.key(32), (17, 4)))
    else:
        module = eqx_flash.RelativePositionBias(4, num_buckets=16, max_distance=64,
                                                key=jax.random.key(33))
        module = eqx.tree_at(lambda m: m.table, module, 10.0 * module.table)
    if "bias" in case:
        case["bias"] = jax.random.normal(jax.random.key(34), case["bias"])
    _compare_module(q, k, v, module, case)


def _compare_module(q, k, v, module, case):
    """`flash_attention(..., score_mod=module)` with the Pallas kernels against
    `plain_attention`: values, lse, the gradients of the module's arrays and of q, k,
    v, and a jvp along q and the module (tangents `cos` of each)."""
    assert eqx_flash.kernel_family(q, k, v, score_mod=module, kernels="pallas_tpu",
                                   **case)[0] == "pallas_tpu"
    pallas = functools.partial(flash_attention, **case, **PALLAS, **BLOCKS)
    _compare_module_call(pallas, functools.partial(plain_attention, **case), module, q, k, v)


def _compare_module_call(attention, reference, module, q, k, v):
    """`attention(q, k, v, score_mod=module)` against `reference` called the same way:
    values, lse, the gradients of the module's arrays and of q, k, v, and a jvp along q
    and the module (tangents `cos` of each)."""

    def run(attention, module, q):
        out, lse = attention(q, k, v, score_mod=module)
        grads = jax.grad(lambda m, q, k, v: _loss(attention, q, k, v, score_mod=m),
                         argnums=(0, 1, 2, 3))(module, q, k, v)
        tangent = jax.tree.map(jnp.cos, module)
        _, (t_out, t_lse) = jax.jvp(lambda m, q: attention(q, k, v, score_mod=m),
                                    (module, q), (tangent, jnp.cos(q)))
        return out, lse, grads, t_out, jnp.where(jnp.isfinite(lse), t_lse, 0.0)

    got = jax.jit(functools.partial(run, attention))(module, q)
    want = jax.jit(functools.partial(run, reference))(module, q)
    assert_close(got[0], want[0], name="out")
    assert_lse_close(got[1], want[1], jnp.float32)
    leaves = jax.tree.leaves(want[2])
    labels = [f"d_module[{n}]" for n in range(len(leaves) - 3)] + ["dq", "dk", "dv"]
    for label, a, b in zip(labels, jax.tree.leaves(got[2]), leaves, strict=True):
        assert_close(a, b, kind="grad", name=label)
    assert_close(got[3], want[3], kind="grad", name="jvp out")
    assert_close(got[4], want[4], kind="grad", name="jvp lse")


def test_relative_offsets_at_a_pieces_global_indices():
    """`_seen_offsets`: local offsets as the module sees them on a ring's piece, whose
    global indices step by one (contiguous, zigzag) or by the ring's size (striped)."""
    from eqx_flash._core.operands import Operands

    local = jnp.arange(-4, 6, dtype=jnp.int32)
    np.testing.assert_array_equal(_relative._seen_offsets(Operands(), local), local)
    for step, q0, k0 in ((1, 256, 0), (4, 3, 1)):  # zigzag's second piece; striped
        ops = Operands(q_index=(q0 + step * jnp.arange(8)).reshape(1, 1, 1, -1, 1),
                       kv_index=(k0 + step * jnp.arange(8)).reshape(1, 1, 1, 1, -1))
        i, j = 2, 5  # a query and a key of the piece, offset j - i locally
        seen = _relative._seen_offsets(ops, jnp.asarray([j - i]))
        assert int(seen[0]) == (k0 + step * j) - (q0 + step * i)


class _OffsetTable(eqx.Module):
    """A learned bias per head and clipped offset written as a plain score_mod (not a
    `RelativeScoreMod`), as FlexAttention's examples write it, `q_idx - kv_idx` way."""

    table: jax.Array

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.table[h, jnp.clip(q_idx - kv_idx + 8, 0, 16)] + score


def test_lookups_by_the_offset_run_as_relative_terms():
    """A score_mod `score + table[h, clip(kv_idx - q_idx)]` is recognised
    (`_mods.offset_lookup`) and runs in the kernels as a `RelativeScoreMod`'s term: a
    module with a trained table (values, lse, the table's and q, k, v's gradients, a
    jvp) and a plain function closing over one; a lookup that also reads the batch
    index, or a product with the scores, is not that form and stays on the pure-JAX
    kernels, named."""
    q, k, v = qkv(41, (2, 4, 200, 32), (2, 2, 300, 32))
    module = _OffsetTable(jax.random.normal(jax.random.key(42), (4, 17)))
    _compare_module(q, k, v, module, dict(causal=True, softcap=3.0))
    table = module.table

    def plain(score, b, h, q_idx, kv_idx):
        return score + table[h, jnp.clip(kv_idx - q_idx + 8, 0, 16)]

    assert eqx_flash.kernel_family(q, k, v, score_mod=plain, kernels="pallas_tpu")[0] == (
        "pallas_tpu")
    _compare(q, k, v, score_mod=plain, window=(60, 20))
    for other in (lambda s, b, h, i, j: s + table[b, jnp.clip(j - i + 8, 0, 16)],
                  lambda s, b, h, i, j: s * table[h, jnp.clip(j - i + 8, 0, 16)]):
        family, reason = eqx_flash.kernel_family(q, k, v, score_mod=other,
                                                 kernels="pallas_tpu")
        assert family is None and "a score_mod that applies" in reason, reason


class _Trained(eqx.Module):
    """A score_mod with floating arrays read by one side's positions: a factor per head
    on the scores, a bias per key (per batch element) and per query, and ALiBi written
    by hand (slopes per head times the distance)."""

    scale: jax.Array
    key_bias: jax.Array
    query_bias: jax.Array
    slopes: jax.Array

    def __call__(self, score, b, h, i, j):
        distance = jnp.abs(i - j).astype(score.dtype)
        return (score * self.scale[h] + self.key_bias[b, j] + self.query_bias[i]
                - self.slopes[h] * distance)


TRAINED = {
    "causal softcap": dict(causal=True, softcap=5.0),
    "beside a bias": dict(bias=(4, 1, 300), window=(60, 10)),
}


@pytest.mark.parametrize("name", _marked(TRAINED, {"causal softcap"}))
def test_score_mods_with_floating_arrays_against_reference(name):
    """A score_mod whose floating arrays are read by one side's positions runs split,
    with their gradients: the dk/dv kernel sums each value's cotangent (the score_mod's
    output cotangent times its partial in that value) per key over its key block, or
    per query and step, and one `jax.vjp` of the values outside takes them to the
    arrays; the jvp kernel takes the values' tangents. Against `plain_attention`
    (GQA 4/2; 200 queries on 300 keys; beside a trained bias: the dq kernel too)."""
    case = dict(TRAINED[name])
    q, k, v = qkv(43, (2, 4, 200, 32), (2, 2, 300, 32))
    keys = jax.random.split(jax.random.key(44), 4)
    module = _Trained(1.0 + 0.3 * jax.random.normal(keys[0], (4,)),
                      jax.random.normal(keys[1], (2, 300)),
                      jax.random.normal(keys[2], (200,)), jnp.linspace(0.01, 0.1, 4))
    if "bias" in case:
        case["bias"] = jax.random.normal(keys[3], case["bias"])
    _compare_module(q, k, v, module, case)


def _documents(q_ids, kv_ids):
    def same_document(b, h, i, j):  # FlexAttention's document mask: ids by position
        return q_ids[b, i] == kv_ids[b, j]

    return same_document


def _key_kinds(kinds):
    def by_kind(score, b, h, i, j):  # a per-key int array and a per-head factor
        return score + jnp.where(kinds[j] == 1, -1.0, 0.5) * (h + 1).astype(score.dtype)

    return by_kind


def _bounded(score, b, h, i, j):  # `erf` of one side's positions: computed outside
    near = jax.lax.erf(i.astype(score.dtype) / 80.0) - jnp.tanh(j.astype(score.dtype) / 90.0)
    return score + near


def _ids():  # document ids of 200 queries and 300 keys, per batch element
    return (jnp.stack([jnp.arange(200) // 50, jnp.arange(200) // 70]),
            jnp.stack([jnp.arange(300) // 75, jnp.arange(300) // 105]))


def test_mods_reading_arrays_by_position_against_reference():
    """A `mask_mod`/`score_mod` reading arrays by one side's positions (document ids per
    batch element, a kind per key; `erf` of the query positions, which Mosaic does not
    lower) runs split: the per-position values computed outside the kernels, read per
    tile like segment ids, the rest evaluated in the kernels. Values, lse, the
    gradients of q, k, v and a jvp against `plain_attention` (GQA 4/2; 200 queries on
    300 keys), with the arrays closed over as constants."""
    q, k, v = qkv(41, (2, 4, 200, 32), (2, 2, 300, 32))
    kinds = jnp.arange(300) % 3
    _compare(q, k, v, mask_mod=_documents(*_ids()), causal=True)
    _compare(q, k, v, score_mod=_key_kinds(kinds), mask_mod=_documents(*_ids()))
    _compare(q, k, v, score_mod=_bounded, window=(60, 20))


@ACCELERATOR
def test_mods_reading_traced_arrays_by_position():
    """The same split mods with their arrays traced values of an outer `jit` (the
    accelerator set's case of them)."""
    q, k, v = qkv(41, (2, 4, 200, 32), (2, 2, 300, 32))
    q_ids, kv_ids = _ids()
    kinds = jnp.arange(300) % 3

    def run(attention, q, k, v, q_ids, kv_ids, kinds):
        options = dict(score_mod=_key_kinds(kinds), mask_mod=_documents(q_ids, kv_ids))
        out, lse = attention(q, k, v, **options)
        grads = jax.grad(lambda q, k, v: _loss(attention, q, k, v, **options),
                         argnums=(0, 1, 2))(q, k, v)
        _, (t_out, _) = jax.jvp(lambda q: attention(q, k, v, **options), (q,), (jnp.cos(q),))
        return out, lse, grads, t_out

    pallas = functools.partial(flash_attention, **PALLAS, **BLOCKS)
    got = jax.jit(functools.partial(run, pallas))(q, k, v, q_ids, kv_ids, kinds)
    want = jax.jit(functools.partial(run, plain_attention))(q, k, v, q_ids, kv_ids, kinds)
    assert_close(got[0], want[0], name="out")
    assert_lse_close(got[1], want[1], jnp.float32)
    for name, a, b in zip("qkv", got[2], want[2], strict=True):
        assert_close(a, b, kind="grad", name=f"d{name}")
    assert_close(got[3], want[3], kind="grad", name="jvp out")


def test_which_mods_run_in_the_kernels():
    """Elementwise functions holding no arrays, those reading arrays by one side's
    positions, and `RelativeScoreMod`s run in the kernels; the rest are named."""
    q, k, v = qkv(23, (1, 2, 64, 16), (1, 2, 64, 16))
    table = jnp.linspace(0.0, -1.0, 8)
    ids = jnp.arange(64) // 16

    def looked_up(score, b, h, i, j):  # a lookup by both positions: a gather per pair
        return score + table[jnp.clip(i + j, 0, 7)]  # (by i - j: a relative term)

    def running_ids(b, h, i, j):  # ids at a cumulative sum of positions: not per position
        return ids[jnp.clip(jnp.cumsum(i, axis=1), 0, 63)] == ids[j]

    relative = eqx_flash.RelativePositionBias(2, key=jax.random.key(0))
    reasons = {
        "applies `gather` to the scores or to both positions (Mosaic runs elementwise "
        "functions): an array looked up per pair runs in the kernels as `bias=`":
            dict(score_mod=looked_up),
        "read through `cumsum` of positions": dict(mask_mod=running_ids),
        "block_mask built at blocks (24, 40)": dict(
            mask_mod=sliding_prefix, block_mask=eqx_flash.make_block_mask(
                sliding_prefix, (1,), 2, 64, 64, block_q=24, block_k=40)),
    }
    for expected, options in reasons.items():
        family, reason = eqx_flash.kernel_family(q, k, v, kernels="pallas_tpu", **options)
        assert family is None and expected in reason, (expected, reason)
        with pytest.raises(NotImplementedError, match=re.escape(expected)):
            flash_attention(q, k, v, **PALLAS, **options)
    # A RelativeScoreMod's term needs query blocks of whole 128s: a block_mask at other
    # blocks that do not divide the kernels' is not read with it.
    long = qkv(24, (1, 2, 128, 16), (1, 2, 128, 16))
    block_mask = eqx_flash.make_block_mask(sliding_prefix, (1,), 2, 128, 128, block_q=48,
                                           block_k=128)
    family, reason = eqx_flash.kernel_family(*long, kernels="pallas_tpu", score_mod=relative,
                                             mask_mod=sliding_prefix, block_mask=block_mask)
    assert family is None and "RelativeScoreMod with a block_mask built at query blocks of 48" \
        in reason, reason
    # ... and its vectors whole in VMEM: at 300k tokens they no longer fit.
    very_long = [jnp.zeros((2, 300_000, 8))] * 3
    family, reason = eqx_flash.kernel_family(*very_long, kernels="pallas_tpu",
                                             score_mod=relative)
    assert family is None and "do not fit in VMEM" in reason, reason
    for options in (dict(score_mod=capped_distance, mask_mod=sliding_prefix),
                    dict(score_mod=relative, causal=True),
                    dict(mask_mod=lambda b, h, i, j: ids[i] == ids[j])):
        family, _ = eqx_flash.kernel_family(q, k, v, kernels="pallas_tpu", **options)
        assert family == "pallas_tpu", options


def test_a_block_summary_narrows_the_plan():
    """The kernels' grid has a step per block pair they visit (`_plan`): each outer block's
    steps in a run, the first and the last marked, visiting in order exactly the inner
    blocks that the static band and a `mask_mod`'s block summary (here random, per batch
    element and kv head) both leave non-empty, flagged whole where both call them whole
    (neither mask evaluated there). An outer block with nothing to visit still gets one
    step (flag 0) to write its results. Known only at run time, the summary's tables are
    built in the program with the static band's steps per outer block, the steps it
    empties last (flag 0, repeating the last block: no DMA, no work); known when traced,
    they are NumPy with only the steps it leaves. The backward's plan is the transposed
    one."""
    cfg = KernelConfig(seq_q=300, seq_k=500, block_q=64, block_k=128,
                       window=Window(None, 0), scale=1.0)  # causal, bottom-right
    summary = np.random.default_rng(0).integers(0, 3, (2, 3, 1, 5, 4)).astype(np.int8)
    summary[..., 0] = summary[..., -1, :] = EMPTY  # (the known plans get narrower)
    static = static_flags(300, 500, 64, 128, cfg.band_window, cfg.offset)
    assert (static == EMPTY).any() and (static == FULL).any() and (static == PARTIAL).any()
    known = dataclasses.replace(cfg, block_summary=KnownSummary(summary))
    plans = [(forward_plan(cfg), False, None), (backward_plan(cfg), True, None),
             (forward_plan(cfg, jnp.asarray(summary)), False, False),
             (backward_plan(cfg, jnp.asarray(summary)), True, False),
             (forward_plan(known), False, True), (backward_plan(known), True, True)]
    for plan, by_key, when_traced in plans:
        summarised = when_traced is not None
        assert plan.listed == summarised and plan.static != (when_traced is False)
        assert plan.layout[:2] == ((2, 3) if summarised else (1, 1))
        outer, inner, code = (np.asarray(x) for x in (plan.outer, plan.inner, plan.code))
        band = static.T if by_key else static
        mine = (np.swapaxes(summary[:, :, 0], -1, -2) if by_key else summary[:, :, 0]
                ) if summarised else np.full((1, 1, *band.shape), FULL)
        visits = (band != EMPTY) & (mine != EMPTY)
        widths = np.maximum(visits.sum(axis=-1).max(axis=(0, 1)) if when_traced is not False
                            else (band != EMPTY).sum(axis=-1), 1)
        assert plan.layout.steps == widths.sum() < band.size
        for b, h in np.ndindex(*plan.layout[:2]):
            steps = 0
            for o in range(band.shape[0]):
                run = slice(steps, steps + widths[o])
                steps += widths[o]
                assert (outer[b, h, run] == o).all()
                marks = code[b, h, run] & (FIRST | LAST)
                assert marks[0] & FIRST and marks[-1] & LAST and not (marks[1:] & FIRST).any()
                visit = list(np.flatnonzero(visits[b, h, o]))
                n = len(visit)
                np.testing.assert_array_equal(inner[b, h, run][:n], visit)
                want = [FULL if band[o, j] == FULL and mine[b, h, o, j] == FULL else PARTIAL
                        for j in visit]
                np.testing.assert_array_equal(code[b, h, run][:n] & FLAG, want)
                assert (code[b, h, run][n:] & FLAG == 0).all()
                assert (inner[b, h, run][n:] == (visit[-1] if visit else 0)).all()


def test_a_summary_too_large_to_list_per_head_is_shared(monkeypatch):
    """Past `_plan.MAX_LISTED` block pairs in all, a summary that varies over the batch
    and the kv heads is merged over them (one table: a block visited where any visits
    it, whole where all do): the results stay the reference's."""
    monkeypatch.setattr(_plan, "MAX_LISTED", 8)
    jax.clear_caches()  # (no program traced before the patch)
    cfg = KernelConfig(seq_q=300, seq_k=500, block_q=64, block_k=128,
                       window=Window(None, None), scale=1.0)
    summary = np.random.default_rng(1).integers(0, 3, (2, 3, 1, 5, 4)).astype(np.int8)
    plan = forward_plan(cfg, jnp.asarray(summary))
    assert plan.layout[:2] == (1, 1) and plan.listed
    q, k, v = qkv(26, (2, 4, 200, 32), (2, 2, 300, 32))
    _compare(q, k, v, mask_mod=sliding_prefix)


def test_block_masks_in_the_kernels():
    """A user's `block_mask` built at blocks dividing the kernels' is read coarsened; one
    at other whole tiles sets the kernels' blocks; passed into the `jit` (known only at
    run time: the plan is built in the program) or closed over (known when traced).
    Either way the blocks it empties are skipped and the results are the reference's:
    values, lse, the gradients of q, k, v and a jvp."""
    q, k, v = qkv(24, (2, 4, 200, 32), (2, 2, 300, 32))
    for (block_q, block_k), passed in (((16, 128), True), ((48, 128), False)):
        block_mask = eqx_flash.make_block_mask(sliding_prefix, (2,), 4, 200, 300,
                                               block_q=block_q, block_k=block_k)
        assert float(block_mask.sparsity) > 0.1
        options = dict(mask_mod=sliding_prefix, block_mask=block_mask)
        family, _ = eqx_flash.kernel_family(q, k, v, kernels="pallas_tpu", **options)
        assert family == "pallas_tpu"
        pallas = functools.partial(flash_attention, mask_mod=sliding_prefix, **PALLAS)
        if passed:
            _compare_on(pallas, q, k, v, traced=dict(block_mask=block_mask),
                        mask_mod=sliding_prefix)
        else:
            _compare_on(functools.partial(pallas, block_mask=block_mask), q, k, v,
                        **options)


@pytest.mark.parametrize("options", [dict(), dict(causal=True, softcap=3.0)],
                         ids=["GQA", "causal softcap"])
def test_dropout_drops_what_the_xla_kernels_drop(options):
    """Dropout in the kernels (`_semantics.dropout`'s hash per tile): for the same key,
    the same values, lse, gradients and jvp as the XLA family (itself tested against
    the reference) — switching families changes no result."""
    q, k, v = qkv(13, (2, 4, 200, 32), (2, 2, 300, 32))
    common = dict(dropout_rate=0.25, key=jax.random.key(14), **options, **BLOCKS)
    pallas = functools.partial(flash_attention, **PALLAS, **common)
    xla = functools.partial(flash_attention, kernels="xla", **common)
    out, lse = jax.jit(pallas)(q, k, v)
    ref_out, ref_lse = jax.jit(xla)(q, k, v)
    assert_close(out, ref_out, name="out")
    assert_lse_close(lse, ref_lse, jnp.float32)
    assert not np.allclose(out, flash_attention(q, k, v, **options, **BLOCKS)[0], atol=1e-2)
    grad = functools.partial(jax.grad, argnums=(0, 1, 2))
    got = jax.jit(grad(lambda q, k, v: _loss(pallas, q, k, v)))(q, k, v)
    want = jax.jit(grad(lambda q, k, v: _loss(xla, q, k, v)))(q, k, v)
    for name, a, b in zip("qkv", got, want, strict=True):
        assert_close(a, b, kind="grad", name=f"d{name}")

    def jvp(attention):
        return jax.jit(lambda q, v: jax.jvp(lambda q, v: attention(q, k, v)[0], (q, v),
                                            (jnp.cos(q), jnp.sin(v)))[1])(q, v)

    assert_close(jvp(pallas), jvp(xla), kind="grad", name="jvp")


@ACCELERATOR
def test_programs_reading_fewer_results_get_the_same_values():
    """A compiled program that reads only the output (or not the max scores) runs a
    forward kernel that does not write the statistics (`_unread_outputs`): the same
    output, under `vmap` too, and the max scores where they are read, as the program
    that reads everything."""
    q, k, v = qkv(21, (2, 4, 200, 32), (2, 2, 300, 32))
    pallas = functools.partial(flash_attention, causal=True, return_max_scores=True,
                               **PALLAS, **BLOCKS)
    out, lse, top = jax.jit(pallas)(q, k, v)
    assert_close(jax.jit(lambda q, k, v: pallas(q, k, v)[0])(q, k, v), out, name="out")
    mapped = jax.jit(jax.vmap(lambda q, k, v: pallas(q, k, v)[0]))(q, k, v)
    assert_close(mapped, out, name="vmapped out")
    got_top = jax.jit(lambda q, k, v: pallas(q, k, v)[2])(q, k, v)
    assert_close(got_top, top, name="max scores")
    ref_out, ref_lse = plain_attention(q, k, v, causal=True)
    assert_close(out, ref_out, name="out")
    assert_lse_close(lse, ref_lse, jnp.float32)


@ACCELERATOR
def test_empty_rows_and_nonfinite_values():
    """Rows that attend nothing give 0, -inf and zero gradients; a NaN value reaches
    exactly the rows that attend it (causal: the later ones), in values and gradients."""
    q, k, v = qkv(3, (1, 2, 128, 32), (1, 2, 256, 32))
    lengths = dict(q_lengths=jnp.array([128]), kv_lengths=jnp.array([0]))
    out, lse = flash_attention(q, k, v, **lengths, **PALLAS, **BLOCKS)
    assert jnp.all(out == 0) and jnp.all(lse == -jnp.inf)
    g = jax.grad(lambda q: _loss(functools.partial(flash_attention, **PALLAS, **BLOCKS),
                                 q, k, v, **lengths))(q)
    assert jnp.all(g == 0)
    v = v.at[0, 1, 200, 3].set(jnp.nan)
    out, _ = flash_attention(q, k, v, causal=True, **PALLAS, **BLOCKS)
    ref, _ = plain_attention(q, k, v, causal=True)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    grads = jax.jit(jax.grad(lambda v: _loss(functools.partial(
        flash_attention, **PALLAS, **BLOCKS), q, k, v, causal=True)))(v)
    want = jax.jit(jax.grad(lambda v: _loss(plain_attention, q, k, v, causal=True)))(v)
    np.testing.assert_array_equal(np.isnan(grads), np.isnan(want))


@ACCELERATOR
def test_bfloat16_in_its_own_dtype():
    q, k, v = qkv(4, (1, 2, 128, 64), (1, 2, 256, 64), dtype=jnp.bfloat16)
    _compare(q, k, v, dtype=jnp.bfloat16, causal=True)


@ACCELERATOR
def test_transforms_and_second_order():
    """vmap (with per-example lengths), jvp and an HVP: forward mode and second order run
    the xla family's kernels on the Pallas forward's results."""
    q, k, v = qkv(5, (3, 2, 128, 32), (3, 2, 128, 32))
    lengths = jnp.array([128, 70, 5])
    flash = functools.partial(flash_attention, causal=True, **PALLAS, **BLOCKS)
    got = jax.vmap(lambda q, k, v, n: flash(q, k, v, kv_lengths=n)[0])(q, k, v, lengths)
    want = jax.vmap(lambda q, k, v, n: plain_attention(q, k, v, causal=True,
                                                       kv_lengths=n)[0])(q, k, v, lengths)
    assert_close(got, want, name="vmap")

    def hvp(attention):
        def loss(q):
            return jnp.sum(jnp.sin(attention(q, k, v, causal=True)[0]))
        return jax.jvp(jax.grad(loss), (q,), (jnp.cos(q),))[1]

    pallas = functools.partial(flash_attention, **PALLAS, **BLOCKS)
    assert_close(jax.jit(lambda: hvp(pallas))(), jax.jit(lambda: hvp(plain_attention))(),
                 kind="grad", scale=4.0, name="hvp")
    tangent = jax.jit(lambda q: jax.jvp(lambda q: pallas(q, k, v, causal=True)[0], (q,),
                                        (v,))[1])(q)
    ref = jax.jit(lambda q: jax.jvp(lambda q: plain_attention(q, k, v, causal=True)[0], (q,),
                                    (v,))[1])(q)
    assert_close(tangent, ref, kind="grad", name="jvp")


def test_uncovered_options_raise_when_asked_and_fall_back_by_default():
    q, k, v = qkv(6, (2, 64, 16), (2, 64, 16))

    table = jnp.linspace(0.0, -1.0, 8)

    def score_mod(score, b, h, i, j):  # a table lookup by i + j: not in the Pallas kernels
        return score + table[jnp.clip(i + j, 0, 7)]

    with pytest.raises(NotImplementedError, match="score_mod"):
        flash_attention(q, k, v, score_mod=score_mod, **PALLAS)
    with pytest.raises(ValueError, match="kernels"):
        flash_attention(q, k, v, kernels="cuda")
    out, _ = flash_attention(q, k, v, score_mod=score_mod)  # None: the xla family, silently
    assert_close(out, plain_attention(q, k, v, score_mod=score_mod)[0])
    family, reason = eqx_flash.kernel_family(q, k, v, score_mod=score_mod,
                                             kernels="pallas_tpu")
    assert family is None and "score_mod" in reason
    family, reason = eqx_flash.kernel_family(q, k, v)
    expected = "pallas_tpu" if jax.default_backend() == "tpu" else "xla"
    assert family == expected and reason


def test_every_entry_point_takes_kernels():
    """The modules (a static field), the jax.nn and FlashAttention-2 front ends and the
    sharded entry point pass `kernels=` on; an option check names it everywhere."""
    x = jax.random.normal(jax.random.key(7), (128, 32))
    layers = [eqx_flash.FlashMultiheadAttention(2, 32, causal=True, kernels=family,
                                                block_q=64, block_k=128, key=jax.random.key(8))
              for family in ("pallas_tpu", "xla")]
    assert_close(layers[0](x, x, x), layers[1](x, x, x), name="module")
    q = jax.random.normal(jax.random.key(9), (1, 128, 2, 32))  # jax.nn's layout
    got = eqx_flash.dot_product_attention(q, q, q, is_causal=True, kernels="pallas_tpu")
    assert_close(got, jax.nn.dot_product_attention(q, q, q, is_causal=True), name="jax.nn")
    got = eqx_flash.flash_attn_func(q, q, q, causal=True, kernels="pallas_tpu")
    assert_close(got, eqx_flash.flash_attn_func(q, q, q, causal=True), name="flash_attn")
    for bad, error in (("cuda", ValueError), (1, TypeError)):
        with pytest.raises(error, match="kernels"):
            eqx_flash.FlashAttention(kernels=bad)
        with pytest.raises(error, match="kernels"):
            eqx_flash.dot_product_attention(q, q, q, kernels=bad)


def test_inside_a_users_shard_map():
    """In `jax.shard_map` (check_vma=True, the default) the kernels' outputs vary over the
    mesh axes their inputs vary over (a `pallas_call` must be told): values, gradients
    and tangents, batch-sharded with segment ids, and the ring strategy (ALiBi, a bias;
    a score_mod and a mask_mod at the pieces' global indices)."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    q, k, v = qkv(10, (2, 2, 128, 32), (2, 2, 128, 32))
    ids = jnp.sort(jax.random.randint(jax.random.key(11), (2, 128), 0, 2), axis=-1)
    options = dict(causal=True, q_segment_ids=ids, kv_segment_ids=ids)

    def sharded(q, k, v, ids):
        return flash_attention(q, k, v, causal=True, q_segment_ids=ids, kv_segment_ids=ids,
                               **PALLAS, **BLOCKS)

    spec = P("x")
    attention = jax.shard_map(sharded, mesh=mesh, in_specs=(spec,) * 4,
                              out_specs=(spec, spec))
    _compare_on(lambda q, k, v: attention(q, k, v, ids), q, k, v, **options)
    seq = P(None, None, "x")
    slopes = jnp.array([0.3, 0.1])  # ALiBi at the ring's global indices
    bias = jax.random.normal(jax.random.key(12), (2, 1, 128))  # per head and key
    ring = jax.shard_map(
        lambda q, k, v: eqx_flash.ring_flash_attention(q, k, v, axis_name="x", causal=True,
                                                       alibi_slopes=slopes, bias=bias,
                                                       **PALLAS),
        mesh=mesh, in_specs=(seq,) * 3, out_specs=(seq, seq))
    _compare_on(ring, q, k, v, causal=True, alibi_slopes=slopes, bias=bias)
    # A score_mod and a mask_mod on the ring's pieces see the whole sequence's indices
    # (zigzag: two pieces per device, here chunks 0 and 1 of one device, the second at
    # global indices past the first's; `sliding_prefix` reads them absolutely), and so do
    # the values a split mod reads by position (documents by id, a trained bias per key).
    ids = jnp.stack([jnp.arange(128) // 40, jnp.arange(128) // 50])
    key_bias = jnp.sin(jnp.arange(128, dtype=jnp.float32))
    documents = _documents(ids, ids)
    mods = dict(
        mask_mod=lambda b, h, i, j: documents(b, h, i, j) & sliding_prefix(b, h, i, j),
        score_mod=lambda s, b, h, i, j: (capped_distance(s, b, h, i, j)
                                         + key_bias[j].astype(s.dtype)))
    ring_mods = jax.shard_map(
        lambda q, k, v: eqx_flash.ring_flash_attention(q, k, v, axis_name="x", causal=True,
                                                       layout="zigzag", **mods, **PALLAS),
        mesh=mesh, in_specs=(seq,) * 3, out_specs=(seq, seq), check_vma=False)
    _compare_on(ring_mods, q, k, v, causal=True, **mods)


def _compare_on(attention, q, k, v, traced=None, **options):
    """`attention(q, k, v, **traced)` against `plain_attention(q, k, v, **options,
    **traced)`: values, lse, the gradients of `_loss` and a jvp, each side one compiled
    program; the keyword arguments in `traced` are arguments of the `jit`."""
    reference = functools.partial(plain_attention, **options)

    def everything(attention):
        def run(q, k, v, traced):
            def call(q, k, v):
                return attention(q, k, v, **traced)

            out, lse = call(q, k, v)
            tangent = jax.jvp(lambda q: call(q, k, v)[0], (q,), (jnp.cos(q),))[1]
            grads = jax.grad(lambda q, k, v: _loss(call, q, k, v), argnums=(0, 1, 2))(q, k, v)
            return out, lse, grads, tangent

        return jax.jit(run)(q, k, v, traced or {})

    (out, lse, grads, tangent), (r_out, r_lse, r_grads, r_tangent) = (
        everything(attention), everything(reference))
    assert_close(out, r_out, name="out")
    assert_lse_close(lse, r_lse, jnp.float32)
    for name, a, b in zip("qkv", grads, r_grads, strict=True):
        assert_close(a, b, kind="grad", name=f"d{name}")
    assert_close(tangent, r_tangent, kind="grad", name="jvp")


@examples(5)  # each example interprets the kernels: a few, over every option at once
@given(inputs=attention_inputs(dtypes=(jnp.float32,), max_seq=160, dims=(16, 32),
                               bias=None, alibi=None, sinks=None, lengths=None,
                               positions=None, score_mod=None, mask_mod=None))
def test_property_against_reference(inputs):
    """Drawn shapes, blocks, masks, causal, windows, segment ids, lengths, positions, a
    bias, ALiBi, sinks and the strategy's score_mods and mask_mods, each at random: the
    Pallas kernels give the reference's values, lse, gradients and jvp wherever they
    cover the call, and where they do not, an explicit request raises naming what they
    lack (`kernel_family` says the same)."""
    family, reason = eqx_flash.kernel_family(inputs.q, inputs.k, inputs.v, **inputs.kwargs,
                                             kernels="pallas_tpu")
    pallas = functools.partial(flash_attention, kernels="pallas_tpu")
    if family is None:
        with pytest.raises(NotImplementedError, match="pallas_tpu"):
            pallas(inputs.q, inputs.k, inputs.v, **inputs.kwargs)
        assert reason
        return
    check_attention(pallas, inputs, jvp=True)
