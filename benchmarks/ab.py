"""A/B: this checkout's kernels against another git revision's, interleaved in one process.

    python benchmarks/ab.py --base main~1 [--seq 4096] [--rounds 7] [--only jvp,decode]
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/ab.py --only sharded

With 4 or more devices, `sharded_flash_attention` joins the list (each strategy, causal
fwd+bwd, the sequence over 4 devices); the single-device configurations then map heads
with `vmap` (`_kernels.xla.policy.heads_in_parallel`), so compare those without the flag.

Machines here are shared and noisy, so "before" and "after" numbers from two runs are not
comparable. This extracts the package at `--base` into a temporary directory under another
name (its imports are relative), compiles the same calls from both, and times them in
shuffled rounds in one process. Prints medians and the new/old time ratio per
configuration (below 1: the checkout is faster).
"""

import argparse
import functools
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
        ["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", rev, "eqx_flash/"],
        check=True, capture_output=True, text=True,
    ).stdout.split()
    for name in files:
        blob = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{name}"],
                              check=True, capture_output=True).stdout
        path = target / Path(name).relative_to("eqx_flash")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(blob)
    sys.path.insert(0, str(into))
    return importlib.import_module("eqx_flash_base")


def _normal(seed: int, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _grad(attend, argnums=(0, 1, 2), **kwargs):
    """`jax.grad` of `sum(out)` with respect to the arguments `argnums`."""
    def loss(*args):
        return jnp.sum(attend(*args, **kwargs)[0].astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=argnums))


def _documents(b, h, i, j):
    # Documents of 512 tokens, each also seeing a 64-token shared prefix.
    return ((i // 512) == (j // 512)) | (j < 64)


def _configs(seq: int, heads: int, dim: int):
    """`{name: build}`, `build(package) -> (compiled function, arguments)`."""
    mha = [_normal(i, (1, heads, seq, dim)) for i in range(3)]
    gqa = [_normal(0, (1, 8, seq, dim)), _normal(1, (1, 1, seq, dim)),
           _normal(2, (1, 1, seq, dim))]
    bf16 = [x.astype(jnp.bfloat16) for x in mha]
    tangents = tuple(_normal(i + 3, x.shape) for i, x in enumerate(mha))
    decode = [_normal(0, (1, heads, 1, dim)), _normal(1, (1, heads, 32768, dim)),
              _normal(2, (1, heads, 32768, dim))]
    bias = 0.5 * _normal(6, (1, 1, seq, seq))

    def jvp(package, **kwargs):
        def tangent(q, k, v):
            return jax.jvp(lambda *x: package.flash_attention(*x, **kwargs)[0], (q, k, v),
                           tangents)
        return jax.jit(tangent), mha

    def mask_mod(package):
        block_mask = package.make_block_mask(_documents, (1,), heads, seq, seq)
        return _grad(package.flash_attention, mask_mod=_documents,
                     block_mask=block_mask), mha

    segments = (jnp.arange(seq) // 512)[None].astype(jnp.int32)
    positions = jnp.arange(seq, dtype=jnp.int32)[None]
    slopes = jnp.geomspace(0.5, 0.5 ** 8, heads)

    def forward(**kwargs):
        return lambda p: (jax.jit(lambda q, k, v: p.flash_attention(q, k, v, **kwargs)), mha)

    configs = {
        "forward": forward(),
        "forward causal": forward(causal=True),
        "forward segment ids": forward(q_segment_ids=segments, kv_segment_ids=segments),
        "fwd+bwd": lambda p: (_grad(p.flash_attention), mha),
        "fwd+bwd causal": lambda p: (_grad(p.flash_attention, causal=True), mha),
        "fwd+bwd gqa 8/1": lambda p: (_grad(p.flash_attention), gqa),
        "fwd+bwd bf16": lambda p: (_grad(p.flash_attention), bf16),
        "jvp (q, k, v)": jvp,
        "jvp (q, k, v) causal": functools.partial(jvp, causal=True),
        "decode 1 x 32k": lambda p: (jax.jit(p.flash_attention), decode),
        "fwd+bwd mask_mod + block_mask": mask_mod,
        "fwd+bwd trained bias": lambda p: (
            _grad(lambda q, k, v, b: p.flash_attention(q, k, v, bias=b),
                  argnums=(0, 1, 2, 3)), [*mha, bias]),
        "fwd+bwd window (256, 0)": lambda p: (_grad(p.flash_attention, window=(256, 0)), mha),
        "fwd+bwd positions window + ALiBi": lambda p: (_grad(
            p.flash_attention, q_positions=positions, kv_positions=positions,
            window=(256, 16), alibi_slopes=slopes), mha),
    }
    if jax.device_count() >= 4:
        configs |= _sharded_configs(mha)
    return configs


def _sharded_configs(mha):
    """Causal fwd+bwd of `sharded_flash_attention` per strategy, sequence over 4 devices."""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:4]), ("seq",))
    placed = [jax.device_put(x, NamedSharding(mesh, PartitionSpec(None, None, "seq")))
              for x in mha]

    def build(strategy):
        def attend(q, k, v, p):
            return p.sharded_flash_attention(q, k, v, mesh=mesh, seq_axis="seq", causal=True,
                                             strategy=strategy)
        return lambda p: (_grad(functools.partial(attend, p=p)), placed)

    return {f"sharded {s} fwd+bwd causal": build(s) for s in ("ring", "ulysses", "all_gather")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD", help="git revision to compare against")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--only", default="", help="comma-separated names (substrings) to run")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    import eqx_flash

    with tempfile.TemporaryDirectory() as tmp:
        base = _load_revision(args.base, Path(tmp))
        calls = {}
        configs = _configs(args.seq, args.heads, args.dim)
        wanted = [w for w in args.only.split(",") if w]
        configs = {n: b for n, b in configs.items() if not wanted or any(w in n for w in wanted)}
        for name, build in configs.items():
            for label, package in (("new", eqx_flash), ("old", base)):
                fn, fn_args = build(package)
                jax.block_until_ready(fn(*fn_args))  # compile
                calls[(name, label)] = (fn, fn_args)
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
    for name in configs:
        old = statistics.median(times[(name, "old")]) * 1e3
        new = statistics.median(times[(name, "new")]) * 1e3
        digits = 1 if old < 20 else 0
        print(f"| {name} | {old:.{digits}f} | {new:.{digits}f} | {new / old:.2f} |")


if __name__ == "__main__":
    main()
