#!/usr/bin/env bash
# One call on a TPU machine: install the wheels, then run the main job, the accelerator tests
# and the device benchmark, each under its own timeout, all within TOTAL_SECONDS.
#
#   bash benchmarks/tpu_run.sh                                   # main, tests, bench
#   STEPS="bench" BENCH_ARGS="--preset sweep" bash benchmarks/tpu_run.sh
#
# Run from anywhere (it works from the project root). Needs the wheels in .whl-tpu/ (the
# project's tpu-wheels tool builds them from the working tree; rerun it after changing
# eqx_flash/) and writes its logs to $OUT (default ./tpu-out), at most 8 files:
#   summary.txt  each step's command, exit status and seconds
#   main.txt     python -m eqx_flash
#   tests.txt    pytest -m accelerator, compiled, in one process
#   test_times.txt  each test's seconds as it finishes (tests/conftest.py), timeouts too
#   bench.txt, bench.json, bench.md   benchmarks/bench_device.py
#
# Environment:
#   STEPS          which steps, in order (default "main tests bench")
#   TOTAL_SECONDS  the whole run's limit (default 530: under 9 minutes); each step's timeout
#                  is its own cap or what is left, whichever is less
#   MAIN_SECONDS   cap of the main job (default 240: it took over 150 s on a v5e);
#                  MAIN_ARGS its options (default none)
#   TESTS_SECONDS  cap of the tests (default 480: ~8.5 min measured before the XLA
#                  family was trimmed, estimated ~7.5 after); TESTS_ARGS more pytest options
#   BENCH_ARGS     options of bench_device.py (default "--preset quick"); its --time-budget
#                  defaults to what is left less 75 s (pass one in BENCH_ARGS to override)
#   EQX_FLASH_COMMIT  the commit the bench results name (a copied tree may have no git)
#   PYTHON         the interpreter (default python3); SITE where the wheels go (/tmp/site)
# JAX_DEFAULT_MATMUL_PRECISION is unset for every step: the checks state their own
# precision, and the timings are at the precision programs get by default.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/tpu-out}"
PYTHON="${PYTHON:-python3}"
STEPS="${STEPS:-main tests bench}"
TOTAL_SECONDS="${TOTAL_SECONDS:-530}"
SITE="${SITE:-/tmp/site}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

shopt -s nullglob
wheels=(.whl-tpu/*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
    echo "no wheels in .whl-tpu/: build them first (the project's tpu-wheels tool)" | tee -a "$SUMMARY"
    exit 2
fi
PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip install --isolated -q --no-index --no-deps \
    --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" || exit 2
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$SITE" PYTHONUNBUFFERED=1
unset JAX_DEFAULT_MATMUL_PRECISION
echo "$(date -u +%FT%TZ) steps: $STEPS; wheels: ${wheels[*]##*/}" >> "$SUMMARY"

left() { echo $(( TOTAL_SECONDS - SECONDS )); }

step() {  # $1: name, $2: cap in seconds, $3: log file; the rest: the command
    local name="$1" cap="$2" log="$3" start=$SECONDS limit rc
    shift 3
    limit=$(left)
    [ "$cap" -lt "$limit" ] && limit=$cap
    if [ "$limit" -le 20 ]; then
        echo "$name: skipped, ${limit}s left of TOTAL_SECONDS=$TOTAL_SECONDS" >> "$SUMMARY"
        return
    fi
    echo "=== $name (timeout ${limit}s): $*"
    timeout "$limit" "$@" > "$log" 2>&1
    rc=$?
    echo "$name: exit $rc after $(( SECONDS - start ))s (timeout ${limit}s; 124 = timed out): $*" >> "$SUMMARY"
    tail -n 25 "$log"
}

for s in $STEPS; do
    case "$s" in
        main)
            # shellcheck disable=SC2086
            step main "${MAIN_SECONDS:-240}" "$OUT/main.txt" \
                "$PYTHON" -m eqx_flash ${MAIN_ARGS:-} ;;
        tests)
            # EQX_FLASH_TEST_OLD_EMITTERS=0, EQX_FLASH_TEST_SERIAL_CODEGEN=0: skip conftest's
            # probes of CPU-only XLA flags;
            # EQX_FLASH_TEST_FAST_COMPILE=1 (default here): XLA's optimisations off, as on CPU.
            # shellcheck disable=SC2086
            step tests "${TESTS_SECONDS:-480}" "$OUT/tests.txt" \
                env EQX_FLASH_TEST_OLD_EMITTERS=0 EQX_FLASH_TEST_SERIAL_CODEGEN=0 \
                EQX_FLASH_TEST_TIMES="$OUT/test_times.txt" \
                EQX_FLASH_TEST_FAST_COMPILE="${EQX_FLASH_TEST_FAST_COMPILE:-1}" \
                "$PYTHON" -m pytest -o addopts="" -p no:cacheprovider -q -rs -m accelerator \
                --jaxtyping-packages=eqx_flash,beartype.beartype --durations=15 \
                ${TESTS_ARGS:-} tests ;;
        bench)
            budget=$(( $(left) - 75 ))
            [ "$budget" -lt 0 ] && budget=0
            # shellcheck disable=SC2086
            step bench "$(left)" "$OUT/bench.txt" \
                "$PYTHON" benchmarks/bench_device.py --time-budget "$budget" \
                ${BENCH_ARGS:---preset quick} --json "$OUT/bench.json" \
                --markdown "$OUT/bench.md" ;;
        *)
            echo "unknown step $s (main, tests, bench)" | tee -a "$SUMMARY" ;;
    esac
done
cat "$SUMMARY"
