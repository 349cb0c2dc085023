"""Multi-device checks, run by `test_ring.py` in a subprocess with 4 host CPU devices.

XLA reads `--xla_force_host_platform_device_count` once, when jax starts, and the main
pytest process has imported jax already; hence a fresh process. Each check prints one
JSON line `{"check": name, ...measurements}`; the assertions live in `test_ring.py`.

Run by hand: `XLA_FLAGS=--xla_force_host_platform_device_count=4 python
tests/multidevice_checks.py [check ...]`.
"""

import json
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from helpers import optimised_compilation, qkv
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import eqx_flash

P = PartitionSpec
B, H, KH, D = 2, 4, 2, 16


def _inputs(seq_q: int, seq_k: int, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 8)
    q, k, v = qkv(keys[0], (B, H, seq_q, D), (B, KH, seq_k, D))
    mask = jax.random.uniform(keys[3], (B, seq_k)) > 0.2
    # Three documents per row, boundaries not on chunk edges; segment 0 of row 1 starts late.
    q_ids = jnp.asarray(np.stack([np.arange(seq_q) * 3 // seq_q, np.arange(seq_q) * 3 // seq_q]))
    kv_ids = jnp.asarray(np.stack([np.arange(seq_k) * 3 // seq_k, np.arange(seq_k) * 3 // seq_k]))
    d_out = jax.random.normal(keys[4], (B, H, seq_q, D))
    d_lse = jax.random.normal(keys[5], (B, H, seq_q))
    return (q, k, v), mask, q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32), (d_out, d_lse)


def _value_and_vjp(fn, qkv, cotangent):
    (out, lse), pull = jax.vjp(fn, *qkv)
    return (out, lse, *pull(cotangent))


def _errors(expected, got) -> dict:
    names = ("out", "lse", "dq", "dk", "dv")
    result = {}
    for name, a, b in zip(names, expected, got, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        same_inf = bool(np.array_equal(np.isneginf(a), np.isneginf(b)))
        with np.errstate(invalid="ignore"):  # -inf - -inf where both rows are empty
            finite = np.where(np.isinf(a) | np.isinf(b), 0.0, a - b)
        result[name] = float(np.max(np.abs(finite))) if same_inf else float("inf")
        result[name + "_finite"] = bool(np.all(np.isfinite(b[~np.isneginf(b)])))
    return result


def _compare(ring_fn, seq_q: int, seq_k: int, **kwargs) -> dict:
    """Single-device `flash_attention` against `ring_fn(q, k, v, mask, q_ids, kv_ids)`."""
    qkv, mask, q_ids, kv_ids, cot = _inputs(seq_q, seq_k)

    def single(q, k, v):
        return eqx_flash.flash_attention(
            q, k, v, mask, q_segment_ids=q_ids, kv_segment_ids=kv_ids, **kwargs
        )

    def ring(q, k, v):
        return ring_fn(q, k, v, mask, q_ids, kv_ids)

    expected = jax.jit(lambda *a: _value_and_vjp(single, a, cot))(*qkv)
    got = jax.jit(lambda *a: _value_and_vjp(ring, a, cot))(*qkv)
    result = _errors(expected, got)
    result["rows_without_keys"] = int(np.sum(np.isneginf(np.asarray(expected[1]))))
    return result


def _ring_in_shard_map(mesh, layout, block, **kwargs):
    """`ring_flash_attention` called by hand, the way a user of the low-level API would."""
    n = mesh.shape["seq"]

    def arrange(x, axis):
        return eqx_flash.to_ring_layout(x, num_devices=n, layout=layout, axis=axis)

    def local(q, k, v, mask, q_ids, kv_ids):
        return eqx_flash.ring_flash_attention(
            q, k, v, mask, axis_name="seq", layout=layout, q_segment_ids=q_ids,
            kv_segment_ids=kv_ids, block_q=block, block_k=block, **kwargs,
        )

    seq, ids = P(None, None, "seq"), P(None, "seq")
    mapped = jax.shard_map(
        local, mesh=mesh, in_specs=(seq, seq, seq, ids, ids, ids), out_specs=(seq, seq),
        check_vma=False,
    )

    def fn(q, k, v, mask, q_ids, kv_ids):
        args = [arrange(x, -2) for x in (q, k, v)] + [arrange(x, -1) for x in (mask, q_ids, kv_ids)]
        out, lse = mapped(*args)
        return (
            eqx_flash.from_ring_layout(out, num_devices=n, layout=layout, axis=-2),
            eqx_flash.from_ring_layout(lse, num_devices=n, layout=layout, axis=-1),
        )

    return fn


def _seq_mesh(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("seq",))


def check_ring_full():
    """Non-causal, 4 devices, chunks of 24 with blocks of 16 (not a multiple)."""
    return _compare(_ring_in_shard_map(_seq_mesh(4), "contiguous", 16), 96, 96)


def check_ring_causal_cross():
    """Causal with seq_q != seq_k (bottom-right aligned on the global sequence)."""
    fn = _ring_in_shard_map(_seq_mesh(4), "contiguous", 16, causal=True)
    return _compare(fn, 64, 96, causal=True)


def check_ring_striped_causal():
    fn = _ring_in_shard_map(_seq_mesh(4), "striped", 16, causal=True)
    return _compare(fn, 96, 96, causal=True)


def check_sharded_zigzag_two_axes():
    """Causal, zigzag by default, batch over a `data` axis and sequence over `seq`."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "seq"))

    def fn(q, k, v, mask, q_ids, kv_ids):
        return eqx_flash.sharded_flash_attention(
            q, k, v, mask, mesh=mesh, seq_axis="seq", batch_axis="data", causal=True,
            q_segment_ids=q_ids, kv_segment_ids=kv_ids, block_q=16, block_k=16,
        )

    return _compare(fn, 96, 96, causal=True)


def check_sharded_window_heads():
    """A window (zigzag), heads over a `model` axis and sequence over `seq`."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("model", "seq"))

    def fn(q, k, v, mask, q_ids, kv_ids):
        return eqx_flash.sharded_flash_attention(
            q, k, v, mask, mesh=mesh, seq_axis="seq", head_axis="model", window=(20, 5),
            q_segment_ids=q_ids, kv_segment_ids=kv_ids, block_q=16, block_k=16,
        )

    return _compare(fn, 96, 96, window=(20, 5))


def check_sharded_lengths():
    """Causal (zigzag) with `q_lengths`/`kv_lengths` (carried as segment ids, on top of the
    key mask and the segment ids), and NaN in the padding reaching nothing."""
    mesh = _seq_mesh(4)
    lengths = jnp.array([96, 41])

    def fn(q, k, v, mask, q_ids, kv_ids):
        return eqx_flash.sharded_flash_attention(
            q, k, v, mask, mesh=mesh, seq_axis="seq", causal=True, q_segment_ids=q_ids,
            kv_segment_ids=kv_ids, q_lengths=lengths, kv_lengths=lengths, block_q=16,
            block_k=16,
        )

    result = _compare(fn, 96, 96, causal=True, q_lengths=lengths, kv_lengths=lengths)
    (q, k, v), mask, q_ids, kv_ids, cot = _inputs(96, 96)
    pad = jnp.arange(96)[None, None, :, None] >= lengths[:, None, None, None]
    clean = jax.jit(lambda *a: _value_and_vjp(lambda *b: fn(*b, mask, q_ids, kv_ids), a, cot))
    poisoned = [jnp.where(pad, jnp.nan, x) for x in (q, k, v)]
    result["nan_padding"] = _errors(clean(q, k, v), clean(*poisoned))
    return result


def check_memory():
    """Per-device compiled temp memory of forward+backward for 2 and 4 devices."""
    seq, dim = 16384, 64  # large enough that O(seq) buffers dominate
    qkv = [jax.ShapeDtypeStruct((1, 2, seq, dim), jnp.float32) for _ in range(3)]
    result = {}
    for n in (2, 4):
        mesh = _seq_mesh(n)

        def loss(q, k, v, mesh=mesh):
            out, _ = eqx_flash.sharded_flash_attention(
                q, k, v, mesh=mesh, seq_axis="seq", causal=True, block_q=256, block_k=256
            )
            return out.sum()

        with optimised_compilation():  # the program users get, not the suite's fast one
            compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*qkv).compile()
        memory = compiled.memory_analysis()
        assert memory is not None
        result[f"temp_{n}"] = int(memory.temp_size_in_bytes)
    # Forward mode on the ring: a jvp along q, k, v.
    for n in (2, 4):
        mesh = _seq_mesh(n)

        def jvp(q, k, v, mesh=mesh):
            def f(q, k, v):
                return eqx_flash.sharded_flash_attention(
                    q, k, v, mesh=mesh, seq_axis="seq", causal=True, block_q=256,
                    block_k=256)
            return jax.jvp(f, (q, k, v), (q, k, v))

        with optimised_compilation():
            compiled = jax.jit(jvp).lower(*qkv).compile()
        memory = compiled.memory_analysis()
        assert memory is not None
        result[f"jvp_temp_{n}"] = int(memory.temp_size_in_bytes)
    # Ulysses: whole sequence, heads / devices of them, per device (4 heads here).
    qkv4 = [jax.ShapeDtypeStruct((1, 4, seq, dim), jnp.float32) for _ in range(3)]
    for n in (2, 4):
        mesh = _seq_mesh(n)

        def loss4(q, k, v, mesh=mesh):
            out, _ = eqx_flash.sharded_flash_attention(
                q, k, v, mesh=mesh, seq_axis="seq", causal=True, block_q=256, block_k=256,
                strategy="ulysses")
            return out.sum()

        with optimised_compilation():
            compiled = jax.jit(jax.grad(loss4, argnums=(0, 1, 2))).lower(*qkv4).compile()
        memory = compiled.memory_analysis()
        assert memory is not None
        result[f"ulysses_temp_{n}"] = int(memory.temp_size_in_bytes)
    return result


def check_flash_sharded_inputs():
    """Plain `flash_attention` under jit with batch- and heads-sharded inputs."""
    qkv, mask, q_ids, kv_ids, cot = _inputs(64, 64)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    shard = NamedSharding(mesh, P("data", "model"))
    mask_shard = NamedSharding(mesh, P("data"))

    def fn(q, k, v, mask):
        return _value_and_vjp(
            lambda q, k, v: eqx_flash.flash_attention(q, k, v, mask, block_q=16, block_k=16),
            (q, k, v), cot,
        )

    expected = jax.jit(fn)(*qkv, mask)
    placed = [jax.device_put(x, shard) for x in qkv]
    jitted = jax.jit(fn)
    got = jitted(*placed, jax.device_put(mask, mask_shard))
    result = _errors(expected, got)
    hlo = jitted.lower(*placed, jax.device_put(mask, mask_shard)).compile().as_text()
    assert hlo is not None
    result["all_gathers"] = hlo.count("all-gather-start") + hlo.count(" all-gather(")
    result["out_sharding"] = str(got[0].sharding.spec)
    return result


def _flex_mods(table):
    """A score_mod reading a per-head array and the positions, and a mask_mod of the
    positions."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h] * ((q_idx - kv_idx) % 7).astype(score.dtype)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx + kv_idx) % 5 != 0

    return {"score_mod": score_mod, "mask_mod": mask_mod}


def _score_terms_errors(ring_fn, seq_q: int, seq_k: int, bias_shape, slopes_shape,
                        causal: bool, flex: bool = False) -> dict:
    """Relative max errors of out, lse and the cotangents of q, k, v, bias, ALiBi slopes
    and the score_mod's array: `ring_fn(q, k, v, bias, slopes, table)` against
    `plain_attention` on one device (with `_flex_mods(table)` if `flex`)."""
    keys = jax.random.split(jax.random.key(1), 8)
    q, k, v = qkv(keys[0], (B, H, seq_q, D), (B, KH, seq_k, D))
    bias = jax.random.normal(keys[3], bias_shape)
    slopes = jax.random.uniform(keys[4], slopes_shape, minval=0.05, maxval=0.5)
    table = 0.1 * jax.random.normal(keys[7], (H,))
    cot = (jax.random.normal(keys[5], (B, H, seq_q, D)), jax.random.normal(keys[6], (B, H, seq_q)))

    def reference(q, k, v, bias, slopes, table):
        return eqx_flash.plain_attention(q, k, v, causal=causal, bias=bias, alibi_slopes=slopes,
                                         **(_flex_mods(table) if flex else {}))

    def value_and_vjp(fn):
        out, pull = jax.vjp(fn, q, k, v, bias, slopes, table)
        return (*out, *pull(cot))

    expected = jax.jit(lambda: value_and_vjp(reference))()
    got = jax.jit(lambda: value_and_vjp(ring_fn))()
    return _relative_errors(("out", "lse", "dq", "dk", "dv", "dbias", "dslopes", "dtable"),
                            expected, got)


def _relative_errors(names, expected, got) -> dict:
    """Each named result's max error relative to its largest entry (at least 1), over
    the entries `expected` has finite; inf where the -inf entries differ or `got` has a
    NaN."""
    result = {}
    for name, a, b in zip(names, expected, got, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if not np.array_equal(np.isneginf(a), np.isneginf(b)) or np.any(np.isnan(b)):
            result[name] = float("inf")
            continue
        finite = np.isfinite(a)
        scale = max(1.0, float(np.max(np.abs(a[finite]), initial=0.0)))
        result[name] = float(np.max(np.abs(a[finite] - b[finite]), initial=0.0)) / scale
    return result


def check_ring_score_terms():
    """Score terms on the ring, against `plain_attention`: `sharded_flash_attention`
    causal on zigzag (the default; bias reordered on both axes) with batch over `data`,
    and `ring_flash_attention` by hand, striped, with seq_q != seq_k (query
    positions aligned bottom-right on the global sequence) and a score_mod and mask_mod
    too (global indices; query blocks that pad the rows), on 4 and 2 devices."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "seq"))

    def sharded(q, k, v, bias, slopes, table):
        return eqx_flash.sharded_flash_attention(
            q, k, v, mesh=mesh, seq_axis="seq", batch_axis="data", causal=True, bias=bias,
            alibi_slopes=slopes, block_q=8, block_k=8,
        )

    n, layout = 2, "striped"
    seq_mesh = _seq_mesh(n)

    def arrange(x, axis):
        return eqx_flash.to_ring_layout(x, num_devices=n, layout=layout, axis=axis)

    def local(q, k, v, bias, slopes, table):
        return eqx_flash.ring_flash_attention(
            q, k, v, axis_name="seq", layout=layout, bias=bias,
            alibi_slopes=slopes, block_q=6, block_k=8, **_flex_mods(table),
        )

    seq = P(None, None, "seq")
    mapped = jax.shard_map(
        local, mesh=seq_mesh, in_specs=(seq, seq, seq, P(None, "seq", None), P(), P()),
        out_specs=(seq, seq), check_vma=False,
    )

    def by_hand(q, k, v, bias, slopes, table):
        # The bias's rows are sharded with the queries; each device has all its columns,
        # in ring order too.
        bias = arrange(arrange(bias, -2), -1)
        out, lse = mapped(*(arrange(x, -2) for x in (q, k, v)), bias, slopes, table)
        return (
            eqx_flash.from_ring_layout(out, num_devices=n, layout=layout, axis=-2),
            eqx_flash.from_ring_layout(lse, num_devices=n, layout=layout, axis=-1),
        )

    return {
        "sharded_zigzag_causal": _score_terms_errors(sharded, 64, 64, (B, 1, 64, 64), (H,),
                                                     causal=True),
        "ring_striped_cross": _score_terms_errors(by_hand, 16, 32, (H, 16, 32), (B, H),
                                                  causal=False, flex=True),
    }


def check_ring_relative_pallas():
    """A trained T5 bias on the ring in the Pallas kernels (interpreted here), striped
    over 2 devices (a piece's global indices step by 2) and zigzag over 2 (two pieces per
    device), causal, against `plain_attention`: relative errors of out, lse and the
    cotangents of q, k, v and the bias table."""
    keys = jax.random.split(jax.random.key(3), 4)
    seq = 512
    q, k, v = qkv(keys[0], (B, H, seq, D), (B, KH, seq, D))
    module = eqx_flash.RelativePositionBias(H, num_buckets=16, max_distance=64, key=keys[1])
    module = eqx.tree_at(lambda m: m.table, module, 10.0 * module.table)
    cot = (jax.random.normal(keys[2], (B, H, seq, D)), jax.random.normal(keys[3], (B, H, seq)))
    n = 2
    mesh = _seq_mesh(n)
    spec = P(None, None, "seq")

    def value_and_vjp(fn):
        out, pull = jax.vjp(fn, q, k, v, module)
        d_q, d_k, d_v, d_module = pull(cot)
        return (*out, d_q, d_k, d_v, d_module.table)

    def reference(q, k, v, module):
        return eqx_flash.plain_attention(q, k, v, causal=True, score_mod=module)

    expected = jax.jit(lambda: value_and_vjp(reference))()
    result = {}
    for layout in ("striped", "zigzag"):
        def arrange(x, axis, inverse=False, layout=layout):
            move = eqx_flash.from_ring_layout if inverse else eqx_flash.to_ring_layout
            return move(x, num_devices=n, layout=layout, axis=axis)

        mapped = jax.shard_map(
            lambda q, k, v, m, layout=layout: eqx_flash.ring_flash_attention(
                q, k, v, axis_name="seq", layout=layout, causal=True, score_mod=m,
                kernels="pallas_tpu"),
            mesh=mesh, in_specs=(spec, spec, spec, P()), out_specs=(spec, spec),
            check_vma=False)

        def ring(q, k, v, module, arrange=arrange, mapped=mapped):
            out, lse = mapped(*(arrange(x, -2) for x in (q, k, v)), module)
            return arrange(out, -2, inverse=True), arrange(lse, -1, inverse=True)

        got = jax.jit(lambda ring=ring: value_and_vjp(ring))()
        result[layout] = _relative_errors(("out", "lse", "dq", "dk", "dv", "dtable"),
                                          expected, got)
    return result


def check_ring_user_shard_map_vma():
    """`ring_flash_attention` inside the user's own `jax.shard_map` with its default
    `check_vma=True` (#25: a key mask failed to type-check; #41: segment ids or
    positions with chunks of one block), with every array argument it takes, causal
    and not, GQA, batch 2, on 4 devices: out, lse and the cotangents of q, k, v and
    the differentiable arrays against single-device `flash_attention`.

    `"index"`: key mask, segment ids, a full bias, per-head ALiBi slopes and sinks,
    chunks of two blocks. `"positions"`: key mask, segment ids and positions (restarting
    per document, different per row), a bias broadcast over the rows, per-sequence
    slopes and sinks `(batch, 1)`, each chunk one block (the schedule's single-block
    switch on limits that vary over the mesh); not causal is a window on the positions.
    Also the refusals of what the ring does not take there, by name."""
    n, seq = 4, 64
    mesh = _seq_mesh(n)
    keys = jax.random.split(jax.random.key(2), 8)
    q, k, v = qkv(keys[0], (B, H, seq, D), (B, KH, seq, D))
    ids_np = np.stack([np.arange(seq) * 3 // seq, np.arange(seq) * 2 // seq])
    starts = np.stack([np.searchsorted(row, row, side="left") for row in ids_np])
    positions = jnp.asarray(np.arange(seq)[None] - starts + np.array([[0], [5]]), jnp.int32)
    ids = jnp.asarray(ids_np, jnp.int32)
    mask = jax.random.uniform(keys[1], (B, seq)) > 0.2
    cot = (jax.random.normal(keys[5], (B, H, seq, D)), jax.random.normal(keys[6], (B, H, seq)))
    rows, by_key, replicated = P(None, None, "seq"), P(None, "seq"), P()
    cases = {
        "index": dict(
            block=8, constants=dict(mask=mask, q_segment_ids=ids, kv_segment_ids=ids),
            differentiable=dict(bias=jax.random.normal(keys[2], (B, H, seq, seq)),
                                alibi_slopes=jax.random.uniform(keys[3], (H,), minval=0.05,
                                                                maxval=0.5),
                                sinks=jax.random.normal(keys[4], (H,))),
            specs=dict(bias=P(None, None, "seq", None)), not_causal={}),
        "positions": dict(
            block=16, constants=dict(mask=mask, q_segment_ids=ids, kv_segment_ids=ids,
                                     q_positions=positions, kv_positions=positions),
            differentiable=dict(bias=jax.random.normal(keys[2], (1, H, 1, seq)),
                                alibi_slopes=jax.random.uniform(keys[3], (B, H), minval=0.05,
                                                                maxval=0.5),
                                sinks=jax.random.normal(keys[4], (B, 1))),
            specs=dict(bias=replicated), not_causal=dict(window=(10, 3))),
    }
    by_key_args = ("mask", "q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions")
    results = {}
    for case, spec in cases.items():
        constants, differentiable = spec["constants"], spec["differentiable"]
        names = (*constants, *differentiable)
        in_specs = (rows, rows, rows, *(by_key if a in by_key_args else
                                        spec["specs"].get(a, replicated) for a in names))
        for causal in (False, True):
            options = dict(causal=True) if causal else spec["not_causal"]

            def local(q, k, v, *arrays, options=options, block=spec["block"], names=names):
                return eqx_flash.ring_flash_attention(
                    q, k, v, axis_name="seq", block_q=block, block_k=block,
                    **dict(zip(names, arrays, strict=True)), **options)

            ring = jax.shard_map(local, mesh=mesh, in_specs=in_specs,  # check_vma=True
                                 out_specs=(rows, rows))

            def single(q, k, v, *arrays, options=options, names=names):
                return eqx_flash.flash_attention(
                    q, k, v, **dict(zip(names, arrays, strict=True)), **options)

            def value_and_vjp(fn, constants=constants, differentiable=differentiable):
                def diff(q, k, v, *d):
                    return fn(q, k, v, *constants.values(), *d)

                out, pull = jax.vjp(diff, q, k, v, *differentiable.values())
                return (*out, *pull(cot))

            expected = jax.jit(lambda single=single: value_and_vjp(single))()
            got = jax.jit(lambda ring=ring: value_and_vjp(ring))()
            outputs = ("out", "lse", "dq", "dk", "dv", *(f"d{a}" for a in differentiable))
            for name, error in zip(outputs, _max_errors(expected, got), strict=True):
                results[f"{case}_{'causal' if causal else 'full'}_{name}"] = error

    def refusal(**arguments):
        def local(q, k, v):
            return eqx_flash.ring_flash_attention(q, k, v, axis_name="seq", **arguments)

        try:
            jax.shard_map(local, mesh=mesh, in_specs=(rows,) * 3, out_specs=(rows, rows))(
                q, k, v)
        except (NotImplementedError, TypeError) as e:
            return f"{type(e).__name__}: {e}"
        return ""

    results["refused_kv_lengths"] = refusal(kv_lengths=jnp.array([9, 8]))
    results["refused_score_mod"] = refusal(score_mod=lambda s, b, h, i, j: s)
    results["refused_attn_mask"] = refusal(attn_mask=jnp.ones((seq // n, seq), bool))
    results["refused_dropout"] = refusal(dropout_rate=0.1, key=jax.random.key(0))
    return results


def check_flash_in_user_shard_map():
    """`flash_attention` on each device's shard of the batch inside the user's own
    `jax.shard_map` (data parallel, `check_vma=True`), two sequences per device, with
    every per-call array at once (key mask, dense mask, segment ids, positions,
    lengths, bias, ALiBi slopes, sinks, a score_mod and a mask_mod closing over its
    arrays), causal and windowed, one block per sequence (#41: the schedule's
    single-block switch on limits that vary over the mesh failed to type-check; the
    traced mods' replay too): values, gradients, jvp (and an HVP, causal) against the
    unsharded call."""
    batch, seq = 8, 16
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    keys = jax.random.split(jax.random.key(8), 8)
    q, k, v = qkv(keys[0], (batch, H, seq, D), (batch, KH, seq, D))
    ids = jnp.asarray(np.arange(seq)[None].repeat(batch, 0) * 2 // seq, jnp.int32)
    positions = jnp.asarray(np.arange(seq)[None] + 3 * np.arange(batch)[:, None], jnp.int32)
    arrays = dict(
        mask=jax.random.uniform(keys[1], (batch, seq)) > 0.2,
        attn_mask=jax.random.uniform(keys[2], (batch, 1, seq, seq)) > 0.1,
        q_segment_ids=ids, kv_segment_ids=ids, q_positions=positions, kv_positions=positions,
        q_lengths=jnp.array([16, 12, 9, 16] * 2), kv_lengths=jnp.array([16, 14, 9, 5] * 2),
        bias=jax.random.normal(keys[3], (batch, H, seq, seq)),
        alibi_slopes=jax.random.uniform(keys[4], (batch, H), minval=0.05, maxval=0.5),
        sinks=jax.random.normal(keys[5], (batch, H)),
        table=0.3 * jax.random.normal(keys[6], (batch, H)),  # read by the mods below
        shift=jnp.arange(batch, dtype=jnp.int32) % 3)
    results = {}
    for name, options in (("causal", dict(causal=True)), ("window", dict(window=(5, 2)))):
        def attention(q, k, v, *values, options=options):
            given = dict(zip(arrays, values, strict=True))
            table, shift = given.pop("table"), given.pop("shift")
            # Closures over the shard_map's own arrays (#41: "pvary is a
            # invariant->variant collective" when the traced mod was replayed).
            return eqx_flash.flash_attention(
                q, k, v, block_q=seq, block_k=seq, **options, **given,
                score_mod=lambda s, b, h, i, j: s + table[b, h],
                mask_mod=lambda b, h, i, j: (i + j) % 5 != shift[b])

        mapped = jax.shard_map(attention, mesh=mesh, in_specs=(P("data"),) * (3 + len(arrays)),
                               out_specs=(P("data"), P("data")))  # check_vma=True
        results.update(_derivative_errors(
            name, lambda q, k, v, attention=attention: attention(q, k, v, *arrays.values()),
            lambda q, k, v, mapped=mapped: mapped(q, k, v, *arrays.values()), q, k, v,
            second_order=name == "causal"))  # (an HVP compiles the whole call twice over)
    return results


def _max_errors(expected, got) -> list[float]:
    """Max |difference| per leaf (-inf in the same places, else inf)."""
    errors = []
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if not np.array_equal(np.isneginf(a), np.isneginf(b)) or np.any(np.isnan(b)):
            errors.append(float("inf"))
            continue
        finite = np.isfinite(a)
        scale = max(1.0, float(np.max(np.abs(a[finite]), initial=0.0)))
        errors.append(float(np.max(np.abs(a[finite] - b[finite]), initial=0.0)) / scale)
    return errors


# The cases of each check that also compare an HVP: second order costs the most to
# compile, so each check compares it on one of its fullest cases (`test_ring.py`
# asserts one per check).
SECOND_ORDER = {
    "all_gather": ("causal_everything", "head_axis"),  # one per check of `_all_gather`
    "ulysses": ("two_batch_axes",),
    "positions": ("all_gather",),
}


def _derivatives(fn, q, k, v, second_order: bool = True) -> tuple:
    """`fn(q, k, v) -> (out, lse)`'s values, the gradients of a nonlinear loss, a jvp and
    an HVP (along q, k, v; not with `second_order=False`), in one compiled program."""
    def derivatives():
        def loss(q, k, v):
            out, lse = fn(q, k, v)
            return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

        grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        jvp = jax.jvp(fn, (q, k, v), (jnp.cos(q), k, v))[1]
        if not second_order:
            return fn(q, k, v), grads, jvp
        hvp = jax.jvp(jax.grad(loss), (q, k, v), (jnp.cos(q), k, v))[1]
        return fn(q, k, v), grads, jvp, hvp

    return jax.jit(derivatives)()


def _derivative_errors(name: str, expected_fn, fn, q, k, v, second_order: bool = True,
                       expected: tuple | None = None) -> dict:
    """`{name_values, name_grads, name_jvp, name_hvp: max error}` of `fn` against
    `expected_fn` (`_derivatives`; `expected`: those of `expected_fn`, computed already)."""
    if expected is None:
        expected = _derivatives(expected_fn, q, k, v, second_order)
    got = _derivatives(fn, q, k, v, second_order)
    return {f"{name}_{part}": max(_max_errors(a, b))
            for part, a, b in zip(("values", "grads", "jvp", "hvp")[:len(got)], expected, got,
                                  strict=True)}


def _reference_derivatives(expected: dict, reference: str | None, single, q, k, v,
                           second_order: bool) -> tuple:
    """The single-device `_derivatives` of a case: those of the case named `reference`
    (in `expected`, by case name) where its single-device call is this one's, else
    computed; cut to `_derivative_errors`' parts (an HVP only if `second_order`)."""
    parts = 4 if second_order else 3
    if reference is None:
        return _derivatives(single, q, k, v, second_order)
    assert len(expected[reference]) >= parts, (reference, "compared no HVP")
    return expected[reference][:parts]


def check_ulysses():
    """`sharded_flash_attention(strategy="ulysses")` against single-device
    `flash_attention` with every option at once (key mask, causal, window, softcap,
    segment ids, lengths, bias, ALiBi, sinks, a head-dependent score_mod and mask_mod):
    values, gradients, jvp (and an HVP: `SECOND_ORDER`); GQA with kv heads divisible by
    the devices and MQA (fewer than them: repeated); batch and heads sharded over a 2 x 2 mesh; the
    program's all-to-alls; and the errors for head counts that do not split."""
    seq = 64
    keys = jax.random.split(jax.random.key(3), 8)
    table = jax.random.normal(keys[3], (8,))
    ids = jnp.asarray(np.stack([np.arange(seq) * 3 // seq, np.arange(seq) * 2 // seq]),
                      jnp.int32)
    options = dict(
        mask=jax.random.uniform(keys[4], (B, seq)) > 0.2, window=(20, None), softcap=3.0,
        q_segment_ids=ids, kv_segment_ids=ids, kv_lengths=jnp.array([60, 50]),
        score_mod=lambda s, b, h, i, j: s + table[h] * 0.1 * (i - j),
        mask_mod=lambda b, h, i, j: (i + j + h) % 7 != 0, block_q=8, block_k=8)
    results, expected = {}, {}

    def compare(name, mesh, heads, kv_heads, causal, lead=(B,), reference=None, **axes):
        # `reference`: a case named already whose single-device call is this one's (the
        # same inputs and options; only the mesh differs), its derivatives reused.
        q = jax.random.normal(keys[0], (*lead, heads, seq, D))
        k, v = (jax.random.normal(x, (*lead, kv_heads, seq, D)) for x in keys[1:3])
        extra = dict(bias=jax.random.normal(keys[5], (*lead, heads, seq, seq)),
                     alibi_slopes=jnp.linspace(0.1, 0.4, heads),
                     sinks=jnp.linspace(-1.0, 1.0, heads), causal=causal)

        def single(q, k, v):
            return eqx_flash.flash_attention(q, k, v, **options, **extra)

        def ulysses(q, k, v):
            return eqx_flash.sharded_flash_attention(
                q, k, v, mesh=mesh, seq_axis="seq", strategy="ulysses", **axes, **options,
                **extra)

        second_order = name in SECOND_ORDER["ulysses"]
        expected[name] = _reference_derivatives(expected, reference, single, q, k, v,
                                                second_order)
        results.update(_derivative_errors(name, single, ulysses, q, k, v, second_order,
                                          expected[name]))
        text = jax.jit(ulysses).lower(q, k, v).as_text()
        results[f"{name}_all_to_all"] = text.count("all_to_all") + text.count("all-to-all")

    seq_mesh = _seq_mesh(4)
    compare("gqa_divisible", seq_mesh, 8, 4, causal=True)
    compare("mqa", seq_mesh, 4, 1, causal=False)  # kv heads repeated up to the devices
    grid = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "seq"))
    heads_grid = Mesh(np.array(jax.devices()).reshape(2, 2), ("model", "seq"))
    compare("head_axis", heads_grid, 8, 4, causal=True, reference="gqa_divisible",
            head_axis="model")
    # Two batch axes, the first sharded: the mods' flat batch index is global.
    options.update(score_mod=lambda s, b, h, i, j: s + table[h] * 0.1 * (i - j) + 0.2 * b,
                   mask_mod=lambda b, h, i, j: (i + j + h + b) % 7 != 0,
                   mask=jax.random.uniform(keys[4], (2, 2, seq)) > 0.2,
                   q_segment_ids=None, kv_segment_ids=None, kv_lengths=None)
    compare("two_batch_axes", grid, 4, 2, causal=True, lead=(2, 2), batch_axis="data")

    def error(**shapes):
        q = jnp.ones((B, shapes["heads"], seq, D))
        k = jnp.ones((B, shapes["kv_heads"], seq, D))
        try:
            eqx_flash.sharded_flash_attention(q, k, k, mesh=seq_mesh, seq_axis="seq",
                                              strategy="ulysses")
        except ValueError as e:
            return str(e)
        return ""

    results["error_heads"] = error(heads=6, kv_heads=6)
    results["error_kv_heads"] = error(heads=12, kv_heads=3)
    return results


def check_ring_forward_mode():
    """jax.jvp through the ring (#25) on 4 devices against the single-device jvp:
    `sharded_flash_attention` (zigzag causal and contiguous full; GQA, key mask, segment
    ids, kv_lengths, bias, ALiBi, sinks; tangents along q, k, v, bias, slopes, sinks),
    `ring_flash_attention` inside a user's shard_map with check_vma=True (key mask,
    segment ids, positions, chunks of one block), and the sCM/MeanFlow pattern (grad of
    a loss on the jvp's primal, stop_gradient on a target built from its tangent)."""
    seq = 64
    mesh = _seq_mesh(4)
    keys = jax.random.split(jax.random.key(4), 12)
    q, k, v = qkv(keys[0], (B, H, seq, D), (B, KH, seq, D))
    ids = jnp.asarray(np.stack([np.arange(seq) * 3 // seq, np.arange(seq) * 2 // seq]),
                      jnp.int32)
    mask = jax.random.uniform(keys[1], (B, seq)) > 0.2
    bias = jax.random.normal(keys[2], (B, H, seq, seq))
    slopes = jax.random.uniform(keys[3], (H,), minval=0.05, maxval=0.5)
    sinks = jax.random.normal(keys[4], (H,))
    primals = (q, k, v, bias, slopes, sinks)
    tangents = tuple(jax.random.normal(key, x.shape)
                     for key, x in zip(keys[6:], primals, strict=True))
    results = {}

    def options(causal):
        return dict(causal=causal, q_segment_ids=ids, kv_segment_ids=ids,
                    kv_lengths=jnp.array([seq, seq - 9]) if causal else None)

    for causal in (False, True):
        def sharded(q, k, v, bias, slopes, sinks, causal=causal):
            kw = options(causal)
            if causal:  # the ring aligns lengths on the global sequence: equal ones
                kw["q_lengths"] = kw["kv_lengths"]
            return eqx_flash.sharded_flash_attention(
                q, k, v, mask, mesh=mesh, seq_axis="seq", bias=bias, alibi_slopes=slopes,
                sinks=sinks, block_q=8, block_k=8, **kw)

        def single(*args, causal=causal):
            kw = options(causal)
            if causal:
                kw["q_lengths"] = kw["kv_lengths"]
            q, k, v, bias, slopes, sinks = args
            return eqx_flash.flash_attention(q, k, v, mask, bias=bias, alibi_slopes=slopes,
                                             sinks=sinks, **kw)

        expected = jax.jit(lambda: jax.jvp(single, primals, tangents))()
        got = jax.jit(lambda sharded=sharded: jax.jvp(sharded, primals, tangents))()
        name = "zigzag_causal" if causal else "contiguous_full"
        results[name] = max(_max_errors(expected, got))

    rows = P(None, None, "seq")
    # Positions per row, each chunk one block: the run-time limits vary over the mesh.
    positions = jnp.asarray(np.arange(seq)[None] + np.array([[0], [7]]), jnp.int32)

    def local(q, k, v, mask, ids, positions):
        return eqx_flash.ring_flash_attention(q, k, v, mask, axis_name="seq", causal=True,
                                              q_segment_ids=ids, kv_segment_ids=ids,
                                              q_positions=positions, kv_positions=positions,
                                              block_q=16, block_k=16)

    ring = jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, *[P(None, "seq")] * 3),
                         out_specs=(rows, rows))

    def user_ring(q, k, v):
        return ring(q, k, v, mask, ids, positions)

    def user_single(q, k, v):
        return eqx_flash.flash_attention(q, k, v, mask, causal=True, q_segment_ids=ids,
                                         kv_segment_ids=ids, q_positions=positions,
                                         kv_positions=positions)

    expected = jax.jit(lambda: jax.jvp(user_single, primals[:3], tangents[:3]))()
    got = jax.jit(lambda: jax.jvp(user_ring, primals[:3], tangents[:3]))()
    results["user_shard_map_check_vma"] = max(_max_errors(expected, got))

    def scm_grad(fn):
        def loss(q):
            out, d_out = jax.jvp(lambda q: fn(q, k, v)[0], (q,), (tangents[0],))
            return jnp.mean((out - jax.lax.stop_gradient(out - 0.1 * d_out)) ** 2)

        return jax.grad(loss)(q)

    expected = jax.jit(lambda: scm_grad(user_single))()
    got = jax.jit(lambda: scm_grad(user_ring))()
    results["scm_pattern"] = max(_max_errors(expected, got))
    return results


# The all_gather cases, in two checks of about equal cost (each its own subprocess, so
# that the two test workers share them out): the sequence axis alone (and the batch axis
# too, whose single-device call is `causal_everything`'s), and the heads and two batch
# axes sharded with it.
ALL_GATHER_CASES = {
    "all_gather": ("causal_everything", "window", "full_cross"),
    "all_gather_sharded_axes": ("head_axis", "two_batch_axes"),
}


def check_all_gather():
    return _all_gather(ALL_GATHER_CASES["all_gather"])


def check_all_gather_sharded_axes():
    return _all_gather(ALL_GATHER_CASES["all_gather_sharded_axes"])


def _all_gather(cases: tuple[str, ...]) -> dict:
    """`sharded_flash_attention(strategy="all_gather")` against single-device
    `flash_attention`, values, gradients, jvp (and an HVP: `SECOND_ORDER`), for the
    `cases` named: causal (zigzag) and windowed with
    GQA, key mask, segment ids, lengths, bias, ALiBi, sinks, a score_mod and mask_mod on
    global indices; full attention (contiguous) with seq_q != seq_k; batch and heads
    sharded over a 2 x 2 mesh (two batch axes, mods reading the batch and head); the
    program's all-gathers."""
    keys = jax.random.split(jax.random.key(5), 8)
    table = jax.random.normal(keys[3], (8,))
    results, expected = {}, {}

    def compare(name, seq_q, seq_k, mesh=None, lead=(B,), heads=H, kv_heads=KH, axes=None,
                reference=None, **options):
        # (An HVP compiles the whole call twice over: `SECOND_ORDER` cases only.)
        # `reference`: a case named already whose single-device call is this one's (the
        # same inputs and options; only the mesh differs), its derivatives reused.
        if name not in cases:
            return
        q = jax.random.normal(keys[0], (*lead, heads, seq_q, D))
        k, v = (jax.random.normal(x, (*lead, kv_heads, seq_k, D)) for x in keys[1:3])
        options = dict(bias=jax.random.normal(keys[5], (*lead, heads, seq_q, seq_k)),
                       alibi_slopes=jnp.linspace(0.1, 0.4, heads),
                       sinks=jnp.linspace(-1.0, 1.0, heads),
                       mask=jax.random.uniform(keys[4], (*lead, seq_k)) > 0.2, block_q=8,
                       block_k=8) | options

        def single(q, k, v):
            return eqx_flash.flash_attention(q, k, v, **options)

        def gathered(q, k, v):
            return eqx_flash.sharded_flash_attention(
                q, k, v, mesh=mesh or _seq_mesh(4), seq_axis="seq", strategy="all_gather",
                **(axes or {}), **options)

        second_order = name in SECOND_ORDER["all_gather"]
        expected[name] = _reference_derivatives(expected, reference, single, q, k, v,
                                                second_order)
        results.update(_derivative_errors(name, single, gathered, q, k, v, second_order,
                                          expected[name]))
        text = jax.jit(gathered).lower(q, k, v).as_text()
        results[f"{name}_all_gather"] = text.count("all_gather") + text.count("all-gather")

    seq = 64
    ids = jnp.asarray(np.stack([np.arange(seq) * 3 // seq, np.arange(seq) * 2 // seq]),
                      jnp.int32)
    everything = dict(
        causal=True, q_segment_ids=ids, kv_segment_ids=ids, q_lengths=jnp.array([60, 40]),
        kv_lengths=jnp.array([64, 50]),
        score_mod=lambda s, b, h, i, j: s + table[h] * 0.01 * (i - j) + 0.1 * b,
        mask_mod=lambda b, h, i, j: (i + 2 * j + b + h) % 7 != 0)
    compare("causal_everything", seq, seq, **everything)
    compare("window", seq, seq, window=(9, 3), softcap=3.0)
    compare("full_cross", 32, 64)
    grid = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "seq"))
    heads_grid = Mesh(np.array(jax.devices()).reshape(2, 2), ("model", "seq"))
    compare("head_axis", seq, seq, heads_grid, heads=8, kv_heads=4,
            axes=dict(head_axis="model"), **everything)
    # Two batch axes, the first sharded: the mods' flat batch index is global.
    compare("two_batch_axes", seq, seq, grid, lead=(2, 2), axes=dict(batch_axis="data"),
            window=(20, 0), alibi_slopes=None,
            score_mod=lambda s, b, h, i, j: s + 0.1 * b * table[h],
            mask_mod=lambda b, h, i, j: (i + j + b) % 5 != 0)
    return results


def check_positions():
    """`q_positions`/`kv_positions` on 4 devices against single-device `flash_attention`:
    packed documents with restarting positions (causal and ALiBi on them, segment ids,
    GQA, a key mask, sinks) through the ring in each layout, Ulysses and all_gather;
    a causal window on the positions of a chunk at an offset (seq_q != seq_k), with
    lengths. Values, gradients and jvp (and an HVP: `SECOND_ORDER`)."""
    keys = jax.random.split(jax.random.key(7), 8)
    results = {}
    seq = 64
    ids = np.stack([np.arange(seq) * 3 // seq, np.arange(seq) * 2 // seq]).astype(np.int32)
    starts = np.stack([np.searchsorted(row, row, side="left") for row in ids])
    restarting = (np.arange(seq)[None] - starts).astype(np.int32)
    packed = dict(q_segment_ids=jnp.asarray(ids), kv_segment_ids=jnp.asarray(ids),
                  q_positions=jnp.asarray(restarting), kv_positions=jnp.asarray(restarting),
                  causal=True, alibi_slopes=jnp.linspace(0.1, 0.4, H),
                  sinks=jnp.linspace(-1.0, 1.0, H),
                  mask=jax.random.uniform(keys[4], (B, seq)) > 0.2, block_q=8, block_k=8)
    offset = dict(q_positions=jnp.arange(32, dtype=jnp.int32)[None] + 20,
                  kv_positions=jnp.arange(seq, dtype=jnp.int32)[None], window=(12, 0),
                  q_lengths=jnp.array([32, 24]), kv_lengths=jnp.array([64, 50]),
                  block_q=8, block_k=8)

    def compare(name, seq_q, options, **strategy):
        q = jax.random.normal(keys[0], (B, H, seq_q, D))
        k, v = (jax.random.normal(x, (B, KH, seq, D)) for x in keys[1:3])

        def single(q, k, v):
            return eqx_flash.flash_attention(q, k, v, **options)

        def sharded(q, k, v):
            return eqx_flash.sharded_flash_attention(q, k, v, mesh=_seq_mesh(4),
                                                     seq_axis="seq", **strategy, **options)

        # The single-device derivatives once per option set, shared by the strategies
        # compared against them (an HVP where one is compared: such a case comes first).
        key = (id(options), seq_q)
        second_order = name in SECOND_ORDER["positions"]
        if key not in expected:
            expected[key] = _derivatives(single, q, k, v, second_order)
        results.update(_derivative_errors(name, single, sharded, q, k, v, second_order,
                                          expected[key][:4 if second_order else 3]))

    expected = {}
    compare("all_gather", seq, packed, strategy="all_gather")
    for layout in ("contiguous", "zigzag", "striped"):
        compare(f"ring_{layout}", seq, packed, layout=layout)
    compare("ulysses", seq, packed, strategy="ulysses")
    compare("ring_offset_lengths", 32, offset)
    compare("all_gather_offset_lengths", 32, offset, strategy="all_gather")
    compare("ulysses_offset_lengths", 32, offset, strategy="ulysses")
    return results


def check_traced_lengths():
    """Out-of-range lengths inside `jax.jit` on multi-device programs: clamped, never an
    abort (an `eqx.error_if` followed by collectives hung, then killed the process).
    `sharded_flash_attention`, causal, with `kv_lengths - q_lengths != seq_k - seq_q` and
    a length past the sequence; `flash_attention` with the batch sharded over 4 devices
    and `kv_lengths` past `seq_k` and below 0. Each against the in-range-equivalent call."""
    result = {}
    (q, k, v), *_ = _inputs(64, 64)
    mesh = _seq_mesh(4)

    def sharded(q_lengths, kv_lengths):
        return eqx_flash.sharded_flash_attention(
            q, k, v, mesh=mesh, seq_axis="seq", causal=True, q_lengths=q_lengths,
            kv_lengths=kv_lengths, block_q=16, block_k=16)

    def single(q_lengths, kv_lengths):
        return eqx_flash.flash_attention(q, k, v, causal=True, q_lengths=q_lengths,
                                         kv_lengths=kv_lengths, block_q=16, block_k=16)

    jitted = jax.jit(sharded)
    equivalent = sharded(jnp.array([64, 20]), jnp.array([64, 20]))  # eager, concrete
    reference = single(jnp.array([64, 20]), jnp.array([64, 20]))
    for name, (ql, kl) in {"mismatch": ([64, 20], [64, 30]),
                           "past_seq": ([99, 20], [64, 30])}.items():
        out, lse = jax.block_until_ready(jitted(jnp.array(ql), jnp.array(kl)))
        result[f"sharded_{name}"] = {
            "vs_equivalent": _max_diff((out, lse), equivalent),
            "vs_flash_attention": _max_diff((out, lse), reference),
            "finite": bool(np.all(np.isfinite(np.asarray(out)))),
        }

    kb = jax.random.split(jax.random.key(1), 3)
    qb, kb_, vb = (jax.random.normal(kb[i], (4, 2, 32, D)) for i in range(3))
    data = Mesh(np.array(jax.devices()[:4]), ("data",))
    qkv_shard, len_shard = NamedSharding(data, P("data")), NamedSharding(data, P("data"))
    placed = [jax.device_put(x, qkv_shard) for x in (qb, kb_, vb)]
    flash = jax.jit(lambda q, k, v, n: eqx_flash.flash_attention(q, k, v, kv_lengths=n,
                                                                 block_q=16, block_k=16))
    for name, (given, clamped) in {"past_seq": ([32, 40, 5, 6], [32, 32, 5, 6]),
                                   "negative": ([32, 40, -5, 6], [32, 32, 0, 6])}.items():
        got = jax.block_until_ready(
            flash(*placed, jax.device_put(jnp.array(given, jnp.int32), len_shard)))
        expected = eqx_flash.flash_attention(qb, kb_, vb, kv_lengths=jnp.array(clamped),
                                             block_q=16, block_k=16)
        result[f"flash_batch_sharded_{name}"] = {
            "vs_equivalent": _max_diff(got, expected),
            "finite": bool(np.all(np.isfinite(np.asarray(got[0])))),
        }
    return result


def check_max_scores():
    """`return_max_scores=True` on 4 devices: `sharded_flash_attention` in each layout
    (causal, key mask, segment ids, lengths) and `ring_flash_attention` in a shard_map,
    against single-device `flash_attention`; the max is reduced over the whole ring."""
    (q, k, v), mask, q_ids, kv_ids, _ = _inputs(96, 96)
    mesh = _seq_mesh(4)
    lengths = jnp.array([96, 41])
    common = dict(causal=True, q_segment_ids=q_ids, kv_segment_ids=kv_ids, block_q=16,
                  block_k=16, return_max_scores=True)
    *_, expected = eqx_flash.flash_attention(q, k, v, mask, **common)
    *_, expected_len = eqx_flash.flash_attention(q, k, v, mask, q_lengths=lengths,
                                                 kv_lengths=lengths, **common)
    result = {}
    for layout in ("contiguous", "zigzag", "striped"):
        *_, got = eqx_flash.sharded_flash_attention(q, k, v, mask, mesh=mesh, seq_axis="seq",
                                                    layout=layout, **common)
        result[f"sharded_{layout}"] = _max_diff((got,), (expected,))
    *_, got = eqx_flash.sharded_flash_attention(q, k, v, mask, mesh=mesh, seq_axis="seq",
                                                q_lengths=lengths, kv_lengths=lengths, **common)
    result["sharded_lengths"] = _max_diff((got,), (expected_len,))
    seq = P(None, None, "seq")
    # The ring in a shard_map, with a key mask, under check_vma=True (the default) too.
    *_, expected_ring = eqx_flash.flash_attention(q, k, v, mask, causal=True, block_q=16,
                                                  block_k=16, return_max_scores=True)
    for check_vma in (False, True):
        def local(q, k, v, m):
            return eqx_flash.ring_flash_attention(q, k, v, m, axis_name="seq", causal=True,
                                                  block_q=16, block_k=16,
                                                  return_max_scores=True)

        ring = jax.jit(jax.shard_map(
            local, mesh=mesh, in_specs=(seq, seq, seq, P(None, "seq")),
            out_specs=(seq, seq, seq), check_vma=check_vma))
        result[f"ring_check_vma_{check_vma}"] = _max_diff((ring(q, k, v, mask)[2],),
                                                          (expected_ring,))
    result["rows_without_keys"] = int(np.sum(np.isneginf(np.asarray(expected_len))))
    return result


def check_cache_overflow():
    """A linear `KVCache` run past `max_len` inside `jax.jit` with the batch sharded over 4
    devices, followed by a cross-device reduction: no runtime error (which would hang the
    collective, then abort), NaN outputs for the elements that overflowed, the rest equal
    to the same decode on one device with room to spare."""
    mha = eqx_flash.FlashMultiheadAttention(2, 16, causal=True, key=jax.random.key(0))
    data = Mesh(np.array(jax.devices()[:4]), ("data",))
    shard = NamedSharding(data, P("data"))
    x = jax.random.normal(jax.random.key(1), (4, 3, 16))
    start = jnp.array([0, 1, 3, 2], jnp.int32)  # with 3 new tokens: 3, 4, 6, 5 of max_len 5

    def caches(max_len):
        empty = jax.vmap(lambda _: mha.init_cache(max_len))(start)
        return eqx.tree_at(lambda c: c.length, empty, start)

    @eqx.filter_jit
    def decode(x, cache):
        out, cache = jax.vmap(mha.decode)(x, cache)
        return out, cache.length, jnp.sum(jnp.where(jnp.isnan(out), 0.0, out))

    placed = jax.tree.map(lambda a: jax.device_put(a, shard), (x, caches(5)))
    out, length, _ = jax.block_until_ready(decode(*placed))
    roomy, _, _ = decode(x, caches(8))
    out, roomy = np.asarray(out), np.asarray(roomy)
    return {
        "lengths": np.asarray(length).tolist(),
        "nan_elements": [bool(np.all(np.isnan(o))) for o in out],
        "fitting_vs_roomy": float(np.max(np.abs(out[[0, 1, 3]] - roomy[[0, 1, 3]]))),
    }


def _max_diff(got, expected) -> float:
    """Largest |got - expected| over (out, lse); -inf must match -inf."""
    worst = 0.0
    for a, b in zip(got, expected, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if not np.array_equal(np.isneginf(a), np.isneginf(b)):
            return float("inf")
        finite = ~np.isinf(b)
        worst = max(worst, float(np.max(np.abs(a[finite] - b[finite]), initial=0.0)))
    return worst


CHECKS = {name[len("check_"):]: fn for name, fn in globals().items() if name.startswith("check_")}


if __name__ == "__main__":
    assert len(jax.devices()) >= 4, "set XLA_FLAGS=--xla_force_host_platform_device_count=4"
    for name in sys.argv[1:] or CHECKS:
        print(json.dumps({"check": name, **CHECKS[name]()}), flush=True)
