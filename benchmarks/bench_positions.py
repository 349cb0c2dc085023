"""Attention on positions (`q_positions`/`kv_positions`), interleaved in one process
against the same masks on indices.

    python benchmarks/bench_positions.py [--seq 4096] [--rounds 7]

Configurations, fwd+bwd: causal on positions `arange(seq)` against `causal=True` (the
same mask, found at run time from the positions instead of statically), a window on
positions against `window=`, and packed documents (4 documents with restarting
positions, causal within each by segment ids) against the same documents by segment ids
on indices. Each round times every configuration once, in a shuffled order; prints
medians and the ratios.
"""

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _interleave import interleaved_medians, problem_arguments  # noqa: E402

import eqx_flash  # noqa: E402


def _grad(**kwargs):
    def loss(q, k, v, extra):
        out, lse = eqx_flash.flash_attention(q, k, v, **extra, **kwargs)
        return jnp.sum(out) + jnp.sum(lse)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def main() -> None:
    p = problem_arguments(__doc__)
    args = p.parse_args()
    seq = args.seq
    shape = (1, args.heads, seq, args.dim)
    q, k, v = (jax.random.normal(jax.random.key(i), shape) for i in range(3))
    index = jnp.arange(seq, dtype=jnp.int32)[None]
    positions = dict(q_positions=index, kv_positions=index)
    docs = 4
    ids = (index * docs) // seq
    packed = dict(q_segment_ids=ids, kv_segment_ids=ids)
    restarting = index - ids * (seq // docs)
    calls = {
        "causal=True": (_grad(causal=True), {}),
        "causal on positions": (_grad(causal=True), positions),
        "window=(512, 0)": (_grad(window=(512, 0)), {}),
        "window (512, 0) on positions": (_grad(window=(512, 0)), positions),
        "packed, causal on indices": (_grad(causal=True), packed),
        "packed, causal on restarting positions": (
            _grad(causal=True), dict(packed, q_positions=restarting, kv_positions=restarting)),
    }
    seconds = interleaved_medians({name: functools.partial(fn, q, k, v, extra)
                                   for name, (fn, extra) in calls.items()}, args.rounds,
                                  jax.block_until_ready)
    median = {name: t * 1e3 for name, t in seconds.items()}
    print(f"\nseq {seq}, {args.heads} heads, dim {args.dim}, fwd+bwd, {args.rounds} rounds\n")
    print("| configuration | median ms | ratio |\n|---|---:|---:|")
    names = list(calls)
    for base, name in zip(names[::2], names[1::2], strict=True):
        print(f"| {base} | {median[base]:.0f} | |")
        print(f"| {name} | {median[name]:.0f} | {median[name] / median[base]:.2f} |")


if __name__ == "__main__":
    main()
