"""`benchmarks/bench_device.py` runs on CPU too (tiny sizes): every eqx_flash and jax.nn
cell measured, none refused, one table printed."""

import importlib.util
import pathlib

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_device.py"


def test_bench_device_runs_tiny_on_cpu(capsys):
    spec = importlib.util.spec_from_file_location("bench_device", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    records = bench.main(["--seqs", "32", "--dtypes", "float32", "bfloat16", "--rounds", "1",
                          "--heads", "2", "--dim", "8"])
    printed = capsys.readouterr().out
    assert "| implementation | dtype | seq |" in printed
    names = {r["implementation"] for r in records}
    assert {"eqx_flash", "jax.nn xla"} <= names
    assert len(records) == len(names) * 2 * 2 * len(bench.MODES)  # dtypes x causal x modes
    for r in records:
        if r["implementation"] == "eqx_flash" or r["dtype"] == "float32":
            assert "error" not in r, r
        if "error" not in r:
            assert r["ms"] > 0 and r["tflops"] > 0, r
