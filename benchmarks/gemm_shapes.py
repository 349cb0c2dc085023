"""Time XLA's CPU GEMM on the block products the kernels issue, to explain the block sizes.

    python benchmarks/gemm_shapes.py [--reps 7]

Each shape runs 64 products in a `fori_loop` (as inside the kernels) and reports the
median time per product and its GFLOP/s. Rows "NN" are row-major products (`a @ b`);
"TN" contract over the rows of both operands (`a^T b`, what an untransposed backward
needs for dk and dv); "batched" stacks several small products into one `dot_general`.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

ITERS = 64


def _time(fn, reps):
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / ITERS


def _loop(a, b, spec, out_shape):
    def body(i, acc):
        return acc + jnp.einsum(spec, a[i], b)

    return jax.jit(lambda: jax.lax.fori_loop(0, ITERS, body, jnp.zeros(out_shape)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--dim", type=int, default=64)
    args = p.parse_args()
    d = args.dim
    key = jax.random.key(0)
    print(f"{'product':44s} {'us':>7s} {'GFLOP/s':>8s}")

    def report(name, seconds, flops):
        print(f"{name:44s} {seconds * 1e6:7.0f} {flops / seconds / 1e9:8.1f}", flush=True)

    for m, n in ((128, 256), (256, 256), (256, 512), (512, 256), (512, 512), (512, 1024),
                 (1024, 256)):
        a = jax.random.normal(key, (ITERS, m, d))
        b = jax.random.normal(key, (d, n))
        report(f"logits NN ({m} x {d}) @ ({d} x {n})", _time(_loop(a, b, "qd,dk->qk", (m, n)),
               args.reps), 2 * m * n * d)
        p_ = jax.random.normal(key, (ITERS, m, n))
        do = jax.random.normal(key, (m, d))
        report(f"dv TN ({m} x {n})^T @ ({m} x {d})",
               _time(_loop(p_, do, "qk,qd->kd", (n, d)), args.reps), 2 * m * n * d)
        pt = jax.random.normal(key, (ITERS, n, m))
        report(f"dv NN ({n} x {m}) @ ({m} x {d})",
               _time(_loop(pt, do, "kq,qd->kd", (n, d)), args.reps), 2 * m * n * d)
    for batch, s in ((16, 256), (64, 128)):
        a = jax.random.normal(key, (ITERS, batch, s, d))
        b = jax.random.normal(key, (batch, d, s))
        seconds = _time(_loop(a, b, "nqd,ndk->nqk", (batch, s, s)), args.reps)
        report(f"batched {batch} x ({s} x {d}) @ ({d} x {s})", seconds, 2 * batch * s * s * d)

if __name__ == "__main__":
    main()
