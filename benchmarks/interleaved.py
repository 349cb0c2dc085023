"""The issue's speed targets, measured interleaved in one process.

    python benchmarks/interleaved.py [--seq 4096] [--rounds 7]

Every configuration is compiled first; then each round times every configuration once, in
a shuffled order, so noise from a shared machine falls on all of them alike. Prints medians
and the ratios the targets are stated in. (Peak memory needs one process per
configuration: `benchmarks/run.py`.)
"""

import random
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _interleave import problem_arguments  # noqa: E402
from _worker import METHODS  # noqa: E402  (the same three implementations as run.py)


def _fn(method, mode, causal, **kw):
    attend = METHODS[method]

    def fwd(q, k, v):
        return attend(q, k, v, causal, **kw)

    if mode == "fwd":
        return jax.jit(fwd)
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fwd(q, k, v)), argnums=(0, 1, 2)))


def main() -> None:
    p = problem_arguments(__doc__)
    p.add_argument("--no-seed", action="store_true", help="skip the (slow) seed package")
    args = p.parse_args()
    s, h, d = args.seq, args.heads, args.dim
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(kk, (1, h, s, d)) for kk in keys[:3])
    kv1 = jax.random.normal(keys[3], (1, 1, s, d))
    q8 = jnp.concatenate([q, q], axis=1)
    k8 = jnp.concatenate([k, k], axis=1)
    methods = ["eqx_flash", "plain_xla"] + ([] if args.no_seed else ["seed"])
    configs = {}
    for mode in ("fwd", "fwd+bwd"):
        for causal in (False, True):
            for m in methods:
                configs[(m, mode, causal)] = (_fn(m, mode, causal), (q, k, v))
    configs[("eqx_flash", "fwd+bwd", "gqa 8/8")] = (_fn("eqx_flash", "fwd+bwd", False),
                                                    (q8, k8, k8))
    configs[("eqx_flash", "fwd+bwd", "gqa 8/1")] = (_fn("eqx_flash", "fwd+bwd", False),
                                                    (q8, kv1, kv1))
    bf = tuple(x.astype(jnp.bfloat16) for x in (q, k, v))
    for m in ("eqx_flash", "plain_xla"):
        configs[(m, "fwd+bwd", "bf16")] = (_fn(m, "fwd+bwd", False), bf)

    print(f"compiling {len(configs)} configurations (seq {s}, {h} heads, dim {d}) ...",
          flush=True)
    for f, xs in configs.values():
        jax.block_until_ready(f(*xs))
    times = {c: [] for c in configs}
    order = list(configs)
    for r in range(args.rounds):
        # A fresh order each round: whichever call follows a large one pays for the memory
        # it released (measured up to ~30% on the first call of a round), so spread that.
        random.Random(r).shuffle(order)
        for c in order:
            f, xs = configs[c]
            t = time.perf_counter()
            jax.block_until_ready(f(*xs))
            times[c].append(time.perf_counter() - t)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    med = {c: statistics.median(t) for c, t in times.items()}

    print("\n| configuration | median ms |\n|---|---:|")
    for c, t in med.items():
        print(f"| {c[0]} {c[1]} {c[2] if isinstance(c[2], str) else ('causal' if c[2] else '')}"
              f" | {t * 1e3:.0f} |")
    print("\n| target | measured |\n|---|---:|")

    def ratio(a, b):
        return med[a] / med[b]

    for mode in ("fwd", "fwd+bwd"):
        for causal in (False, True):
            name = f"{mode}{' causal' if causal else ''}"
            print(f"| {name}: plain XLA / eqx_flash | "
                  f"{ratio(('plain_xla', mode, causal), ('eqx_flash', mode, causal)):.2f}x |")
            if "seed" in methods:
                print(f"| {name}: seed / eqx_flash | "
                      f"{ratio(('seed', mode, causal), ('eqx_flash', mode, causal)):.2f}x |")
    print(f"| fwd+bwd: non-causal / causal (eqx_flash) | "
          f"{ratio(('eqx_flash', 'fwd+bwd', False), ('eqx_flash', 'fwd+bwd', True)):.2f}x |")
    gqa = ratio(("eqx_flash", "fwd+bwd", "gqa 8/1"), ("eqx_flash", "fwd+bwd", "gqa 8/8"))
    print(f"| fwd+bwd GQA 8/1 vs 8/8 time (eqx_flash) | {gqa:.2f}x |")
    print(f"| fwd+bwd bf16 / f32 time (eqx_flash) | "
          f"{ratio(('eqx_flash', 'fwd+bwd', 'bf16'), ('eqx_flash', 'fwd+bwd', False)):.2f}x |")
    print(f"| fwd+bwd bf16: plain XLA / eqx_flash | "
          f"{ratio(('plain_xla', 'fwd+bwd', 'bf16'), ('eqx_flash', 'fwd+bwd', 'bf16')):.2f}x |")


if __name__ == "__main__":
    main()
