"""`benchmarks/bench_device.py` runs on CPU (tiny sizes, the TPU peers skipped with a line
saying so), writes its JSON and tables, replots from the JSON, sweeps block pairs, stops at
its time budget; and the TPU peers' wiring is right (run in Pallas' interpret mode)."""

import importlib.util
import json
import pathlib
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_flash

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_device.py"
TINY = ["--configs", "gqa2-1d16", "--tokens", "128", "--seqs", "64", "--rounds", "1",
        "--matmul", "64", "--causal", "yes"]


@pytest.fixture(autouse=True, scope="module")
def _users_settings():
    """The script runs as users run it: JAX's default promotion rules (jax.nn's attention
    mixes bfloat16 and float32 under the suite's strict ones)."""
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        yield


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_device", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_run(bench, tmp_path_factory):
    """One tiny run (grouped-query, causal, every mode), with its files and output."""
    out = tmp_path_factory.mktemp("bench")
    files = {"json": out / "run.json", "markdown": out / "run.md"}
    records = bench.main([*TINY, "--json", str(files["json"]), "--markdown",
                          str(files["markdown"])])
    return records, files


def test_runs_tiny_on_cpu(bench, tiny_run):
    records, files = tiny_run
    names = {r["impl"] for r in records}
    assert {"eqx_flash", "jax.nn xla"} <= names and not {"pallas flash", "splash"} & names
    assert len(records) == len(names) * len(bench.MODES)  # one causal setting
    for r in records:
        assert "error" not in r, r
        assert r["ms"] > 0 and r["tflops"] > 0 and r["of_matmul"] > 0, r
        assert r["batch"] == 2 and r["heads"] == 2 and r["kv_heads"] == 1
        assert r["temp_mib"] is not None
    saved = json.loads(files["json"].read_text())
    assert saved["records"] == records and saved["meta"]["backend"] == jax.default_backend()
    assert any("TPU kernels, and the backend is cpu" in n for n in saved["meta"]["notes"])
    table = files["markdown"].read_text()
    assert "### gqa2-1d16: TFLOP/s" in table and "| 64 (2) | yes | fwd+bwd |" in table
    assert "4·B·H·S²·D" in table


def test_replot_from_json(bench, tiny_run, tmp_path, capsys):
    _, files = tiny_run
    png = tmp_path / "plot.png"
    bench.main(["--replot", str(files["json"]), "--plot", str(png)])
    printed = capsys.readouterr().out
    assert "### gqa2-1d16: TFLOP/s" in printed
    if importlib.util.find_spec("matplotlib") is None:
        assert "no plot: matplotlib is not installed" in printed
    else:
        assert f"plot written to {png}" in printed and png.stat().st_size > 0


def test_sweep_of_block_pairs(bench, capsys):
    records = bench.main(["--sweep-xla-blocks", "--configs", "h2d16", "--tokens", "128",
                          "--seqs", "64", "--sweep-blocks", "32", "64", "--modes", "fwd",
                          "--causal", "no", "--rounds", "1", "--matmul", "64"])
    pairs = [(r["block_q"], r["block_k"]) for r in records]
    assert pairs == [(None, None), (32, 32), (32, 64), (64, 64)]
    for r in records:
        assert "error" not in r and r["tflops"] > 0, r
        if r["block_q"] is not None:  # batch 2 x heads 2 x block area x float32
            assert r["step_logits_mib"] == 2 * 2 * r["block_q"] * r["block_k"] * 4 / 2**20
    assert "| default" in capsys.readouterr().out


def test_time_budget_stops_compiling_and_says_what_it_skipped(bench, capsys):
    records = bench.main([*TINY, "--time-budget", "0"])
    assert records and all(r["error"] == "skipped (time budget)" for r in records)
    assert f"{len(records)} cells not measured" in capsys.readouterr().out


def test_flop_convention_and_configs(bench):
    assert bench.flops("fwd", False, 16, 16, 1024, 128) == 4 * 16 * 16 * 1024**2 * 128
    assert bench.flops("fwd+bwd", True, 1, 16, 1024, 128) == 4 * 16 * 1024**2 * 128 * 3.5 / 2
    assert bench.flops("jvp", False, 1, 1, 8, 8) == 4 * 64 * 8 * 2.5
    assert bench.parse_config("gqa32-8") == bench.Config("gqa32-8", 32, 8, 128)
    assert bench.parse_config("h16d64") == bench.Config("h16d64", 16, 16, 64)
    for bad in ("h16", "gqa32-5"):
        with pytest.raises(Exception, match=bad):
            bench.parse_config(bad)


def test_one_row_per_kernel_family_once_flash_attention_takes_kernels(bench, monkeypatch):
    assert "kernels" in str(bench.kernel_families.__doc__)
    seen, flash = [], eqx_flash.flash_attention

    def with_families(q, k, v, *, causal=False,
                      kernels: typing.Literal["xla", "pallas_tpu"] | None = None):
        seen.append(kernels)
        return flash(q, k, v, causal=causal)

    monkeypatch.setattr(bench.eqx_flash, "flash_attention", with_families)
    families = bench.kernel_families()
    assert families == ["xla", "pallas_tpu"]
    impls, _ = bench.implementations([512], families)
    labels = [i.label for i in impls]
    assert labels[:3] == ["eqx_flash", "eqx_flash[xla]", "eqx_flash[pallas_tpu]"]
    config = bench.parse_config("h2d16")
    q = k = v = jnp.ones((1, 2, 16, 16))
    for impl in impls[:3]:
        impl.make(config, 16, True, None)(q, k, v)
    assert seen == [None, "xla", "pallas_tpu"]


def test_a_feature_row_is_the_family_with_that_option(bench):
    """`--features alibi`: one more row per family, the same call with ALiBi's slopes."""
    impls, _ = bench.implementations([512], ["xla"], ["alibi"])
    row = next(i for i in impls if i.label == "eqx_flash[xla]+alibi")
    config = bench.parse_config("h2d16")
    q, k, v = (jax.random.normal(jax.random.key(n), (1, 2, 32, 16)) for n in range(3))
    slopes = 2.0 ** (-8.0 * jnp.arange(1, 3) / 2)
    got = row.make(config, 32, True, None)(q, k, v)
    want = eqx_flash.plain_attention(q, k, v, causal=True, alibi_slopes=slopes)[0]
    assert jnp.allclose(got, want, atol=1e-5)
    assert not jnp.allclose(got, eqx_flash.plain_attention(q, k, v, causal=True)[0], atol=1e-3)


def test_a_trained_feature_gets_its_gradient_in_fwd_bwd(bench):
    """`--features bias`: the bias is an input of the timed program (not a constant in
    it), and fwd+bwd returns its gradient with those of q, k and v."""
    impls, _ = bench.implementations([512], ["xla"], ["bias"])
    row = next(i for i in impls if i.label == "eqx_flash[xla]+bias")
    config = bench.parse_config("h2d16")
    q, k, v = (jax.random.normal(jax.random.key(n), (1, 2, 32, 16)) for n in range(3))
    cell = row.make(config, 32, False, None)
    assert isinstance(cell, bench.WithArrays)
    (bias,) = cell.arrays
    assert bias.shape == (2, 32, 32)
    want = eqx_flash.plain_attention(q, k, v, bias=bias)[0]
    assert jnp.allclose(bench.program(cell, "fwd")(q, k, v, bias), want, atol=2e-2)

    grads = bench.program(cell, "fwd+bwd")(q, k, v, bias)
    want_grads = jax.grad(
        lambda *a: jnp.sum(eqx_flash.plain_attention(*a[:3], bias=a[3])[0]),
        argnums=(0, 1, 2, 3))(q, k, v, bias)
    assert len(grads) == 4
    for got, expected in zip(grads, want_grads, strict=True):
        assert got.shape == expected.shape
        assert jnp.allclose(got.astype(jnp.float32), expected.astype(jnp.float32), atol=3e-2)
    # jvp: tangents along q, k, v (the bias's is zero).
    _, tangent = bench.program(cell, "jvp")(q, k, v, bias)
    _, want_tangent = jax.jvp(lambda q, k, v: eqx_flash.plain_attention(q, k, v, bias=bias)[0],
                              (q, k, v), (q, k, v))
    assert jnp.allclose(tangent, want_tangent, atol=2e-2)


def test_the_t5_feature_trains_its_table(bench):
    """`--features t5`: a `RelativePositionBias` given as the score_mod is an input of the
    timed program; fwd+bwd returns its table's gradient with those of q, k and v, and
    the jvp runs with a zero tangent for it."""
    impls, _ = bench.implementations([512], ["xla"], ["t5"])
    row = next(i for i in impls if i.label == "eqx_flash[xla]+t5")
    config = bench.parse_config("h2d16")
    q, k, v = (jax.random.normal(jax.random.key(n), (1, 2, 32, 16)) for n in range(3))
    cell = row.make(config, 32, True, None)
    (module,) = cell.arrays
    assert isinstance(module, eqx_flash.RelativePositionBias)
    want = eqx_flash.plain_attention(q, k, v, causal=True, score_mod=module)[0]
    assert jnp.allclose(bench.program(cell, "fwd")(q, k, v, module), want, atol=1e-5)
    *_, d_module = bench.program(cell, "fwd+bwd")(q, k, v, module)
    want_table = jax.grad(lambda m: jnp.sum(eqx_flash.plain_attention(
        q, k, v, causal=True, score_mod=m)[0]))(module).table
    assert jnp.allclose(d_module.table, want_table, atol=1e-4)
    _, tangent = bench.program(cell, "jvp")(q, k, v, module)
    assert tangent.shape == q.shape


def test_the_doc_ids_feature_is_doc_mod_by_array(bench):
    """`--features doc_ids`: the same documents as `doc_mod`, read from an array of ids."""
    impls, _ = bench.implementations([512], ["xla"], ["doc_ids", "doc_mod"])
    rows = {i.label: i for i in impls}
    config = bench.parse_config("h2d16")
    q, k, v = (jax.random.normal(jax.random.key(n), (1, 2, 2048, 16)) for n in range(3))
    by_id = rows["eqx_flash[xla]+doc_ids"].make(config, 2048, False, None)(q, k, v)
    by_formula = rows["eqx_flash[xla]+doc_mod"].make(config, 2048, False, None)(q, k, v)
    assert jnp.allclose(by_id, by_formula, atol=1e-6)
    assert not jnp.allclose(by_id, eqx_flash.flash_attention(q, k, v)[0], atol=1e-3)


def test_tpu_peers_wiring_in_interpret_mode(bench):
    """Pallas flash (k, v repeated for GQA) and splash (q pre-scaled, vmapped over the
    batch) compute plain attention: run by Pallas' TPU interpreter on CPU."""
    pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
    if not hasattr(pltpu, "force_tpu_interpret_mode"):
        pytest.skip("this jax has no force_tpu_interpret_mode")
    config = bench.parse_config("gqa2-1d128")
    # Batch 1: the interpreter cannot batch splash's grid (a real TPU can).
    q, k, v = bench._inputs(config, 1, 128, jnp.float32, "bhsd")
    expected = eqx_flash.plain_attention(q, k, v, causal=True)[0]
    for make in (bench._pallas_flash, bench._splash):
        with pltpu.force_tpu_interpret_mode():
            out = make(config, 128, True, 128)(q, k, v)
        np.testing.assert_allclose(out, expected, atol=1e-5, err_msg=make.__name__)
