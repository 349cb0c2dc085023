"""The benchmark scripts' outputs (#42.7): the peers' plot is drawn from JSON records (the
committed ones read from `peers_results.md`), `run.py --quick` writes where the tracked
results are not, and every command-line option of the examples and benchmarks says what
it does."""

import ast
import importlib.util
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def _load(path: pathlib.Path):
    if str(BENCHMARKS) not in sys.path:  # the scripts import their sibling modules
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_records_are_the_markdown_tables():
    """`peers_results.json` is what `--from-markdown` reads from `peers_results.md`: the
    plot in the performance guide shows the recorded numbers, not others."""
    records = _load(BENCHMARKS / "_peers_records.py")
    parsed = records.records_from_markdown((BENCHMARKS / "peers_results.md").read_text())
    assert parsed == json.loads((BENCHMARKS / "peers_results.json").read_text())
    newest = parsed["runs"][0]
    assert newest["environment"].startswith("Python 3.11.7, jax 0.10.2")
    eqx_flash = newest["rows"][0]
    assert eqx_flash == {"impl": "eqx_flash", "temp_mib": 79.0,
                         "ms": {"fwd": 56.0, "fwd causal": 38.0, "fwd+bwd": 185.0,
                                "fwd+bwd causal": 123.0}}
    assert {row["impl"] for row in newest["rows"]} >= {"jax.nn xla", "tokamax xla",
                                                       "attnax flash_attention"}


def test_replot_draws_from_saved_records(tmp_path: pathlib.Path):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the `bench` extra)")
    bench_peers = _load(BENCHMARKS / "bench_peers.py")
    records = {"runs": [{"section": "s", "title": "", "environment": "Python 3; x",
                         "problem": "seq 8; y", "memory_seq": 16,
                         "rows": [{"impl": "eqx_flash", "temp_mib": 1.0,
                                   "ms": {"fwd": 1.0, "fwd causal": 1.0, "fwd+bwd": 2.0,
                                          "fwd+bwd causal": 2.0}},
                                  {"impl": "peer", "temp_mib": 9.0,
                                   "ms": {"fwd": 3.0, "fwd causal": 3.0, "fwd+bwd": 5.0,
                                          "fwd+bwd causal": 5.0}}]}]}
    saved = tmp_path / "records.json"
    saved.write_text(json.dumps(records))
    bench_peers.main(["--replot", str(saved), "--plot", str(tmp_path / "peers.png")])
    assert (tmp_path / "peers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quick_run_leaves_the_tracked_results_alone():
    run = _load(BENCHMARKS / "run.py")
    quick, full = run.parse_args(["--quick"]), run.parse_args([])
    assert full.out == BENCHMARKS / "results.json" and full.plots == ROOT / "docs"
    assert quick.out.parent == quick.plots == BENCHMARKS / "results" / "quick"
    assert "benchmarks/results/" in (ROOT / ".gitignore").read_text().splitlines()
    chosen = run.parse_args(["--quick", "--out", "x.json", "--plots", "p"])
    assert (chosen.out, chosen.plots) == (pathlib.Path("x.json"), pathlib.Path("p"))


SCRIPTS = [*sorted((ROOT / "examples").glob("*.py")), BENCHMARKS / "run.py",
           BENCHMARKS / "bench_peers.py", BENCHMARKS / "_interleave.py"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_option_has_help(script: pathlib.Path):
    options = [node for node in ast.walk(ast.parse(script.read_text()))
               if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
               and node.func.attr == "add_argument"]
    assert options, script
    silent = [ast.unparse(node.args[0]) for node in options
              if not any(k.arg == "help" for k in node.keywords)]
    assert not silent, f"{script.name}: no help for {silent}"
