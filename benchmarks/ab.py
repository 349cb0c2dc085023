"""A/B: this checkout's kernels against another git revision's, interleaved in one process.

    python benchmarks/ab.py --base main~1 [--seq 4096] [--rounds 7]

Machines here are shared and noisy, so "before" and "after" numbers from two runs are not
comparable. This extracts the package at `--base` into a temporary directory under another
name (its imports are relative), compiles the same calls from both, and times them in
shuffled rounds in one process. Prints medians and the new/old time ratio per
configuration (below 1: the checkout is faster).
"""

import argparse
import importlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parent.parent


def _load_revision(rev: str, into: Path):
    """Import `eqx_flash` as of git revision `rev` under the name `eqx_flash_base`."""
    target = into / "eqx_flash_base"
    target.mkdir()
    files = subprocess.run(
        ["git", "-C", str(ROOT), "ls-tree", "--name-only", rev, "eqx_flash/"],
        check=True, capture_output=True, text=True,
    ).stdout.split()
    for name in files:
        blob = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{name}"],
                              check=True, capture_output=True).stdout
        (target / Path(name).name).write_bytes(blob)
    sys.path.insert(0, str(into))
    return importlib.import_module("eqx_flash_base")


def _configs(seq: int, heads: int, dim: int):
    """name, q/k/v shapes, keywords, dtype."""
    mha = ((1, heads, seq, dim),) * 3
    gqa = ((1, 8, seq, dim), (1, 1, seq, dim), (1, 1, seq, dim))
    return [
        ("fwd+bwd", mha, {}, jnp.float32),
        ("fwd+bwd causal", mha, {"causal": True}, jnp.float32),
        ("fwd+bwd gqa 8/1", gqa, {}, jnp.float32),
        ("fwd+bwd bf16", mha, {}, jnp.bfloat16),
    ]


def _grad_fn(attend, kwargs):
    def loss(q, k, v):
        return jnp.sum(attend(q, k, v, **kwargs)[0].astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD", help="git revision to compare against")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    import eqx_flash

    with tempfile.TemporaryDirectory() as tmp:
        base = _load_revision(args.base, Path(tmp))
        calls = {}
        for name, shapes, kwargs, dtype in _configs(args.seq, args.heads, args.dim):
            keys = jax.random.split(jax.random.key(0), 3)
            qkv = [jax.random.normal(kk, s, jnp.float32).astype(dtype)
                   for kk, s in zip(keys, shapes, strict=True)]
            for label, package in (("new", eqx_flash), ("old", base)):
                fn = _grad_fn(package.flash_attention, kwargs)
                jax.block_until_ready(fn(*qkv))  # compile
                calls[(name, label)] = (fn, qkv)
        print(f"compiled {len(calls)} calls (seq {args.seq}, {args.heads} heads, dim "
              f"{args.dim}); base = {args.base}", flush=True)
        times: dict[tuple[str, str], list[float]] = {c: [] for c in calls}
        order = list(calls)
        for r in range(args.rounds):
            random.shuffle(order)
            for c in order:
                fn, qkv = calls[c]
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*qkv))
                times[c].append(time.perf_counter() - t0)
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    print("\n| configuration | old ms | new ms | new / old |\n|---|---:|---:|---:|")
    for name, *_ in _configs(args.seq, args.heads, args.dim):
        old = statistics.median(times[(name, "old")]) * 1e3
        new = statistics.median(times[(name, "new")]) * 1e3
        print(f"| {name} | {old:.0f} | {new:.0f} | {new / old:.2f} |")


if __name__ == "__main__":
    main()
