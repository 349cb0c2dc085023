"""`python -m eqx_flash`: the seed's sanity check over several configurations.

Compares `flash_attention` with `plain_attention` (outputs and gradients) at a stated matmul
precision (`--precision`, default "highest": float32 accuracy on every backend, where at
JAX's default a float32 matmul on TPU is a bfloat16 pass and two correct attentions differ
by ~1e-2 in gradients), then times the jitted forward+backward of each at the precision a
program runs at by default and reads each one's compiled temporary memory from XLA. Exits
with status 1 if any difference exceeds its tolerance.
"""

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ._api.flash import flash_attention
from ._api.reference import plain_attention
from ._api.sanity import value_and_grad_difference
from .testing._tolerances import PRECISION, at_precision, backend_factor

# Float32 bounds at `PRECISION`, widened on backends whose round-off differs from CPU's by
# the one per-backend factor of the test tolerances (`testing._tolerances.BACKEND_FACTORS`).
OUT_TOLERANCE = 1e-4
GRAD_TOLERANCE = 1e-3
# A row whose repeated runs spread by more than this (max - min over the median) is noisy.
NOISY_SPREAD = 0.2

# name, value_and_grad_difference shapes, attention keywords
CONFIGS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("key mask", dict(q_seq_len=512, k_seq_len=768), {}),
    ("causal", dict(q_seq_len=512, k_seq_len=512, add_key_mask=False), dict(causal=True)),
    ("causal + key mask, q < k", dict(q_seq_len=256, k_seq_len=768), dict(causal=True)),
    ("GQA 8 q heads / 2 kv heads", dict(heads=8, kv_heads=2, q_seq_len=512, k_seq_len=512), {}),
    ("odd lengths 1000 x 1500", dict(batch=1, q_seq_len=1000, k_seq_len=1500), {}),
    ("window (128, 0) + softcap 20", dict(q_seq_len=512, k_seq_len=512, add_key_mask=False),
     dict(window=(128, 0), softcap=20.0)),
]


def _loss(fn: Callable[..., Any], keywords: dict[str, Any]) -> Any:  # a jitted function
    def loss(q, k, v, mask):
        return jnp.sum(fn(q, k, v, mask, **keywords)[0])

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _compile(fn: Callable[..., Any], keywords: dict[str, Any], shapes: dict[str, Any]
             ) -> tuple[Callable[[], Any], int]:
    """The compiled forward+backward on fresh inputs of `shapes`, as a thunk, and its
    compiled temporary bytes (-1 if XLA does not say)."""
    batch, heads = shapes.get("batch", 2), shapes.get("heads", 4)
    kv_heads = shapes.get("kv_heads", heads)
    sq, sk, dim = shapes["q_seq_len"], shapes["k_seq_len"], shapes.get("dim", 64)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (batch, heads, sq, dim))
    k = jax.random.normal(keys[1], (batch, kv_heads, sk, dim))
    v = jax.random.normal(keys[2], (batch, kv_heads, sk, dim))
    mask = jnp.ones((batch, sk), bool)
    compiled = _loss(fn, keywords).lower(q, k, v, mask).compile()
    memory = compiled.memory_analysis()
    temp = int(memory.temp_size_in_bytes) if memory is not None else -1
    return (lambda: compiled(q, k, v, mask)), temp


def _time(call: Callable[[], Any], repeats: int) -> list[float]:
    """Seconds of `repeats` runs of `call`, after one untimed run."""
    jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return times


def _spread(times: list[float]) -> float:
    return (max(times) - min(times)) / statistics.median(times) if len(times) > 1 else 0.0


def _repeats(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"must be 0 (compare only, time nothing) or more, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eqx_flash", description=__doc__)
    parser.add_argument("--repeats", type=_repeats, default=3,
                        help="timed runs per method (default 3); 0 compares only, with no "
                             "timing or memory columns")
    parser.add_argument("--precision", default=PRECISION,
                        help=f"the matmul precision both sides are compared at (default "
                             f"{PRECISION!r}; the tolerances are calibrated for it); "
                             f"'default' compares at JAX's default")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        with at_precision(args.precision):
            pass
    except ValueError as error:
        parser.error(f"argument --precision: {error}")
    device = jax.devices()[0]
    factor = backend_factor()
    out_tol, grad_tol = OUT_TOLERANCE * factor, GRAD_TOLERANCE * factor
    timing_precision = getattr(jax.config, "jax_default_matmul_precision", None) or "default"
    print(f"eqx_flash sanity check: flash_attention vs plain_attention, float32\n"
          f"backend {device.platform}, device {device.device_kind} "
          f"({jax.device_count()} device{'s' if jax.device_count() > 1 else ''}); "
          f"compared at matmul precision {args.precision!r}, tolerances out {out_tol:g}, "
          f"grads {grad_tol:g}" + (f" (x{factor:g} on {device.platform})"
                                   if factor != 1.0 else ""), flush=True)
    if args.precision != PRECISION:
        print(f"note: the tolerances are calibrated for precision {PRECISION!r}; at "
              f"{args.precision!r} a correct attention may exceed them", flush=True)
    rows = []
    failed = False
    for i, (name, shapes, keywords) in enumerate(CONFIGS, 1):
        step = f"[{i}/{len(CONFIGS)}] {name}:"
        print(f"{step} compiling and comparing outputs and gradients ...", flush=True)
        # One jitted program for both sides: run eagerly, each of plain_attention's
        # operations compiles on its own, which on a TPU took most of this job's time.
        compare = jax.jit(functools.partial(value_and_grad_difference, plain_attention,
                                            flash_attention, **shapes, **keywords))
        with at_precision(args.precision):
            out_diff, grad_diffs = compare()
            diffs = [float(out_diff), *(float(d) for d in grad_diffs)]
        ok = diffs[0] <= out_tol and max(diffs[1:]) <= grad_tol
        failed |= not ok
        profiled: list[Any] = []
        for label, fn in (("flash", flash_attention), ("plain", plain_attention)):
            if args.repeats == 0:
                break
            print(f"{step} compiling {label} forward+backward, then {args.repeats} timed "
                  f"run{'s' if args.repeats > 1 else ''} ...", flush=True)
            call, temp = _compile(fn, keywords, shapes)
            profiled.append((_time(call, args.repeats), temp))
        rows.append((name, diffs, profiled, ok))

    header = (f"{'configuration':<30} {'out':>8} {'dq':>8} {'dk':>8} {'dv':>8} "
              f"{'flash ms':>9} {'plain ms':>9} {'flash MiB':>10} {'plain MiB':>10}  ok")
    print()
    print(header)
    print("-" * len(header))
    noisy = False
    for name, diffs, profiled, ok in rows:
        line = f"{name:<30} " + " ".join(f"{d:8.1e}" for d in diffs)
        if profiled:
            (t_flash, m_flash), (t_plain, m_plain) = profiled
            mark = max(_spread(t_flash), _spread(t_plain)) > NOISY_SPREAD
            noisy |= mark
            line += (f" {statistics.median(t_flash) * 1e3:9.1f} "
                     f"{statistics.median(t_plain) * 1e3:9.1f}{'~' if mark else ' '}"
                     f"{m_flash / 2**20:10.1f} {m_plain / 2**20:10.1f}")
        else:
            line += f" {'-':>9} {'-':>9} {'-':>10} {'-':>10}"
        print(f"{line}  {'yes' if ok else 'NO'}")
    print()
    if args.repeats:
        print(f"times: median of {args.repeats} jitted forward+backward runs at matmul "
              f"precision {timing_precision!r};\nmemory: XLA's compiled temporary buffers.")
        longest = max(max(shapes["q_seq_len"], shapes["k_seq_len"]) for _, shapes, _ in CONFIGS)
        print(f"These problems are small (at most {longest} tokens): their times are short, "
              f"partly fixed costs, and noisy on a\nshared machine, so flash may time slower "
              f"than plain here; its advantage grows with the sequence length\n(see "
              f"benchmarks/ and docs/guides/performance.md).")
        if noisy:
            print(f"~ : the runs of this row spread by more than {NOISY_SPREAD:.0%} of "
                  f"their median.")
    else:
        print("--repeats 0: compared only; nothing was timed or measured.")
    if failed:
        print("FAILED: a difference exceeds its tolerance", file=sys.stderr)
        return 1
    print("all differences within tolerance")
    return 0


if __name__ == "__main__":
    sys.exit(main())
