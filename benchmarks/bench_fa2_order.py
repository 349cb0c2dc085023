"""The cost of FlashAttention-2's order of the soft cap and ALiBi in the front ends.

    python benchmarks/bench_fa2_order.py [--seq 4096] [--rounds 7]

FA2 adds ALiBi after the soft cap; `flash_attention` caps last. With both, the front ends
(`flash_attn_func`, `flash_attn_varlen_func`) cap and add ALiBi in a `score_mod`
instead of the kernels' built-in terms. This times, interleaved, causal fwd+bwd on
`(1, seq, heads, dim)`: `flash_attn_func` with both (the score_mod), `flash_attention`
with both built in (its own order: not FA2's numbers, the speed the built-in terms
would give), and `flash_attn_varlen_func` on 4 packed sequences of seq / 4, both ways.
Prints medians and the ratio to the built-in terms.
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

SOFTCAP = 30.0


def _grad(fn):
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2)))


def main() -> None:
    args = problem_arguments(__doc__).parse_args()
    shape = (1, args.seq, args.heads, args.dim)
    q, k, v = (jax.random.normal(jax.random.key(i), shape) for i in range(3))
    slopes = jnp.geomspace(0.5, 0.5 ** 8, args.heads)
    cu = jnp.arange(0, args.seq + 1, args.seq // 4, dtype=jnp.int32)

    def dense_builtin(q, k, v):  # flash_attention's order, in the kernels
        out, _ = eqx_flash.flash_attention(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v)),
                                           causal=True, softcap=SOFTCAP, alibi_slopes=slopes)
        return out

    def varlen(q, k, v, softcap):
        return eqx_flash.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, args.seq // 4,
                                                args.seq // 4, causal=True, softcap=softcap,
                                                alibi_slopes=slopes)

    def varlen_builtin(q, k, v):  # the per-head ALiBi on positions, cap applied after
        seq = jnp.repeat(jnp.arange(4, dtype=jnp.int32), args.seq // 4)
        pos = jnp.tile(jnp.arange(args.seq // 4, dtype=jnp.int32), 4)
        out, _ = eqx_flash.flash_attention(
            *(jnp.swapaxes(x[0], 0, 1) for x in (q, k, v)), causal=True, softcap=SOFTCAP,
            alibi_slopes=slopes, q_segment_ids=seq, kv_segment_ids=seq, q_positions=pos,
            kv_positions=pos)
        return out

    calls = {
        "dense FA2 order (score_mod)": _grad(functools.partial(
            eqx_flash.flash_attn_func, causal=True, softcap=SOFTCAP, alibi_slopes=slopes)),
        "dense built-in terms": _grad(dense_builtin),
        "varlen FA2 order (score_mod)": _grad(functools.partial(varlen, softcap=SOFTCAP)),
        "varlen built-in terms": _grad(varlen_builtin),
    }
    seconds = interleaved_medians({name: functools.partial(fn, q, k, v)
                                   for name, fn in calls.items()}, args.rounds,
                                  jax.block_until_ready)
    print(f"\ncausal fwd+bwd, seq {args.seq}, {args.heads} heads, dim {args.dim}, "
          f"{args.rounds} rounds\n")
    print("| configuration | ms | / built-in |")
    print("|---|---:|---:|")
    for kind in ("dense", "varlen"):
        base = seconds[f"{kind} built-in terms"]
        for name in (f"{kind} FA2 order (score_mod)", f"{kind} built-in terms"):
            print(f"| {name} | {seconds[name] * 1e3:.0f} | {seconds[name] / base:.2f} |")


if __name__ == "__main__":
    main()
