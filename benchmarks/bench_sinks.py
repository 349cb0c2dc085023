"""Sinks, max scores and merging, interleaved in one process against the plain call.

    python benchmarks/bench_sinks.py [--seq 4096] [--rounds 7]

Configurations: fwd+bwd with and without `sinks` (full and causal); causal fwd+bwd and
forward with and without `return_max_scores` (the max returned alongside the gradients,
as a QK-clip step reads it); and the forward of `merge_attention` over 4 key parts
against one call over all the keys. Each round times every configuration once, in a
shuffled order; prints medians and the ratios.
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


def _grad(max_scores: bool = False, **kwargs):
    def loss(q, k, v, sinks):
        out, lse, *top = eqx_flash.flash_attention(q, k, v, sinks=sinks,
                                                   return_max_scores=max_scores, **kwargs)
        return jnp.sum(out) + jnp.sum(lse), top

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def _forward(max_scores: bool, **kwargs):
    return jax.jit(lambda q, k, v: eqx_flash.flash_attention(
        q, k, v, return_max_scores=max_scores, **kwargs))


def _merge_of_parts(parts: int):
    def f(q, k, v):
        n = k.shape[-2] // parts
        results = [eqx_flash.flash_attention(q, k[..., i * n:(i + 1) * n, :],
                                             v[..., i * n:(i + 1) * n, :])
                   for i in range(parts)]
        return eqx_flash.merge_attention(jnp.stack([r[0] for r in results]),
                                         jnp.stack([r[1] for r in results]))

    return jax.jit(f)


def main() -> None:
    p = problem_arguments(__doc__)
    args = p.parse_args()
    shape = (1, args.heads, args.seq, args.dim)
    q, k, v = (jax.random.normal(jax.random.key(i), shape) for i in range(3))
    sinks = jnp.zeros((args.heads,))
    calls = {
        "fwd+bwd": (_grad(), (q, k, v, None)),
        "fwd+bwd sinks": (_grad(), (q, k, v, sinks)),
        "fwd+bwd causal": (_grad(causal=True), (q, k, v, None)),
        "fwd+bwd causal sinks": (_grad(causal=True), (q, k, v, sinks)),
        "fwd+bwd causal max scores": (_grad(True, causal=True), (q, k, v, None)),
        "fwd causal": (_forward(False, causal=True), (q, k, v)),
        "fwd causal max scores": (_forward(True, causal=True), (q, k, v)),
        "fwd one call": (jax.jit(eqx_flash.flash_attention), (q, k, v)),
        "fwd merge of 4 parts": (_merge_of_parts(4), (q, k, v)),
    }
    seconds = interleaved_medians({name: functools.partial(fn, *fn_args)
                                   for name, (fn, fn_args) in calls.items()}, args.rounds,
                                  jax.block_until_ready)
    median = {name: t * 1e3 for name, t in seconds.items()}
    print(f"\nseq {args.seq}, {args.heads} heads, dim {args.dim}, {args.rounds} rounds\n")
    print("| configuration | median ms | ratio |\n|---|---:|---:|")
    for name, base in (("fwd+bwd sinks", "fwd+bwd"), ("fwd+bwd causal sinks", "fwd+bwd causal"),
                       ("fwd+bwd causal max scores", "fwd+bwd causal"),
                       ("fwd causal max scores", "fwd causal"),
                       ("fwd merge of 4 parts", "fwd one call")):
        print(f"| {base} | {median[base]:.0f} | |")
        print(f"| {name} | {median[name]:.0f} | {median[name] / median[base]:.2f} |")


if __name__ == "__main__":
    main()
