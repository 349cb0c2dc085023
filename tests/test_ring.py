"""Ring (context-parallel) attention and sequence sharding.

The multi-device checks need several host devices, which XLA only creates if
`--xla_force_host_platform_device_count` is set before jax starts; this process has
jax already, so each check runs once in its own subprocess (`multidevice_checks.py`) and
the tests below assert on its measurements. Layout helpers and the one-device mesh run here.
"""

import functools
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import qkv
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import Mesh, PartitionSpec

import eqx_flash

HERE = pathlib.Path(__file__).parent
TOL = 2e-5


@functools.cache
def multidevice(check: str) -> dict:
    """The measurements of one check of `multidevice_checks.py`, run in its own subprocess
    (so xdist workers share the checks out) and cached for this worker."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(HERE / "multidevice_checks.py"), check],
        env=env, capture_output=True, text=True, timeout=900,
    )
    if proc.returncode != 0:
        pytest.fail(f"multidevice_checks.py {check} failed:\n{proc.stdout}\n"
                    f"{proc.stderr[-6000:]}")
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    record = json.loads(line)
    assert record.pop("check") == check
    return record


def _parts(result: dict, case: str) -> tuple[str, ...]:
    """What a check compared for `case`: values, gradients, jvp, and an HVP on the cases
    `multidevice_checks.SECOND_ORDER` names (second order costs the most to compile)."""
    return ("values", "grads", "jvp") + (("hvp",) if f"{case}_hvp" in result else ())


def _assert_second_order_compared(result: dict, cases: int = 1) -> None:
    """At least `cases` cases of a check compared an HVP (so second order never drops
    out of a check unnoticed)."""
    assert sum(name.endswith("_hvp") for name in result) >= cases, sorted(result)


RING_CHECKS = [
    "ring_full",
    "ring_causal_cross",
    "ring_striped_causal",
    "sharded_zigzag_two_axes",
    "sharded_window_heads",
    "sharded_lengths",
    "flash_sharded_inputs",
]


@pytest.mark.multidevice
@pytest.mark.parametrize("check", RING_CHECKS)
def test_matches_single_device(check):
    """out, lse, dq, dk, dv equal single-device flash_attention (GQA, key mask, segment
    ids, chunks not a multiple of the blocks); -inf rows in the same places."""
    result = multidevice(check)
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert result[name] < TOL, (name, result)
        assert result[name + "_finite"], (name, result)
    # Further facts of two checks, asserted here so that no check's subprocess runs twice.
    if check == "sharded_zigzag_two_axes":
        # Some rows see no key, so the -inf handling of the merge is exercised.
        assert result["rows_without_keys"] > 0, result
    if check == "sharded_lengths":
        # NaN in the padding of q, k, v changes no output and no gradient.
        padding = result["nan_padding"]
        for name in ("out", "lse", "dq", "dk", "dv"):
            assert padding[name] == 0.0 and padding[name + "_finite"], (name, padding)
    if check == "flash_sharded_inputs":
        # Batch- and heads-sharded inputs need no gather; the output keeps their sharding.
        assert result["all_gathers"] == 0, result
        # (older jax spells the spec PartitionSpec(...), newer jax P(...).)
        spec = result["out_sharding"].replace("PartitionSpec(", "P(")
        assert spec == "P('data', 'model')", result


@pytest.mark.multidevice
def test_memory_shrinks_with_devices():
    temp = multidevice("memory")
    assert temp["temp_4"] < 0.6 * temp["temp_2"], temp
    assert temp["jvp_temp_4"] < 0.6 * temp["jvp_temp_2"], temp  # forward mode too
    # Ulysses: each device holds heads / devices of the whole sequence.
    assert temp["ulysses_temp_4"] < 0.6 * temp["ulysses_temp_2"], temp


@pytest.mark.multidevice
def test_ring_forward_mode_matches_single_device():
    """jax.jvp through the ring on 4 devices (sharded zigzag causal and contiguous, with
    every array argument; ring_flash_attention in a user's shard_map under check_vma)
    and the sCM/MeanFlow pattern equal the single-device results."""
    result = multidevice("ring_forward_mode")
    assert len(result) == 4, result
    for name, err in result.items():
        assert err < TOL, (name, result)


@pytest.mark.multidevice
@pytest.mark.parametrize("check, cases", [
    pytest.param("all_gather", ("causal_everything", "window", "full_cross"),
                 id="all_gather"),
    pytest.param("all_gather_sharded_axes", ("head_axis", "two_batch_axes"),
                 id="all_gather_sharded_axes"),
])
def test_all_gather_matches_single_device(check, cases):
    """strategy="all_gather" (zigzag causal with every option, a window, full attention
    with seq_q != seq_k; batch and heads sharded too): values, gradients and jvp (an
    HVP on one case of each check, two in all) equal single-device flash_attention; the
    program all-gathers k and v. (Two checks, two subprocesses: the test workers share
    them out.)"""
    result = multidevice(check)
    for case in cases:
        for part in _parts(result, case):
            assert result[f"{case}_{part}"] < TOL, (case, part, result)
        assert result[f"{case}_all_gather"] >= 2, (case, result)
    _assert_second_order_compared(result)


@pytest.mark.multidevice
def test_positions_match_single_device():
    """q_positions/kv_positions (#23) on 4 devices: packed documents with restarting
    positions (causal and ALiBi on them) through the ring in each layout, Ulysses and
    all_gather, and a causal window on a chunk at an offset with lengths: values,
    gradients, jvp (an HVP on one case) equal single-device flash_attention."""
    result = multidevice("positions")
    cases = [f"ring_{layout}" for layout in ("contiguous", "zigzag", "striped")]
    cases += ["ulysses", "all_gather", "ring_offset_lengths", "all_gather_offset_lengths",
              "ulysses_offset_lengths"]
    for case in cases:
        for part in _parts(result, case):
            assert result[f"{case}_{part}"] < TOL, (case, part, result)
    _assert_second_order_compared(result)


@pytest.mark.multidevice
def test_ulysses_matches_single_device():
    """strategy="ulysses" with every option: values, gradients, jvp (an HVP on one
    case) equal single-device flash_attention (GQA split; MQA, kv heads repeated; batch
    and heads axes, two batch axes); three all-to-alls in and two out; head counts that
    do not split are ValueErrors."""
    result = multidevice("ulysses")
    cases = ("gqa_divisible", "mqa", "head_axis", "two_batch_axes")  # (batch sharded: the last)
    for case in cases:
        for part in _parts(result, case):
            assert result[f"{case}_{part}"] < TOL, (case, part, result)
        assert result[f"{case}_all_to_all"] >= 5, (case, result)
    _assert_second_order_compared(result)
    assert "heads=6, kv_heads=6, seq axis size 4" in result["error_heads"], result
    assert "heads=12, kv_heads=3, 4 devices" in result["error_kv_heads"], result


@given(
    st.sampled_from(["contiguous", "zigzag", "striped"]),
    st.integers(1, 5),
    st.integers(1, 4),
)
def test_layout_round_trip(layout, n, per_chunk):
    seq = n * per_chunk * (2 if layout == "zigzag" else 1)
    order = eqx_flash.ring_order(seq, n, layout)
    assert sorted(order.tolist()) == list(range(seq))
    x = np.arange(2 * seq).reshape(2, seq)
    there = eqx_flash.to_ring_layout(x, num_devices=n, layout=layout, axis=-1)
    np.testing.assert_array_equal(np.asarray(there), x[:, order])
    back = eqx_flash.from_ring_layout(there, num_devices=n, layout=layout, axis=-1)
    np.testing.assert_array_equal(np.asarray(back), x)


def test_zigzag_order():
    # Device 0 gets the first and last chunk, device 1 the middle two.
    np.testing.assert_array_equal(eqx_flash.ring_order(8, 2, "zigzag"), [0, 1, 6, 7, 2, 3, 4, 5])
    np.testing.assert_array_equal(eqx_flash.ring_order(6, 3, "striped"), [0, 3, 1, 4, 2, 5])


def test_layout_errors():
    with pytest.raises(ValueError, match="divisible by 4"):
        eqx_flash.ring_order(10, 2, "zigzag")
    # Under the jaxtyping test hook beartype rejects the Literal first; unchecked, our own
    # ValueError does. Either names the argument.
    with pytest.raises((ValueError, TypeError), match="layout"):
        eqx_flash.ring_order(8, 2, "spiral")  # type: ignore[arg-type]


def test_one_device_mesh(getkey):
    """`sharded_flash_attention` over a mesh of the one device here equals flash_attention."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
    q, k, v = qkv(getkey(), (2, 4, 40, 8), (2, 2, 40, 8))

    def loss(fn):
        def f(q, k, v):
            out, lse = fn(q, k, v)
            return jnp.sum(out * out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

        return jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)

    expected = loss(lambda q, k, v: eqx_flash.flash_attention(q, k, v, causal=True))
    got = loss(
        lambda q, k, v: eqx_flash.sharded_flash_attention(
            q, k, v, mesh=mesh, seq_axis="seq", causal=True, block_q=16, block_k=16
        )
    )
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=TOL, rtol=TOL)


def test_sharded_errors():
    mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
    x = jnp.zeros((2, 8, 4))
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        eqx_flash.sharded_flash_attention(x, x, x, mesh=mesh, seq_axis="sequence")
    with pytest.raises(ValueError, match="needs a batch axis"):
        eqx_flash.sharded_flash_attention(x, x, x, mesh=mesh, seq_axis="seq", batch_axis="seq")


def test_strategy_errors():
    mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
    x = jnp.zeros((2, 8, 4))
    with pytest.raises(ValueError,
                       match="strategy must be one of 'ring', 'ulysses', 'all_gather'"):
        eqx_flash.sharded_flash_attention(x, x, x, mesh=mesh, seq_axis="seq", strategy="tree")
    with pytest.raises(NotImplementedError, match="all_gather.*layout"):
        eqx_flash.sharded_flash_attention(x, x, x, mesh=mesh, seq_axis="seq",
                                          strategy="all_gather", layout="zigzag")
    with pytest.raises(NotImplementedError, match="ulysses.*block_mask"):
        bm = eqx_flash.make_block_mask(lambda b, h, i, j: i >= j, (), 2, 8, 8, 8, 8)
        eqx_flash.sharded_flash_attention(x, x, x, mesh=mesh, seq_axis="seq",
                                          strategy="ulysses", block_mask=bm)
    with pytest.raises(NotImplementedError, match="ulysses.*layout"):
        eqx_flash.sharded_flash_attention(x, x, x, mesh=mesh, seq_axis="seq",
                                          strategy="ulysses", layout="zigzag")


def _assert_same_first_derivatives(expected_fn, fn, q):
    """Values, the gradient of `sum(out)` and a jvp along q of `fn(q) -> (out, lse)` as
    `expected_fn`'s (-inf in the same places)."""
    def transforms(f):  # one compiled program (eagerly, each op is its own)
        return f(q), jax.grad(lambda q: jnp.sum(f(q)[0]))(q), jax.jvp(f, (q,), (jnp.cos(q),))[1]

    expected, got = (jax.jit(lambda f=f: transforms(f))() for f in (expected_fn, fn))
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b))
        finite = np.isfinite(a)
        np.testing.assert_allclose(a[finite], b[finite], atol=1e-5)


# Per strategy: the seed of the inputs and the options beyond the shared score_mod and
# mask_mod (all_gather's moved onto global positions).
ONE_DEVICE_CASES = {
    "ulysses": (0, dict(causal=True, softcap=2.0, kv_lengths=jnp.array([20, 11]))),
    "all_gather": (1, dict(causal=True, window=(7, 0), q_lengths=jnp.array([24, 13]),
                           kv_lengths=jnp.array([24, 17]))),
}


@pytest.mark.parametrize("strategy", list(ONE_DEVICE_CASES))
def test_strategy_on_one_device_is_flash_attention(strategy):
    """On a one-device mesh (the all-to-alls and all-gathers are identities): causal with
    lengths, ALiBi, a score_mod and mask_mod (the ring refuses them), values, gradients
    and the jvp as flash_attention's."""
    seed, extra = ONE_DEVICE_CASES[strategy]
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((2, 4, 24, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 2, 24, 8)), jnp.float32)
    options = dict(extra, alibi_slopes=jnp.array([0.1, 0.2, 0.3, 0.4]),
                   score_mod=lambda s, b, h, i, j: s + 0.01 * (h * (i - j)).astype(s.dtype),
                   mask_mod=lambda b, h, i, j: (i + j) % 5 != 0, block_q=8, block_k=8)
    _assert_strategy_is_flash_attention(strategy, q, k, options)


@pytest.mark.parametrize("strategy", ["ring", "ulysses", "all_gather"])
def test_strategy_without_batch_axes_is_flash_attention(strategy):
    """q, k, v with a heads axis but no batch axis `(heads, seq, dim)`, causal, on a
    one-device mesh: every strategy gives flash_attention's values, gradient and jvp."""
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((4, 24, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 24, 8)), jnp.float32)
    options = dict(causal=True, alibi_slopes=jnp.array([0.1, 0.2, 0.3, 0.4]), block_q=8,
                   block_k=8)
    _assert_strategy_is_flash_attention(strategy, q, k, options)


def _assert_strategy_is_flash_attention(strategy: str, q, k, options: dict):
    """`sharded_flash_attention(q, k, k)` with `strategy` on a one-device mesh gives
    flash_attention's values, gradient and jvp."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))

    def single(q):
        return eqx_flash.flash_attention(q, k, k, **options)

    def sharded(q):
        return eqx_flash.sharded_flash_attention(q, k, k, mesh=mesh, seq_axis="seq",
                                                 strategy=strategy, **options)

    _assert_same_first_derivatives(single, sharded, q)


def test_ring_outside_shard_map():
    x = jnp.zeros((2, 8, 4))
    with pytest.raises(ValueError, match="inside jax.shard_map"):
        eqx_flash.ring_flash_attention(x, x, x, axis_name="seq")


def test_causal_work_is_balanced():
    """Kernel calls per device over a causal ring: zigzag and striped give every device
    the same work (fully masked chunk pairs skipped), contiguous does not."""
    from eqx_flash._core.config import KernelConfig
    from eqx_flash._core.options import Window
    from eqx_flash._distributed.ring_plan import Ring, plan

    n, chunk = 4, 32

    def calls(layout: str) -> list[int]:
        base = KernelConfig(chunk, chunk, 16, 16, Window(None, 0), 1.0)
        variants_of = plan(Ring("seq", n, layout, base))
        return [
            sum(
                variants[table[a, b]] is not None
                for variants, table in variants_of.values()
                for b in range(n)
            )
            for a in range(n)
        ]

    assert calls("contiguous") == [1, 2, 3, 4]
    assert calls("zigzag") == [2 * n + 1] * n
    assert calls("striped") == [n] * n


def test_lengths_on_the_ring_errors():
    """`sharded_flash_attention` takes lengths (tested on 4 devices in `sharded_lengths`),
    but only where the ring's global diagonal is the valid lengths' one; the ring itself
    (on shards) refuses them, naming the argument and what to use instead."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
    q, k, v = qkv(jax.random.key(0), (2, 4, 32, 8), (2, 2, 32, 8))
    with pytest.raises(ValueError, match="kv_lengths - q_lengths"):
        eqx_flash.sharded_flash_attention(q, k, v, mesh=mesh, seq_axis="seq", causal=True,
                                          kv_lengths=jnp.array([32, 20]))
    with pytest.raises(NotImplementedError, match="kv_lengths.*sharded_flash_attention"):
        eqx_flash.ring_flash_attention(q, k, v, axis_name="seq", kv_lengths=jnp.array([3, 4]))


@pytest.mark.multidevice
def test_score_terms_on_the_ring():
    """Bias, ALiBi and a score_mod/mask_mod on the ring equal `plain_attention`'s: out,
    lse and the cotangents of q, k, v, the bias, the slopes and the score_mod's array
    (relative to the largest entry), on zigzag (`sharded_flash_attention`, causal, 4
    devices) and striped (`ring_flash_attention`, seq_q != seq_k, 2 devices) orders,
    whose global positions are permuted."""
    result = multidevice("ring_score_terms")
    for config, errors in result.items():
        for name, error in errors.items():
            assert error < TOL, (config, name, errors)


@pytest.mark.multidevice
def test_relative_score_mod_on_the_pallas_ring():
    """A trained T5 bias on the ring in the Pallas kernels (interpreted), striped and
    zigzag over 2 devices, causal: out, lse and the cotangents of q, k, v and the table
    equal `plain_attention`'s (each piece's bias vector at its global offsets; striped
    pieces' indices step by the ring's size)."""
    result = multidevice("ring_relative_pallas")
    assert set(result) == {"striped", "zigzag"}
    for layout, errors in result.items():
        for name, error in errors.items():
            assert error < 1e-4, (layout, name, errors)


def test_score_terms_one_device_check_vma(getkey):
    """`ring_flash_attention` in a one-device `shard_map(check_vma=True)` with a bias whose
    rows broadcast and per-head slopes, both replicated inputs (cast to vary with q;
    their cotangents come back through that cast), causal with seq_q != seq_k. A
    score_mod or mask_mod is refused there (check_vma=False takes them)."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
    q, k, v = qkv(getkey(), (2, 4, 16, 8), (2, 2, 24, 8))
    bias = jax.random.normal(getkey(), (4, 1, 24))
    slopes = jnp.array([0.5, 0.25, 0.125, 0.0625])
    table = 0.1 * jax.random.normal(getkey(), (4,))

    def mods(table):
        return {
            "score_mod": lambda s, b, h, i, j: s + table[h] * ((i + j) % 3).astype(s.dtype),
            "mask_mod": lambda b, h, i, j: (i - j) % 4 != 1,
        }

    seq = PartitionSpec(None, None, "seq")

    def ring(flex):
        return jax.shard_map(
            lambda q, k, v, bias, slopes, table: eqx_flash.ring_flash_attention(
                q, k, v, axis_name="seq", causal=True, bias=bias, alibi_slopes=slopes,
                block_q=16, block_k=16,  # the keys (and bias columns) padded
                **(mods(table) if flex else {})),
            mesh=mesh, in_specs=(seq, seq, seq, *[PartitionSpec()] * 3),
            out_specs=(seq, seq), check_vma=True,
        )

    def loss(fn):
        def f(*args):
            out, lse = fn(*args)
            return jnp.sum(out * out) + jnp.sum(lse * jnp.arange(16.0)[None, None, :])

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4)))(
            q, k, v, bias, slopes, table)

    expected = loss(lambda q, k, v, b, s, t: eqx_flash.plain_attention(
        q, k, v, causal=True, bias=b, alibi_slopes=s))
    got = loss(ring(flex=False))
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-4, rtol=1e-4)
    with pytest.raises(NotImplementedError, match="score_mod/mask_mod only inside.*check_vma"):
        loss(ring(flex=True))


def test_score_terms_on_the_ring_errors():
    """What the ring cannot run is refused by name, with what to use instead: a
    block_mask on the ring, score_mod/mask_mod/block_mask on `sharded_flash_attention`;
    a bias of the wrong shape names `bias`."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
    q, k, v = qkv(jax.random.key(0), (1, 2, 8, 4), (1, 2, 8, 4))

    def score_mod(score, b, h, q_idx, kv_idx):
        return score

    def mask_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    block_mask = eqx_flash.make_block_mask(mask_mod, (1,), 2, 8, 8, 8, 8)
    with pytest.raises(NotImplementedError, match="block_mask: pass the mask_mod alone"):
        eqx_flash.ring_flash_attention(q, k, v, axis_name="seq", mask_mod=mask_mod,
                                       block_mask=block_mask)
    sharded = functools.partial(eqx_flash.sharded_flash_attention, mesh=mesh, seq_axis="seq")
    for name, value in (("score_mod", score_mod), ("mask_mod", mask_mod),
                        ("block_mask", block_mask)):
        with pytest.raises(NotImplementedError,
                           match=f"support {name}: use strategy='ulysses'.*"
                                 "ring_flash_attention inside"):
            sharded(q, k, v, **{name: value})
    with pytest.raises((ValueError, TypeError), match="bias"):
        eqx_flash.sharded_flash_attention(q, k, v, mesh=mesh, seq_axis="seq",
                                          bias=jnp.zeros((3, 8, 8)))


@pytest.mark.multidevice
def test_ring_in_a_user_shard_map_with_check_vma():
    """Every array argument of ring_flash_attention inside the user's shard_map under
    check_vma=True (a key mask failed there, #25; segment ids or positions with chunks
    of one block, #41), causal and not, forward and backward; what the ring does not
    take is refused by name."""
    result = multidevice("ring_user_shard_map_vma")
    refused = {name: result.pop(name) for name in list(result) if name.startswith("refused")}
    differentiable = ("bias", "alibi_slopes", "sinks")
    for case in ("index", "positions"):
        for mode in ("full", "causal"):
            for name in ("out", "lse", "dq", "dk", "dv", *(f"d{a}" for a in differentiable)):
                assert result.pop(f"{case}_{mode}_{name}") < TOL, (case, mode, name)
    assert not result, result
    assert "does not support kv_lengths" in refused["refused_kv_lengths"], refused
    assert "score_mod/mask_mod only inside" in refused["refused_score_mod"], refused
    for name in ("attn_mask", "dropout"):
        assert refused[f"refused_{name}"].startswith("TypeError") and name in refused[
            f"refused_{name}"], refused


@pytest.mark.multidevice
def test_flash_attention_in_a_user_data_parallel_shard_map():
    """`flash_attention` on batch shards inside the user's shard_map (check_vma=True),
    every per-call array at once and a score_mod/mask_mod closing over its arrays, one
    block per sequence (#41), causal and windowed: values, gradients, jvp (and an HVP,
    causal) equal the unsharded call's."""
    result = multidevice("flash_in_user_shard_map")
    compared = [f"{name}_{part}" for name in ("causal", "window")
                for part in ("values", "grads", "jvp")] + ["causal_hvp"]
    assert sorted(result) == sorted(compared), result
    for name, err in result.items():
        assert err < TOL, (name, result)


@pytest.mark.multidevice
def test_traced_out_of_range_lengths_are_clamped_not_fatal():
    """No value check of ours can kill a multi-device program: lengths out of range (or,
    for causal `sharded_flash_attention`, with `kv_lengths - q_lengths != seq_k - seq_q`)
    inside `jax.jit` are clamped, on a 4-device mesh (`sharded_flash_attention`) and with
    the batch sharded over 4 devices (`flash_attention`); the process exits 0, quickly,
    with the results of the in-range-equivalent calls. (An `eqx.error_if` there, followed
    by collectives, hung and then aborted the process.)"""
    result = multidevice("traced_lengths")
    assert set(result) == {"sharded_mismatch", "sharded_past_seq",
                           "flash_batch_sharded_past_seq", "flash_batch_sharded_negative"}
    for name, record in result.items():
        assert record["finite"], (name, record)
        assert record["vs_equivalent"] == 0.0, (name, record)
        assert record.get("vs_flash_attention", 0.0) < TOL, (name, record)


def test_sharded_concrete_length_mismatch_raises():
    """Concrete lengths that the causal ring cannot align still raise eagerly, naming them."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
    q, k, v = qkv(0, (2, 2, 16, 8), (2, 2, 16, 8))
    with pytest.raises(ValueError, match=r"kv_lengths - q_lengths == seq_k - seq_q.*"
                                         r"q_lengths=\[16, 5\], kv_lengths=\[16, 7\]"):
        eqx_flash.sharded_flash_attention(q, k, v, mesh=mesh, seq_axis="seq", causal=True,
                                          q_lengths=jnp.array([16, 5]),
                                          kv_lengths=jnp.array([16, 7]))
    with pytest.raises(ValueError, match=r"kv_lengths must lie in \[0, 16\]"):
        eqx_flash.sharded_flash_attention(q, k, v, mesh=mesh, seq_axis="seq",
                                          kv_lengths=np.array([16, 17]))
    # under jit, on one device: the mismatch shrinks to the largest consistent lengths
    jitted = jax.jit(lambda ql, kl: eqx_flash.sharded_flash_attention(
        q, k, v, mesh=mesh, seq_axis="seq", causal=True, q_lengths=ql, kv_lengths=kl))
    out, _ = jitted(jnp.array([16, 5]), jnp.array([16, 7]))
    ref, _ = eqx_flash.flash_attention(q, k, v, causal=True, q_lengths=jnp.array([16, 5]),
                                       kv_lengths=jnp.array([16, 5]))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=TOL, rtol=TOL)


@pytest.mark.multidevice
def test_cache_overflow_on_many_devices_is_nan_not_fatal():
    """A linear cache run past `max_len` under `jax.jit` with the batch sharded over 4
    devices: the process lives (no runtime error to hang a collective), the overflowing
    elements' outputs are NaN and their lengths pass `max_len`, the others are exact."""
    result = multidevice("cache_overflow")
    assert result["lengths"] == [3, 4, 6, 5]
    assert result["nan_elements"] == [False, False, True, False]
    assert result["fitting_vs_roomy"] < TOL


@pytest.mark.multidevice
def test_max_scores_on_the_ring():
    """`return_max_scores=True` on 4 devices, every layout, lengths, and the ring in a
    shard_map: equal to single-device `flash_attention` (-inf rows in the same places)."""
    result = multidevice("max_scores")
    assert result.pop("rows_without_keys") > 0
    assert set(result) == {"sharded_contiguous", "sharded_zigzag", "sharded_striped",
                           "sharded_lengths", "ring_check_vma_False", "ring_check_vma_True"}
    for name, diff in result.items():
        assert diff < TOL, (name, result)
