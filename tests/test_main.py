"""`python -m eqx_flash` (`eqx_flash.__main__`): what it compares at, what it says while it
works, and its options' errors. On one tiny configuration, so each run is a few programs."""

import jax
import pytest

from eqx_flash import __main__ as main_job

TINY = [("tiny causal", dict(batch=1, heads=2, q_seq_len=48, k_seq_len=64, dim=16),
         dict(causal=True))]


@pytest.fixture(autouse=True)
def tiny_configs(monkeypatch):
    monkeypatch.setattr(main_job, "CONFIGS", TINY)


def test_compare_only_states_backend_device_and_precision(capsys):
    assert main_job.main(["--repeats", "0"]) == 0
    out = capsys.readouterr().out
    device = jax.devices()[0]
    assert f"backend {device.platform}, device {device.device_kind}" in out
    assert "compared at matmul precision 'highest'" in out
    assert "[1/1] tiny causal: compiling and comparing" in out
    assert "compared only; nothing was timed" in out
    assert "timed run" not in out and "all differences within tolerance" in out


def test_timed_run_says_when_it_compiles_and_that_small_timings_are_noisy(capsys):
    assert main_job.main(["--repeats", "2"]) == 0
    out = capsys.readouterr().out
    for label in ("flash", "plain"):
        assert f"[1/1] tiny causal: compiling {label} forward+backward, then 2 timed runs" in out
    assert "These problems are small (at most 64 tokens)" in out and "noisy" in out
    row = next(line for line in out.splitlines() if line.startswith("tiny causal"))
    assert row.endswith("yes") and "-" not in row.split()[5:9]


def test_the_comparison_runs_at_the_stated_precision(monkeypatch, capsys):
    seen = []
    compare = main_job.value_and_grad_difference

    def recording(*args, **kwargs):
        seen.append(jax.config.jax_default_matmul_precision)
        return compare(*args, **kwargs)

    monkeypatch.setattr(main_job, "value_and_grad_difference", recording)
    assert main_job.main(["--repeats", "0"]) == 0
    assert main_job.main(["--repeats", "0", "--precision", "default"]) == 0
    assert seen == ["highest", "default"]
    assert "calibrated for precision 'highest'" in capsys.readouterr().out


def test_a_difference_over_tolerance_fails(monkeypatch, capsys):
    monkeypatch.setattr(main_job, "OUT_TOLERANCE", -1.0)
    assert main_job.main(["--repeats", "0"]) == 1
    captured = capsys.readouterr()
    row = next(line for line in captured.out.splitlines() if line.startswith("tiny causal"))
    assert "FAILED" in captured.err and row.endswith("NO")


@pytest.mark.parametrize(("argv", "message"), [
    (["--repeats", "-1"], "argument --repeats: must be 0 (compare only, time nothing) or more"),
    (["--repeats", "two"], "argument --repeats: expected a whole number, got 'two'"),
    (["--precision", "fast"], "argument --precision: precision must be None or a JAX matmul"),
])
def test_bad_options_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main_job.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
