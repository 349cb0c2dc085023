import itertools
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, settings

# Compile time dominates this suite on CPU. Turning most XLA optimisations off roughly halves
# it, and XLA's older CPU emitters compile about 1.5x faster again (each eager op of a new
# shape is a compilation too). Set in the environment before jax is imported, so the
# multi-device subprocess inherits them; the memory tests turn the optimisations back on,
# since they measure the compiled program.
# Newer XLA (jax 0.12) dropped that flag and aborts on unknown flags, so it is probed once, in
# a subprocess; xdist workers and the multi-device subprocess inherit the verdict.
# XLA also splits each program's code generation over threads by default: with two test
# workers on two cores that only adds contention (one thread: 12% less time on four test
# files, 184 s -> 161 s), so it is asked for one thread, probed the same way.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
OLD_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
SERIAL_CODEGEN = "--xla_cpu_parallel_codegen_split_count=1"


def _xla_accepts(flag: str) -> bool:
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    probe = "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()"
    run = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True)
    return run.returncode == 0


for variable, flag in (("EQX_FLASH_TEST_OLD_EMITTERS", OLD_EMITTERS),
                       ("EQX_FLASH_TEST_SERIAL_CODEGEN", SERIAL_CODEGEN)):
    if variable not in os.environ:
        os.environ[variable] = str(int(_xla_accepts(flag)))
    if os.environ[variable] == "1" and flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), flag]).strip()

import jax  # noqa: E402

# Catch silent broadcasting and dtype promotion bugs (as equinox's own tests do).
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")
# Compare at the matmul precision the tolerance table is calibrated for
# (`eqx_flash.testing.PRECISION`, not imported here: the jaxtyping hook must install
# first), so that every test means the same on every backend: at JAX's default a float32
# matmul on TPU is a bfloat16 pass. On CPU both precisions compile to the same program.
# An explicit JAX_DEFAULT_MATMUL_PRECISION wins (to try the suite at another precision).
if "JAX_DEFAULT_MATMUL_PRECISION" not in os.environ:
    jax.config.update("jax_default_matmul_precision", "highest")
# The optimisations are off only to compile faster on CPU; on an accelerator (`pytest -m
# accelerator` on a TPU) the tests run the programs users get. (The old-emitters probe above
# runs with JAX_PLATFORMS=cpu, so it never opens an accelerator; its flag is CPU-only.)
# EQX_FLASH_TEST_FAST_COMPILE=1 keeps them off there too, where compiling is what a short
# accelerator session cannot afford (Mosaic kernels compile the same either way).
if jax.default_backend() != "cpu" and os.environ.get("EQX_FLASH_TEST_FAST_COMPILE") != "1":
    jax.config.update("jax_disable_most_optimizations", False)


# `ci`: a fixed, small sample per property (the README's test command; counts written for
# 15 scale with it, `helpers.examples`); `dev`: the long search. Six, not eight, to keep
# the test command near its 12 minutes on two cores (the properties are a fifth of it).
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    database=None,
    max_examples=6,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def getkey():
    """A fresh PRNG key per call: `getkey()`."""
    # fold_in compiles once per process; iterating a split of 10k keys compiled an unstack
    # with 10k outputs.
    counter = itertools.count()
    base = jax.random.key(0)
    return lambda: jax.random.fold_in(base, next(counter))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module. An XLA:CPU executable keeps
    its code mapped until JAX lets it go, and a worker that runs half the suite passes the
    kernel's limit of 65530 memory maps per process (`vm.max_map_count`): an mmap then
    fails inside the next compilation and the worker aborts (SIGABRT, no message)."""
    yield
    jax.clear_caches()


# EQX_FLASH_TEST_TIMES=<file>: each test's outcome and seconds (setup and call) appended as
# it finishes, so a run cut off by a timeout (an accelerator session's) still says which
# tests took the time.
_TIMES = os.environ.get("EQX_FLASH_TEST_TIMES")
_elapsed: dict[str, float] = {}


def pytest_runtest_logreport(report):
    if not _TIMES or report.when == "teardown":
        return
    _elapsed[report.nodeid] = _elapsed.get(report.nodeid, 0.0) + report.duration
    if report.when == "call" or report.outcome != "passed":
        with open(_TIMES, "a") as out:
            out.write(f"{_elapsed.pop(report.nodeid):7.1f} s  {report.outcome:7}  "
                      f"{report.nodeid}\n")
