"""Drop-in front ends against the library they replace, interleaved in one process.

    python benchmarks/bench_frontends.py [--seq 4096] [--rounds 7]

`eqx_flash.dot_product_attention` against `jax.nn.dot_product_attention(implementation=
"xla")` on the same `(batch, seq, heads, dim)` arrays: fwd+bwd (gradients of q, k, v) and
the forward, causal and not. Each round times every configuration once, in a shuffled
order; prints medians and the ratios (jax.nn / eqx_flash: above 1 means eqx_flash is
faster).
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

IMPLEMENTATIONS = {"eqx_flash": eqx_flash.dot_product_attention,
                   "jax.nn xla": lambda *a, **kw: jax.nn.dot_product_attention(
                       *a, implementation="xla", **kw)}


def _grad(fn, causal):
    def loss(q, k, v):
        return jnp.sum(fn(q, k, v, is_causal=causal))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def main() -> None:
    p = problem_arguments(__doc__)
    args = p.parse_args()
    shape = (1, args.seq, args.heads, args.dim)
    q, k, v = (jax.random.normal(jax.random.key(i), shape) for i in range(3))
    calls = {}
    for name, fn in IMPLEMENTATIONS.items():
        for causal in (False, True):
            tag = " causal" if causal else ""
            calls[f"fwd+bwd{tag} {name}"] = _grad(fn, causal)
            calls[f"fwd{tag} {name}"] = jax.jit(lambda q, k, v, fn=fn, c=causal: fn(
                q, k, v, is_causal=c))
    seconds = interleaved_medians({name: functools.partial(fn, q, k, v)
                                   for name, fn in calls.items()}, args.rounds,
                                  jax.block_until_ready)
    median = {name: t * 1e3 for name, t in seconds.items()}
    print(f"\nseq {args.seq}, {args.heads} heads, dim {args.dim}, {args.rounds} rounds\n")
    print("| configuration | eqx_flash ms | jax.nn xla ms | jax.nn / eqx_flash |")
    print("|---|---:|---:|---:|")
    for config in ("fwd+bwd", "fwd+bwd causal", "fwd", "fwd causal"):
        ours, theirs = median[f"{config} eqx_flash"], median[f"{config} jax.nn xla"]
        print(f"| {config} | {ours:.0f} | {theirs:.0f} | {theirs / ours:.2f} |")


if __name__ == "__main__":
    main()
