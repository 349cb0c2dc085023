"""Forward mode: jvp (primal + tangent) time and memory against the forward and the
forward+backward of eqx_flash, and against `jax.jvp` of materialised XLA attention.

    python benchmarks/bench_jvp.py [--seqs 1024 2048 4096 8192] [--max-seq 16384]
                                   [--heads 4] [--dim 64] [--rounds 5] [--grad-only]

Every configuration is compiled first (peak memory from XLA's compiled
`memory_analysis()`: temporaries plus arguments and outputs), then each round times every
configuration once in a shuffled order, each after an untimed run of its own
(`_interleave.interleaved_medians`), so noise on a shared machine falls on all alike.
Prints medians and ratios. Materialised XLA stops at 8192 (its seq x seq logits, their
tangents and softmax take several GiB beyond).

`--grad-only` times only eqx_flash's forward+backward (the reverse-mode program), for
before/after comparisons of reverse mode across branches.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
from _interleave import interleaved_medians

from eqx_flash import flash_attention


def xla_attention(q, k, v, causal):
    """Plain materialised softmax attention (one einsum, softmax, einsum)."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / jnp.sqrt(jnp.asarray(q.shape[-1], q.dtype))
    if causal:
        n = q.shape[2]
        s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


def flash(q, k, v, causal):
    return flash_attention(q, k, v, causal=causal)[0]


def make(impl, mode, causal):
    def fwd(q, k, v):
        return impl(q, k, v, causal)

    if mode == "fwd":
        return jax.jit(fwd), 3
    if mode == "fwd+bwd":
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fwd(q, k, v)), argnums=(0, 1, 2))), 3

    def jvp(q, k, v, dq, dk, dv):
        return jax.jvp(fwd, (q, k, v), (dq, dk, dv))

    return jax.jit(jvp), 6


def peak_mib(f, args) -> float:
    m = f.lower(*args).compile().memory_analysis()
    if m is None:
        return float("nan")
    return (m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes) / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--max-seq", type=int, default=None,
                   help="also run this length (e.g. 16384) for eqx_flash")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--grad-only", action="store_true")
    args = p.parse_args()
    seqs = list(args.seqs) + ([args.max_seq] if args.max_seq else [])
    modes = ("fwd+bwd",) if args.grad_only else ("fwd", "fwd+bwd", "jvp")
    configs = {}
    for s in seqs:
        keys = jax.random.split(jax.random.key(s), 6)
        xs = [jax.random.normal(kk, (1, args.heads, s, args.dim)) for kk in keys]
        for mode in modes:
            f, n = make(flash, mode, args.causal)
            configs[("eqx_flash", mode, s)] = (f, xs[:n])
        if not args.grad_only and s <= 8192:
            f, n = make(xla_attention, "jvp", args.causal)
            configs[("xla", "jvp", s)] = (f, xs[:n])
    print(f"compiling {len(configs)} configurations ({args.heads} heads, dim {args.dim}, "
          f"causal={args.causal}) ...", flush=True)
    memory = {}
    for c, (f, xs) in configs.items():
        memory[c] = peak_mib(f, xs)
        jax.block_until_ready(f(*xs))
    calls = {c: functools.partial(f, *xs) for c, (f, xs) in configs.items()}
    seconds = interleaved_medians(calls, args.rounds, jax.block_until_ready, warm_up=False,
                                  settle=1)
    med = {c: t * 1e3 for c, t in seconds.items()}

    print("\n| impl | mode | seq | median ms | peak MiB | jvp / eqx fwd | jvp / eqx fwd+bwd "
          "| xla jvp / eqx jvp |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for c in configs:
        impl, mode, s = c
        extra = ["", "", ""]
        if impl == "eqx_flash" and mode == "jvp":
            extra[0] = f"{med[c] / med[('eqx_flash', 'fwd', s)]:.2f}x"
            extra[1] = f"{med[c] / med[('eqx_flash', 'fwd+bwd', s)]:.2f}x"
            if ("xla", "jvp", s) in med:
                extra[2] = f"{med[('xla', 'jvp', s)] / med[c]:.2f}x"
        print(f"| {impl} | {mode} | {s} | {med[c]:.1f} | {memory[c]:.0f} | "
              + " | ".join(extra) + " |")


if __name__ == "__main__":
    main()
