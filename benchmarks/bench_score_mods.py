"""Score terms: cost of `alibi_slopes` and `bias`, interleaved in one process.

    python benchmarks/bench_score_mods.py [--seq 4096] [--rounds 5]

Forward+backward (gradients w.r.t. q, k, v and the bias) at B1 H4 D64 float32: eqx_flash
without score terms, with ALiBi slopes, with a full `(1, H, seq, seq)` bias, and
`jax.nn.dot_product_attention(bias=...)` (XLA, materialised). Prints medians and ratios.
"""

import argparse
import random
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from eqx_flash import flash_attention  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    n, h, d = args.seq, 4, 64
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(kk, (1, h, n, d)) for kk in keys[:3])
    bias = jax.random.normal(keys[3], (1, h, n, n))
    slopes = 2.0 ** (-8.0 * jnp.arange(1, h + 1) / h)

    def grad_of(loss, argnums=(0, 1, 2, 3)):
        return jax.jit(jax.grad(loss, argnums=argnums))

    def xla(q, k, v, b):
        t = [jnp.swapaxes(x, 1, 2) for x in (q, k, v)]
        return jnp.sum(jax.nn.dot_product_attention(*t, bias=b, implementation="xla"))

    calls = {
        "eqx_flash": (grad_of(lambda q, k, v, b: jnp.sum(flash_attention(q, k, v)[0])), None),
        "eqx_flash alibi": (grad_of(lambda q, k, v, s: jnp.sum(
            flash_attention(q, k, v, alibi_slopes=s)[0])), slopes),
        # Constant slopes (the usual ALiBi) / a constant bias: gradients of q, k, v only.
        "eqx_flash alibi, constant slopes": (grad_of(lambda q, k, v, s: jnp.sum(
            flash_attention(q, k, v, alibi_slopes=s)[0]), (0, 1, 2)), slopes),
        "eqx_flash bias": (grad_of(lambda q, k, v, b: jnp.sum(
            flash_attention(q, k, v, bias=b)[0])), bias),
        "eqx_flash bias, constant": (grad_of(lambda q, k, v, b: jnp.sum(
            flash_attention(q, k, v, bias=b)[0]), (0, 1, 2)), bias),
        "jax.nn bias (xla)": (grad_of(xla), bias),
    }
    for fn, extra in calls.values():
        jax.block_until_ready(fn(q, k, v, extra))
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(args.rounds):
        order = list(calls)
        random.shuffle(order)
        for name in order:
            fn, extra = calls[name]
            t0 = time.perf_counter()
            jax.block_until_ready(fn(q, k, v, extra))
            times[name].append(time.perf_counter() - t0)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(f"\nseq {n}, B1 H{h} D{d}, float32, forward+backward, median of {args.rounds}\n")
    print("| configuration | median ms |\n|---|---:|")
    for name, ms in med.items():
        print(f"| {name} | {ms:.0f} |")
    print("\n| ratio | value |\n|---|---:|")
    print(f"| alibi / no score terms | {med['eqx_flash alibi'] / med['eqx_flash']:.2f}x |")
    print(f"| alibi, constant slopes / no score terms | "
          f"{med['eqx_flash alibi, constant slopes'] / med['eqx_flash']:.2f}x |")
    print(f"| jax.nn bias / eqx_flash bias, constant | "
          f"{med['jax.nn bias (xla)'] / med['eqx_flash bias, constant']:.2f}x |")
    print(f"| jax.nn bias / eqx_flash bias | "
          f"{med['jax.nn bias (xla)'] / med['eqx_flash bias']:.2f}x |")


if __name__ == "__main__":
    main()
