"""Block-size sweep behind `DEFAULT_BLOCKS` and `DEFAULT_BLOCKS_BANDED` (`eqx_flash/_config.py`).

    python benchmarks/tune_blocks.py [--seq 4096] [--heads 4] [--reps 3] [--forward]

Times jitted forward+backward (or, with `--forward`, the forward alone; causal and not)
for each block pair in one process, interleaving the candidates each repetition so
machine noise hits them alike, and writes `benchmarks/tune_blocks.json`. The recorded
result is in `benchmarks/tune_blocks.md`.
"""

import argparse
import json
import pathlib
import time

import jax
import numpy as np

from eqx_flash import flash_attention

CANDIDATES = [(256, 256), (512, 256), (1024, 256), (256, 512), (512, 512), (1024, 512),
              (256, 1024), (512, 1024), (1024, 1024), (256, 2048), (512, 2048), (384, 384),
              (1024, 2048), (2048, 1024), (2048, 2048)]


def main() -> None:
    p = argparse.ArgumentParser(description="Sweep eqx_flash CPU block sizes.")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--forward", action="store_true", help="time the forward alone")
    p.add_argument("--out", type=pathlib.Path,
                   default=pathlib.Path(__file__).parent / "tune_blocks.json")
    args = p.parse_args()
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    shape = (1, args.heads, args.seq, args.dim)
    q, k, v = (jax.random.normal(key, shape) for key in (kq, kk, kv))
    fns = {}
    for causal in (False, True):
        for bq, bk in CANDIDATES:
            def loss(q, k, v, bq=bq, bk=bk, causal=causal):
                return flash_attention(q, k, v, causal=causal, block_q=bq, block_k=bk)[0].sum()

            fns[(causal, bq, bk)] = jax.jit(loss if args.forward
                                            else jax.grad(loss, argnums=(0, 1, 2)))
    for name, f in fns.items():
        print("compiling", name, flush=True)
        jax.block_until_ready(f(q, k, v))
    times = {name: [] for name in fns}
    for rep in range(args.reps):
        for name, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(q, k, v))
            times[name].append(time.perf_counter() - t0)
            print(f"rep {rep} causal={name[0]} block_q={name[1]} block_k={name[2]}: "
                  f"{times[name][-1] * 1e3:.0f} ms", flush=True)
    rows = [dict(causal=c, block_q=bq, block_k=bk, median_s=float(np.median(t)), times=t)
            for (c, bq, bk), t in times.items()]
    for causal in (False, True):
        best = min((r for r in rows if r["causal"] == causal), key=lambda r: r["median_s"])
        print(f"causal={causal}: best block_q={best['block_q']} block_k={best['block_k']}")
        for r in rows:
            if r["causal"] == causal:
                print(f"  {r['block_q']:>5} x {r['block_k']:<5} {r['median_s'] * 1e3:7.0f} ms "
                      f"({r['median_s'] / best['median_s']:.2f}x best)")
    args.out.write_text(json.dumps(dict(args=vars(args) | {"out": str(args.out)},
                                        results=rows), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
