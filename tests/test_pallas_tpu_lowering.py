"""The Pallas TPU kernels lower to Mosaic kernels, checked on any host:
`jax.export(..., platforms=("tpu",))` runs the Pallas-to-Mosaic lowering a TPU runs,
without one. (Not in the accelerator set: nothing here needs the chip, and on a TPU
`tests/test_pallas_tpu.py` compiles the kernels for real.)
"""

import functools
import re

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import capped_distance, sliding_prefix

from eqx_flash import RelativePositionBias, flash_attention
from eqx_flash._kernels.pallas_tpu import _relative

try:  # The Mosaic module of each kernel, as the TPU compiler receives it.
    from jax._src.tpu_custom_call import _lower_mosaic_module_to_asm as _TO_ASM
except ImportError:  # pragma: no cover (a jax without it: the layout test says so)
    _TO_ASM = None

PALLAS = dict(kernels="pallas_tpu")
BLOCKS = dict(block_q=64, block_k=128)


@pytest.fixture(autouse=True)
def mosaic_modules(monkeypatch):
    """The Mosaic modules a test here exports, as a TPU's compiler receives them; after
    the test, every one is checked for masks laid out in a way Mosaic cannot relay out
    (`_mask_layout_conflicts`), which no export sees."""
    modules: list[str] = []
    if _TO_ASM is not None:
        from jax._src import tpu_custom_call

        def recording(module, *args, **kwargs):
            modules.append(module.operation.get_asm(enable_debug_info=False))
            return _TO_ASM(module, *args, **kwargs)

        monkeypatch.setattr(tpu_custom_call, "_lower_mosaic_module_to_asm", recording)
    yield modules
    conflicts = [c for module in modules for c in _mask_layout_conflicts(module)]
    assert not conflicts, conflicts


def _loss(attention, q, k, v):
    out, lse = attention(q, k, v)
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))


@pytest.mark.parametrize("dim", [64, 128, 256])
def test_lowers_to_mosaic_kernels(dim):
    """On any host, exporting for a TPU yields Mosaic kernels: the forward's, and the
    backward's (fused) — at the default blocks, causal and not, bf16."""
    q = jax.ShapeDtypeStruct((1, 4, 2048, dim), jnp.bfloat16)

    def loss(q, k, v, causal):
        out, lse = flash_attention(q, k, v, causal=causal, **PALLAS)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

    for causal in (False, True):
        fwd = jax.jit(lambda q, k, v, c=causal: flash_attention(q, k, v, causal=c, **PALLAS))
        grad = jax.jit(jax.grad(functools.partial(loss, causal=causal), argnums=(0, 1, 2)))
        for fn, kernels in ((fwd, 1), (grad, 2)):
            exported = jax.export.export(fn, platforms=("tpu",))(q, q, q)
            text = exported.mlir_module()
            assert text.count("tpu_custom_call") == kernels, (dim, causal, kernels)


@pytest.mark.parametrize("blocks", [BLOCKS, {}], ids=["blocks 64x128", "default blocks"])
def test_the_shapes_tested_here_lower_to_mosaic_kernels(blocks):
    """Mosaic takes a block only in whole (8, 128) tiles or whole trailing dimensions, a
    rule the interpreter does not check: the small, odd shapes of this file (lengths
    that are no block multiple, a 64-row query block, GQA, every mask), exported for a
    TPU on any host, forward, gradients and jvp."""
    q = jax.ShapeDtypeStruct((2, 4, 160, 32), jnp.float32)
    kv = jax.ShapeDtypeStruct((2, 2, 300, 32), jnp.float32)
    ids = (jnp.zeros((2, 160), jnp.int32), jnp.zeros((2, 300), jnp.int32))
    masks = {
        "causal softcap": dict(causal=True, softcap=2.0),
        "key mask": dict(mask=jnp.ones((2, 300), bool), causal=True),
        "segment ids": dict(q_segment_ids=ids[0], kv_segment_ids=ids[1]),
        "lengths": dict(q_lengths=jnp.array([160, 40]), kv_lengths=jnp.array([300, 10])),
        "positions": dict(q_positions=ids[0], kv_positions=ids[1], window=(40, 0)),
    }
    for name, options in masks.items():
        flash = functools.partial(flash_attention, **options, **PALLAS, **blocks)

        def grad(q, k, v, flash=flash):
            return jax.grad(lambda q, k, v: _loss(flash, q, k, v), argnums=(0, 1, 2))(q, k, v)

        def jvp(q, k, v, flash=flash):
            return jax.jvp(lambda q: flash(q, k, v)[0], (q,), (q,))

        for fn in (grad, jvp):
            exported = jax.export.export(jax.jit(fn), platforms=("tpu",))(q, kv, kv)
            assert "tpu_custom_call" in exported.mlir_module(), (name, fn.__name__)


def test_row_tiles_of_partial_blocks_lower_to_mosaic_kernels():
    """The forward's tiles of a partial block (rows sliced out of the `(g, rows, .)`
    scratch; `Tuning.partial_rows`) with GQA and a key mask, exported for a TPU."""
    q = jax.ShapeDtypeStruct((1, 4, 1100, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 2, 1200, 128), jnp.bfloat16)
    mask = jnp.arange(1200) % 7 != 3
    fwd = jax.jit(functools.partial(flash_attention, causal=True, mask=mask, block_q=1024,
                                    block_k=256, **PALLAS))
    exported = jax.export.export(fwd, platforms=("tpu",))(q, kv, kv)
    assert exported.mlir_module().count("tpu_custom_call") == 1


@pytest.mark.parametrize("blocks", [BLOCKS, {}], ids=["blocks 64x128", "default blocks"])
def test_bias_and_pair_masks_lower_to_mosaic_kernels(blocks):
    """Per-pair blocks (a bias in each broadcast form, its cotangent written by the dq
    kernel, its transposed layout in the dk/dv kernel; an `attn_mask` as int8 or int32)
    at the odd shapes of `test_pallas_tpu.py`, exported for a TPU: the gradients of q,
    k, v and the bias, and a jvp along q and the bias."""
    q = jax.ShapeDtypeStruct((2, 4, 160, 32), jnp.float32)
    kv = jax.ShapeDtypeStruct((2, 2, 300, 32), jnp.float32)
    for shape in [(2, 4, 160, 300), (4, 1, 300), (160, 1), (2, 4, 1, 1)]:
        bias = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
        flash = functools.partial(flash_attention, causal=True, **PALLAS, **blocks)

        def grad(q, k, v, b, flash=flash):
            return jax.grad(lambda q, k, v, b: _loss(functools.partial(flash, bias=b), q, k, v),
                            argnums=(0, 1, 2, 3))(q, k, v, b)

        def jvp(q, k, v, b, flash=flash):
            return jax.jvp(lambda q, b: flash(q, k, v, bias=b)[0], (q, b), (q, b))

        for fn, kernels in ((grad, 3), (jvp, 1)):  # grad: forward, dk/dv, dq
            exported = jax.export.export(jax.jit(fn), platforms=("tpu",))(q, kv, kv, bias)
            assert exported.mlir_module().count("tpu_custom_call") == kernels, (shape, kernels)
    for shape in [(2, 4, 160, 300), (160, 300), (2, 1, 1, 300)]:
        mask = jax.ShapeDtypeStruct(shape, jnp.bool_)
        flash = functools.partial(flash_attention, **PALLAS, **blocks)

        def grad_masked(q, k, v, m, flash=flash):
            return jax.grad(lambda q, k, v: _loss(functools.partial(flash, attn_mask=m),
                                                  q, k, v), argnums=(0, 1, 2))(q, k, v)

        exported = jax.export.export(jax.jit(grad_masked), platforms=("tpu",))(q, kv, kv, mask)
        assert "tpu_custom_call" in exported.mlir_module(), shape


@pytest.mark.parametrize("blocks", [BLOCKS, {}], ids=["blocks 64x128", "default blocks"])
def test_score_and_mask_mods_lower_to_mosaic_kernels(blocks):
    """A `score_mod` and a `mask_mod` (elementwise, holding no arrays) run inside the
    kernels, the mask_mod's block summary narrowing their plan: the gradient exports to
    exactly two Mosaic kernels (the forward and the fused backward), the jvp to one, for
    GQA in float32 and bfloat16, with a soft cap and causal too."""
    for dtype in (jnp.float32, jnp.bfloat16):
        q = jax.ShapeDtypeStruct((2, 4, 160, 64), dtype)
        kv = jax.ShapeDtypeStruct((2, 2, 300, 64), dtype)
        for options in (dict(score_mod=capped_distance), dict(mask_mod=sliding_prefix),
                        dict(score_mod=capped_distance, mask_mod=sliding_prefix, causal=True,
                             softcap=30.0)):
            flash = functools.partial(flash_attention, **PALLAS, **blocks, **options)

            def grad(q, k, v, flash=flash):
                return jax.grad(functools.partial(_loss, flash), argnums=(0, 1, 2))(q, k, v)

            def jvp(q, k, v, flash=flash):
                return jax.jvp(lambda q, k, v: flash(q, k, v)[0], (q, k, v), (q, k, v))

            for fn, kernels in ((grad, 2), (jvp, 1)):
                exported = jax.export.export(jax.jit(fn), platforms=("tpu",))(q, kv, kv)
                assert exported.mlir_module().count("tpu_custom_call") == kernels, (
                    options, fn.__name__)


def test_mods_on_the_ring_lower_to_mosaic_kernels():
    """A score_mod and a mask_mod on the ring's pieces (zigzag: two pieces per device,
    read at their global indices; a trained T5 bias) run in Mosaic kernels: the forward
    of the three causal piece pairs exports to three, its gradient to three more (the
    fused backward)."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from eqx_flash import ring_flash_attention

    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    seq = P(None, None, "x")
    ring = jax.shard_map(
        lambda q, k, v: ring_flash_attention(q, k, v, axis_name="x", causal=True,
                                             layout="zigzag", score_mod=capped_distance,
                                             mask_mod=sliding_prefix, **PALLAS),
        mesh=mesh, in_specs=(seq,) * 3, out_specs=(seq, seq), check_vma=False)
    q = jax.ShapeDtypeStruct((2, 2, 256, 64), jnp.bfloat16)
    grad = jax.grad(functools.partial(_loss, ring), argnums=(0, 1, 2))
    for fn, kernels in ((ring, 3), (grad, 6)):
        exported = jax.export.export(jax.jit(fn), platforms=("tpu",))(q, q, q)
        assert exported.mlir_module().count("tpu_custom_call") == kernels
    # A mask_mod reading document ids by position: its values at the pieces' indices.
    ids = jnp.arange(256) // 100
    documents = jax.shard_map(
        lambda q, k, v: ring_flash_attention(q, k, v, axis_name="x", causal=True,
                                             layout="zigzag", **PALLAS,
                                             mask_mod=lambda b, h, i, j: ids[i] == ids[j]),
        mesh=mesh, in_specs=(seq,) * 3, out_specs=(seq, seq), check_vma=False)
    grad = jax.grad(functools.partial(_loss, documents), argnums=(0, 1, 2))
    exported = jax.export.export(jax.jit(grad), platforms=("tpu",))(q, q, q)
    assert exported.mlir_module().count("tpu_custom_call") == 6
    # A trained T5 bias: each piece's vector at its global offsets, the table's gradient.
    bias = RelativePositionBias(2, key=jax.random.key(0))
    relative = jax.shard_map(
        lambda q, k, v, m: ring_flash_attention(q, k, v, axis_name="x", causal=True,
                                                layout="zigzag", score_mod=m, **PALLAS),
        mesh=mesh, in_specs=(seq, seq, seq, P()), out_specs=(seq, seq), check_vma=False)
    grad = jax.grad(lambda q, k, v, m: _loss(lambda *a: relative(*a, m), q, k, v),
                    argnums=(0, 1, 2, 3))
    exported = jax.export.export(jax.jit(grad), platforms=("tpu",))(q, q, q, bias)
    assert exported.mlir_module().count("tpu_custom_call") == 6


@pytest.mark.parametrize("blocks, diagonals", [({}, True), (BLOCKS, False)],
                         ids=["default blocks", "built from rotations at blocks 64x128"])
def test_relative_score_mods_lower_to_mosaic_kernels(blocks, diagonals, monkeypatch):
    """A `RelativeScoreMod` (T5's buckets: a table lookup) runs in the kernels as a
    Toeplitz term read from its vector's diagonals (or, past their VMEM budget, built
    from lane rotations): its table's gradient exports to exactly the two Mosaic kernels
    of a plain gradient (the window cotangents come out of the fused backward), a jvp
    along q and the table to one; GQA, float32 and bfloat16, causal with a soft cap, and
    beside a bias (then the dq kernel runs too)."""
    if not diagonals:
        monkeypatch.setattr(_relative, "MAX_DIAGONAL_BYTES", 0)
    relative = RelativePositionBias(4, key=jax.random.PRNGKey(0))
    for dtype in (jnp.float32, jnp.bfloat16):
        q = jax.ShapeDtypeStruct((2, 4, 160, 64), dtype)
        kv = jax.ShapeDtypeStruct((2, 2, 300, 64), dtype)
        bias = jax.ShapeDtypeStruct((4, 1, 300), dtype)
        for options, kernels in ((dict(), 2), (dict(causal=True, softcap=30.0), 2),
                                 (dict(window=(100, 0)), 2), (dict(bias=bias), 3)):
            b = options.pop("bias", None)

            def grad(q, k, v, b, m, options=options):
                def loss(m, q, k, v, b):
                    flash = functools.partial(flash_attention, score_mod=m, bias=b,
                                              **PALLAS, **blocks, **options)
                    return _loss(flash, q, k, v)
                return jax.grad(loss, argnums=(0, 1, 2, 3, 4) if b is not None
                                else (0, 1, 2, 3))(m, q, k, v, b)

            def jvp(q, k, v, b, m, options=options):
                return jax.jvp(lambda q, m: flash_attention(
                    q, k, v, score_mod=m, bias=b, **PALLAS, **blocks, **options)[0],
                    (q, m), (q, m))

            for fn, count in ((grad, kernels), (jvp, 1)):
                exported = jax.export.export(jax.jit(fn), platforms=("tpu",))(
                    q, kv, kv, None if b is None else b, relative)
                assert exported.mlir_module().count("tpu_custom_call") == count, (
                    options, fn.__name__)


@pytest.mark.parametrize("blocks", [BLOCKS, {}], ids=["blocks 64x128", "default blocks"])
def test_mods_reading_arrays_by_position_lower_to_mosaic_kernels(blocks):
    """A `mask_mod` reading document ids by position and a `score_mod` reading a kind
    per key (arrays traced by the exported function) run split: their per-position
    values are computed outside and read per tile, so the gradient still exports to
    exactly two Mosaic kernels and the jvp to one, in float32 and bfloat16."""
    for dtype in (jnp.float32, jnp.bfloat16):
        q = jax.ShapeDtypeStruct((2, 4, 160, 64), dtype)
        kv = jax.ShapeDtypeStruct((2, 2, 300, 64), dtype)
        ids = (jax.ShapeDtypeStruct((2, 160), jnp.int32),
               jax.ShapeDtypeStruct((2, 300), jnp.int32), jax.ShapeDtypeStruct((300,), jnp.int32))

        def mods(q_ids, kv_ids, kinds):
            def same_document(b, h, i, j):
                return q_ids[b, i] == kv_ids[b, j]

            def by_kind(score, b, h, i, j):
                return score + jnp.where(kinds[j] == 1, -1.0, 0.5).astype(score.dtype)

            return dict(mask_mod=same_document, score_mod=by_kind, causal=True)

        def grad(q, k, v, *arrays):
            flash = functools.partial(flash_attention, **PALLAS, **blocks, **mods(*arrays))
            return jax.grad(functools.partial(_loss, flash), argnums=(0, 1, 2))(q, k, v)

        def jvp(q, k, v, *arrays):
            return jax.jvp(lambda q: flash_attention(q, k, v, **PALLAS, **blocks,
                                                     **mods(*arrays))[0], (q,), (q,))

        for fn, kernels in ((grad, 2), (jvp, 1)):
            exported = jax.export.export(jax.jit(fn), platforms=("tpu",))(q, kv, kv, *ids)
            assert exported.mlir_module().count("tpu_custom_call") == kernels, fn.__name__


def test_score_mods_with_floating_arrays_lower_to_mosaic_kernels():
    """A score_mod reading floating arrays by one side's positions (a factor per head, a
    bias per key): their gradient exports to exactly two Mosaic kernels (the fused
    backward writes the values' cotangents), a jvp along them to one."""
    q = jax.ShapeDtypeStruct((2, 4, 160, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 2, 300, 64), jnp.bfloat16)
    arrays = (jax.ShapeDtypeStruct((4,), jnp.float32), jax.ShapeDtypeStruct((300,), jnp.float32))

    def flash(q, k, v, scale, key_bias):
        def scaled(score, b, h, i, j):
            return score * scale[h] + key_bias[j]

        return flash_attention(q, k, v, score_mod=scaled, causal=True, **PALLAS)

    def grad(q, k, v, *arrays):
        return jax.grad(lambda *a: _loss(lambda q, k, v: flash(q, k, v, *a[3:]), *a[:3]),
                        argnums=(0, 1, 2, 3, 4))(q, k, v, *arrays)

    def jvp(q, k, v, *arrays):
        return jax.jvp(lambda q, *a: flash(q, k, v, *a)[0], (q, *arrays), (q, *arrays))

    for fn, kernels in ((grad, 2), (jvp, 1)):
        exported = jax.export.export(jax.jit(fn), platforms=("tpu",))(q, kv, kv, *arrays)
        assert exported.mlir_module().count("tpu_custom_call") == kernels, fn.__name__


def test_lookups_by_the_offset_lower_to_mosaic_kernels():
    """A plain score_mod `score + table[h, clip(kv_idx - q_idx)]`, recognised as a
    relative term, exports for a TPU to the two Mosaic kernels of a gradient."""
    table = jnp.linspace(0.0, -1.0, 4 * 17).reshape(4, 17)

    def looked_up(score, b, h, q_idx, kv_idx):
        return score + table[h, jnp.clip(kv_idx - q_idx + 8, 0, 16)]

    def grad(q, k, v):
        return jax.grad(lambda q, k, v: _loss(functools.partial(
            flash_attention, score_mod=looked_up, causal=True, **PALLAS), q, k, v),
            argnums=(0, 1, 2))(q, k, v)

    q = jax.ShapeDtypeStruct((2, 4, 160, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 2, 300, 64), jnp.bfloat16)
    exported = jax.export.export(jax.jit(grad), platforms=("tpu",))(q, kv, kv)
    assert exported.mlir_module().count("tpu_custom_call") == 2


def _kernel_results(text: str) -> dict[str, int]:
    """How many arrays each Mosaic kernel of an exported module writes, by kernel name."""
    results = {}
    for line in text.splitlines():
        if "tpu_custom_call" in line and "kernel_name" in line:
            name = re.search(r'kernel_name = "?(\w+)', line).group(1)
            results[name] = line.rsplit(") -> ", 1)[1].count("tensor<")
    return results


def test_the_forward_writes_only_the_statistics_a_program_reads():
    """The forward kernel writes its lse and max scores (lane-replicated: each 4x the
    bytes of a bf16 output of head dim 128) only where the compiled program reads them:
    the output alone for a forward-only program, the lse too under a gradient, all three
    with `return_max_scores` read; under `vmap` too. So does the jvp kernel."""
    q = jax.ShapeDtypeStruct((1, 4, 1024, 128), jnp.bfloat16)

    def forward(q, k, v):
        return flash_attention(q, k, v, causal=True, **PALLAS)[0]

    def grad(q, k, v):
        return jax.grad(lambda q: jnp.sum(forward(q, k, v).astype(jnp.float32)))(q)

    def everything(q, k, v):
        return flash_attention(q, k, v, causal=True, return_max_scores=True, **PALLAS)

    for fn, (q_in, written) in {forward: (q, 1), grad: (q, 2), everything: (q, 3),
                               jax.vmap(forward): (jax.ShapeDtypeStruct((2, *q.shape),
                                                                        q.dtype), 1)}.items():
        exported = jax.export.export(jax.jit(fn), platforms=("tpu",))(q_in, q_in, q_in)
        assert _kernel_results(exported.mlir_module())["eqx_flash_forward"] == written, fn

    # The one-pass jvp kernel likewise: the output and its tangent; the lse and its
    # tangent too where read (the max scores are not).
    def jvp(q, k, v):
        return jax.jvp(forward, (q, k, v), (q, k, v))

    def jvp_lse(q, k, v):
        return jax.jvp(lambda q, k, v: flash_attention(q, k, v, causal=True, **PALLAS),
                       (q, k, v), (q, k, v))

    for fn, written in ((jvp, 2), (jvp_lse, 4)):
        exported = jax.export.export(jax.jit(fn), platforms=("tpu",))(q, q, q)
        results = _kernel_results(exported.mlir_module())
        assert results == {"eqx_flash_forward_and_tangent": written}, (fn, results)


def test_unread_results_are_dropped_only_where_safe():
    """`_unread_outputs`, on a toy call: optional results a jitted program does not read
    are dropped from the call (its dead-code rule), required ones never; under `vmap`
    too. A `run` that reads a traced value it closes over (which the rebuilt call could
    not) is run as it is, and still gives the right values."""
    from jax._src.interpreters import partial_eval as pe

    from eqx_flash._kernels.pallas_tpu._unread_outputs import call_writing_read_results

    def run(x, written):
        return [f(x) for f, w in zip((jnp.sin, jnp.cos, jnp.exp), written, strict=True) if w]

    def first(x, run=run):
        return call_writing_read_results(run, (x,), 3, optional=(1, 2))[0]

    def calls(fn, x):
        jaxpr = jax.make_jaxpr(fn)(x).jaxpr
        jaxpr = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))[0]
        found = []

        def walk(j):
            for eqn in j.eqns:
                if eqn.primitive.name == "eqx_flash_unread_outputs":
                    found.append(eqn.params["written"])
                for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                    walk(sub)
        walk(jaxpr)
        return found

    x = jnp.linspace(0.0, 1.0, 8)
    assert calls(first, x) == [(True, False, False)]
    assert calls(jax.vmap(first), x[None]) == [(True, False, False)]
    # Only the optional ones go: the third is read by no one, but kept.
    only_second = jax.jit(lambda x: call_writing_read_results(run, (x,), 3, optional=(1,))[0])
    assert calls(only_second, x) == [(True, False, True)]
    np.testing.assert_allclose(jax.jit(first)(x), jnp.sin(x))

    def leaky(x):
        y = 2.0 * x  # traced, closed over
        return call_writing_read_results(lambda x, written: run(x + y, written), (x,), 3,
                                         optional=(1, 2))[0]

    assert calls(leaky, x) == []
    np.testing.assert_allclose(jax.jit(leaky)(x), jnp.sin(3.0 * x), rtol=1e-6)


_SSA = re.compile(r"\s*(%[\w#]+) = ([\w.]+) (.*)")
# Element bits of the types these checks read (an i1 array takes a byte in HBM).
_BITS = {"i1": 1, "i8": 8, "i16": 16, "bf16": 16, "f16": 16, "i32": 32, "ui32": 32, "f32": 32}


def _mask_layout_conflicts(module: str) -> list[str]:
    """The ops of a Mosaic module that its layout inference rejects on a TPU (and no
    export sees): an elementwise op on masks (i1 vectors) takes the layout of its first
    operand and relays the others out to it where their bit widths differ (a mask's is
    the width of the values compared); a first operand broadcast along rows or columns
    has a layout no unbroadcast mask can take. Found on a TPU: Flax's dense mask
    (compared as int8) after the key-padding band (a row broadcast). Likewise a select
    between two splats (replicated everywhere) whose condition's bit width is not its
    values': the condition would have to take the splats' layout."""
    width: dict[str, int] = {}
    broadcasts: set[str] = set()
    splats: set[str] = set()  # every entry one scalar: a constant or a scalar broadcast
    conflicts = []
    for line in module.splitlines():
        match = _SSA.match(line)
        if match is None or "vector<" not in line:
            continue
        name, op, rest = match.groups()
        # Sibling regions number their values afresh too: the latest definition is the one
        # a later use sees.
        width.pop(name, None)
        broadcasts.discard(name)
        splats.discard(name)
        operands = re.findall(r"%[\w#]+", rest.split(":")[0])
        types = re.findall(r"x(i1|i8|i16|i32|bf16|f16|f32)>", rest)
        if op == "arith.constant" and "dense<" in rest and "[" not in rest or (
                op == "vector.broadcast" and re.search(r": (i\d+|bf16|f16|f32) to", rest)):
            splats.add(name)
        if op in ("arith.cmpi", "arith.cmpf"):
            width[name] = _BITS[types[0]]
        elif op == "arith.select" and types and types[0] == "i1":
            condition, *values = operands
            if all(x in splats for x in values) and width.get(condition, 32) != _BITS.get(
                    types[-1], 32):
                conflicts.append(line.strip())
        elif types and types[-1] == "i1" and op in ("vector.broadcast", "vector.shape_cast"):
            width[name] = width.get(operands[0], 32)
            if op == "vector.broadcast":
                broadcasts.add(name)
        elif types and types[-1] == "i1" and op in ("arith.andi", "arith.ori", "arith.xori"):
            first, *others = operands
            width[name] = width.get(first, 32)
            if first in broadcasts and any(width.get(o, 32) != width[name] for o in others):
                conflicts.append(line.strip())
    return conflicts


MASKS = {
    "Flax's dense mask": dict(attn_mask=(1, 1, 1)),
    "dense mask, causal": dict(attn_mask=(1, 1, 1), causal=True),
    "dense mask, key mask": dict(attn_mask=(1, 1, 1), mask=True),
    "dense mask per head, window": dict(attn_mask=(2, 4, 1), window=(64, 0)),
    "dense mask, segment ids, dropout": dict(attn_mask=(1, 1, 1), segments=True,
                                             dropout_rate=0.1),
    "key mask, mask_mod": dict(mask=True, mask_mod=sliding_prefix),
}


@pytest.mark.skipif(_TO_ASM is None, reason="this jax has no tpu_custom_call."
                    "_lower_mosaic_module_to_asm to read the Mosaic modules from")
@pytest.mark.parametrize("seq", [512, 500])
@pytest.mark.parametrize("name", list(MASKS))
def test_masks_take_layouts_mosaic_can_give_them(name, seq, mosaic_modules):
    """The masks the kernels combine never ask Mosaic for a relayout it cannot do (see
    `_mask_layout_conflicts`; `mosaic_modules` checks them), at the default blocks with
    and without key padding: the forward and backward kernels of a gradient (fails
    before Flax's mask was compared in int32 and the broadcast mask put second)."""
    case = dict(MASKS[name])
    options: dict = dict(causal=case.pop("causal", False), **PALLAS)
    shape = case.pop("attn_mask", None)
    arrays = {}
    if shape is not None:
        arrays["attn_mask"] = jax.ShapeDtypeStruct((*shape[:2], seq, seq), jnp.bool_)
    if case.pop("mask", False):
        arrays["mask"] = jax.ShapeDtypeStruct((2, seq), jnp.bool_)
    if case.pop("segments", False):
        arrays["q_segment_ids"] = arrays["kv_segment_ids"] = jax.ShapeDtypeStruct(
            (2, seq), jnp.int32)
    if case.get("dropout_rate"):
        options["key"] = jax.random.key(0)
    options.update(case)
    q = jax.ShapeDtypeStruct((2, 4, seq, 64), jnp.bfloat16)

    def grad(q, k, v, arrays):
        flash = functools.partial(flash_attention, **options, **arrays)
        return jax.grad(functools.partial(_loss, flash), argnums=(0, 1, 2))(q, k, v)

    jax.export.export(jax.jit(grad), platforms=("tpu",))(q, q, q, arrays)
    assert len(mosaic_modules) >= 2, len(mosaic_modules)  # the forward, the fused backward
    conflicts = [c for module in mosaic_modules for c in _mask_layout_conflicts(module)]
    assert not conflicts, conflicts


_TENSOR = re.compile(r"tensor<([\dx]+)x(f32|bf16|f16|i32|ui32|i8|i1)>")


def _largest_tiled_arrays(module: str, count: int = 3) -> list[tuple[int, str]]:
    """The module's largest arrays in MiB with their last two dimensions padded to a
    TPU's (8, 128) tiles, as its HBM holds them (an upper bound where XLA picks another
    layout)."""
    sizes = set()
    for match in _TENSOR.finditer(module):
        dims = [int(d) for d in match.group(1).split("x")]
        if len(dims) >= 2:
            dims[-2] = -(-dims[-2] // 8) * 8
        dims[-1] = -(-dims[-1] // 128) * 128
        sizes.add((int(np.prod(dims)) * -(-_BITS[match.group(2)] // 8) // 2**20, match.group(0)))
    return sorted(sizes, reverse=True)[:count]


def test_relative_terms_hold_no_padded_index_arrays():
    """T5's bias at 16k tokens, exported for a TPU: no array of the program outside the
    kernels is larger than the bias vector's diagonals (16 heads × 128 × 32k float32,
    256 MiB). The diagonals were a gather whose `(128, 32k, 1)` index array a TPU pads to
    2 GiB, and the vector's lookup indices for all heads at once 256 MiB more (2.3 GiB of
    compiled temporaries measured on a v5e)."""
    seq = 16384
    q = jax.ShapeDtypeStruct((1, 16, seq, 128), jnp.bfloat16)
    bias = RelativePositionBias(16, key=jax.random.key(0))

    def grad(q, k, v, bias):
        return jax.grad(lambda *a: _loss(functools.partial(
            flash_attention, score_mod=a[3], **PALLAS), *a[:3]), argnums=(0, 1, 2, 3))(
            q, k, v, bias)

    module = jax.export.export(jax.jit(grad), platforms=("tpu",))(q, q, q, bias).mlir_module()
    largest = _largest_tiled_arrays(module)
    assert largest[0][0] <= 256, largest


def test_a_bias_the_batch_broadcasts_over_sums_its_cotangent_in_the_kernel():
    """A trained bias shared by the batch (`(heads, seq_q, seq_k)`), exported for a TPU:
    the dq kernel sums its cotangent over the batch in VMEM (a batch-inner grid), so no
    array of the program is larger than the bias's cotangent in float32 (32 MiB here;
    the conversions jax emits around the kernel's bf16 output, which XLA folds away).
    It wrote one per batch element before (4×, 128 MiB; at seq 4096 and batch 4 on a v5e,
    4.2 GiB of compiled temporaries), summed afterwards. A bias per batch element keeps
    the ordinary grid."""
    q = jax.ShapeDtypeStruct((4, 8, 1024, 128), jnp.bfloat16)

    def grad(q, k, v, bias):
        return jax.grad(lambda *a: _loss(functools.partial(
            flash_attention, bias=a[3], **PALLAS), *a[:3]), argnums=(0, 1, 2, 3))(
            q, k, v, bias)

    shared = jax.ShapeDtypeStruct((8, 1024, 1024), jnp.bfloat16)
    module = jax.export.export(jax.jit(grad), platforms=("tpu",))(q, q, q, shared).mlir_module()
    largest = _largest_tiled_arrays(module)
    assert largest[0][0] <= 32, largest
    # ... written by the kernel in the bias's dtype (a float32 accumulator in VMEM).
    assert "1x8x1x1x1x1024x1024xbf16" in module, "the cotangent is not bf16"
    per_batch = jax.ShapeDtypeStruct((4, 1, 1, 1024), jnp.bfloat16)
    module = jax.export.export(jax.jit(grad), platforms=("tpu",))(q, q, q, per_batch)
    assert _kernel_results(module.mlir_module())["eqx_flash_backward_dq"] == 2
    # Under vmap (a grid axis in front of the batch-inner grid) it lowers too.
    mapped = jax.vmap(grad, in_axes=(0, 0, 0, None))
    small = jax.ShapeDtypeStruct((2, 3, 4, 256, 128), jnp.bfloat16)
    module = jax.export.export(jax.jit(mapped), platforms=("tpu",))(
        small, small, small, jax.ShapeDtypeStruct((4, 256, 256), jnp.bfloat16))
    assert _kernel_results(module.mlir_module())["eqx_flash_backward_dq"] == 2
