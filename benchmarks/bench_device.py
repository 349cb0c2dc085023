"""One benchmark for whatever accelerator JAX finds: eqx_flash against jax.nn.

    python benchmarks/bench_device.py [--seqs 1024 2048 ... 32768] [--rounds 5]
        [--dtypes bfloat16 float32] [--batch 1 --heads 8 --dim 128] [--json out.json]

On the default backend (GPU, TPU or CPU), times the forward, fwd+bwd (gradients of q, k,
v) and the jvp, causal and not, for `eqx_flash.dot_product_attention` (eqx_flash's kernels
in jax.nn's layout), `jax.nn.dot_product_attention(implementation="xla")` and, on GPU,
`implementation="cudnn"`. Prints one table: median milliseconds, TFLOP/s (the attention's
matmul flops: 4·B·H·T·S·D forward, 2.5x that backward, half of each causal; the jvp as a
forward and a half), and the compiled program's temporary memory (XLA's
`memory_analysis()`). A cell that fails (out of memory, an implementation the backend lacks)
prints its error's first words and the run goes on: nothing is refused.

Each round times every configuration once, in a shuffled order (shared machines are noisy:
compare within one run).
"""

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _interleave import interleaved_medians  # noqa: E402

import eqx_flash  # noqa: E402

MODES = ("fwd", "fwd+bwd", "jvp")


def implementations() -> dict[str, Callable[..., Any]]:
    found: dict[str, Callable[..., Any]] = {"eqx_flash": eqx_flash.dot_product_attention}
    for name in ("xla", "cudnn"):
        if name == "cudnn" and jax.default_backend() != "gpu":
            continue
        found[f"jax.nn {name}"] = functools.partial(jax.nn.dot_product_attention,
                                                    implementation=name)
    return found


def program(fn: Callable[..., Any], mode: str, causal: bool) -> Callable[..., Any]:
    def attend(q, k, v):
        return fn(q, k, v, is_causal=causal)

    if mode == "fwd":
        return jax.jit(attend)
    if mode == "fwd+bwd":
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32)),
                                argnums=(0, 1, 2)))
    return jax.jit(lambda q, k, v: jax.jvp(attend, (q, k, v), (q, k, v)))


def flops(mode: str, causal: bool, batch: int, heads: int, seq: int, dim: int) -> float:
    forward = 4.0 * batch * heads * seq * seq * dim * (0.5 if causal else 1.0)
    return forward * {"fwd": 1.0, "fwd+bwd": 3.5, "jvp": 2.5}[mode]


def run(seqs, dtypes, rounds, batch, heads, dim, modes=MODES) -> list[dict[str, Any]]:
    """Measure every cell; returns one record per (implementation, dtype, seq, causal,
    mode) with `ms`, `tflops` and `temp_mib`, or `error`."""
    records: list[dict[str, Any]] = []
    calls: dict[str, Callable[[], Any]] = {}  # by index into `records`
    for dtype in dtypes:
        for seq in seqs:
            keys = jax.random.split(jax.random.key(seq), 3)
            shape = (batch, seq, heads, dim)
            args = tuple(jax.random.normal(kk, shape, dtype) for kk in keys)
            for name, fn in implementations().items():
                for causal in (False, True):
                    for mode in modes:
                        cell = dict(implementation=name, dtype=jnp.dtype(dtype).name,
                                    seq=seq, causal=causal, mode=mode)
                        try:
                            compiled = program(fn, mode, causal).lower(*args).compile()
                            analysis = compiled.memory_analysis()
                            cell["temp_mib"] = (None if analysis is None else
                                                analysis.temp_size_in_bytes / 2**20)
                            jax.block_until_ready(compiled(*args))  # the warm-up, too
                            calls[str(len(records))] = functools.partial(compiled, *args)
                        except Exception as error:  # noqa: BLE001 - report, never refuse
                            cell["error"] = f"{type(error).__name__}: {str(error)[:60]}"
                        records.append(cell)
    medians = interleaved_medians(calls, rounds, jax.block_until_ready, warm_up=False)
    for index, seconds in medians.items():
        cell = records[int(index)]
        cell["ms"] = seconds * 1e3
        cell["tflops"] = flops(cell["mode"], cell["causal"], batch, heads, cell["seq"],
                               dim) / seconds / 1e12
    return records


def table(records: list[dict[str, Any]]) -> str:
    lines = ["| implementation | dtype | seq | causal | mode | median ms | TFLOP/s | temp MiB |",
             "|---|---|---:|---|---|---:|---:|---:|"]
    for r in records:
        if "error" in r:
            tail = f"| {r['error']} | | |"
        else:
            temp = "" if r.get("temp_mib") is None else f"{r['temp_mib']:.0f}"
            tail = f"| {r['ms']:.2f} | {r['tflops']:.3f} | {temp} |"
        lines.append(f"| {r['implementation']} | {r['dtype']} | {r['seq']} | {r['causal']} | "
                     f"{r['mode']} " + tail)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384,
                                                            32768])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--json", type=Path, default=None, help="also write the records here")
    args = p.parse_args(argv)
    print(f"backend {jax.default_backend()}: {jax.devices()[0].device_kind}", flush=True)
    records = run(args.seqs, [jnp.dtype(d) for d in args.dtypes], args.rounds, args.batch,
                  args.heads, args.dim)
    print(table(records))
    if args.json is not None:
        args.json.write_text(json.dumps(records, indent=1))
    return records


if __name__ == "__main__":
    main()
