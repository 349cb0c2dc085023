"""Second-order derivatives, interleaved in one process: eqx_flash against XLA.

    python benchmarks/bench_second_order.py [--seqs 1024 2048 4096] [--rounds 5]

Per sequence length (fp32, causal, one batch, `--heads` heads, dim 64): eqx_flash's
fwd+bwd (the unit), and for eqx_flash and for `plain_attention` (XLA, materialising):
the Hessian-vector product (`jax.jvp` of `jax.grad` along q, k, v), the gradient of a
gradient penalty (`jax.grad` of `|d loss / d q|^2`) and the gradient of a loss on a jvp
tangent. Each round times every configuration once, in a shuffled order; prints median
milliseconds, ratios, and each program's compiled temporaries (XLA's
`memory_analysis()`). XLA's programs are skipped where their temporaries would pass
`--max-xla-gib`.
"""

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _interleave import interleaved_medians  # noqa: E402

import eqx_flash  # noqa: E402


def _attention(name: str):
    if name == "eqx_flash":
        return functools.partial(eqx_flash.flash_attention, causal=True)
    return functools.partial(eqx_flash.plain_attention, causal=True)


def _loss(attention, q, k, v):
    out, lse = attention(q, k, v)
    return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))


def programs(name: str) -> dict[str, object]:
    """The four programs of one implementation, each `f(q, k, v, dq, dk, dv)`."""
    attention = _attention(name)
    loss = functools.partial(_loss, attention)
    grad = jax.grad(loss, argnums=(0, 1, 2))

    def fwd_bwd(q, k, v, dq, dk, dv):
        del dq, dk, dv
        return grad(q, k, v)

    def hvp(q, k, v, dq, dk, dv):
        return jax.jvp(grad, (q, k, v), (dq, dk, dv))[1]

    def grad_of_grad(q, k, v, dq, dk, dv):
        del dq, dk, dv
        return jax.grad(lambda q, k, v: jnp.sum(jax.grad(loss)(q, k, v) ** 2),
                        argnums=(0, 1, 2))(q, k, v)

    def grad_of_tangent(q, k, v, dq, dk, dv):
        def on_tangent(q, k, v):
            d_out = jax.jvp(lambda q, k, v: attention(q, k, v)[0], (q, k, v), (dq, dk, dv))[1]
            return jnp.sum(d_out**2)

        return jax.grad(on_tangent, argnums=(0, 1, 2))(q, k, v)

    return {"fwd+bwd": fwd_bwd, "hvp": hvp, "grad of grad": grad_of_grad,
            "grad of tangent": grad_of_tangent}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-xla-gib", type=float, default=8.0)
    args = p.parse_args()
    rows = []
    for seq in args.seqs:
        shape = (1, args.heads, seq, args.dim)
        arrays = [jax.random.normal(jax.random.key(i), shape) for i in range(6)]
        calls, temps = {}, {}
        for impl in ("eqx_flash", "xla"):
            for what, fn in programs(impl).items():
                if impl == "xla" and what == "fwd+bwd":
                    continue
                compiled = jax.jit(fn).lower(*arrays).compile()
                analysis = compiled.memory_analysis()
                temp = analysis.temp_size_in_bytes if analysis is not None else float("nan")
                key = f"{impl} {what}"
                temps[key] = temp
                if impl == "xla" and temp > args.max_xla_gib * 2**30:
                    continue
                calls[key] = functools.partial(compiled, *arrays)
        seconds = interleaved_medians(calls, args.rounds, jax.block_until_ready)
        unit = seconds["eqx_flash fwd+bwd"]
        for key, temp in temps.items():
            t = seconds.get(key)
            rows.append((seq, key, None if t is None else t * 1e3,
                         None if t is None else t / unit, temp / 2**20))
        print(f"seq {seq} done", flush=True)
    print(f"\nfp32, causal, {args.heads} heads, dim {args.dim}, {args.rounds} rounds; "
          "ratio: to eqx_flash fwd+bwd at the same seq\n")
    print("| seq | program | median ms | ratio | temporaries MiB |\n|---:|---|---:|---:|---:|")
    for seq, key, ms, ratio, mib in rows:
        ms_text = "skipped" if ms is None else f"{ms:.0f}"
        ratio_text = "" if ratio is None else f"{ratio:.2f}"
        print(f"| {seq} | {key} | {ms_text} | {ratio_text} | {mib:.0f} |")


if __name__ == "__main__":
    main()
