"""score_mod / mask_mod / block_mask: cost against the built-in paths, interleaved in one
process.

    python benchmarks/bench_flex.py [--seq 4096] [--block 256] [--rounds 5]

Forward+backward (gradients w.r.t. q, k, v) at B1 H4 D64 float32, every configuration at
the same `block_q = block_k = --block`:

- causal: `causal=True` (static schedule) against the same mask as a `mask_mod`, without
  and with a `block_mask`;
- block-sparse: a `mask_mod` keeping 10% of the block pairs (at least one per query
  block), with a `block_mask`, without one, and the dense call with no mask at all;
- a `RelativePositionBias` score_mod against no score terms.

Prints medians and ratios.
"""

import argparse
import random
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from eqx_flash import RelativePositionBias, flash_attention, make_block_mask  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    n, h, d, blk = args.seq, 4, 64, args.block
    blocks = dict(block_q=blk, block_k=blk)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(kk, (1, h, n, d)) for kk in keys[:3])

    def causal_mod(b, hh, i, j):
        return j <= i

    num = -(-n // blk)
    rng = np.random.default_rng(0)
    # 90% of the block pairs empty: one random key block per query block (so every row
    # attends), then random ones up to 10% of the pairs.
    tiles = np.zeros((num, num), bool)
    tiles[np.arange(num), rng.integers(0, num, num)] = True
    extra = max(round(0.1 * num * num) - int(tiles.sum()), 0)
    free = np.flatnonzero(~tiles)
    tiles.flat[rng.choice(free, extra, replace=False)] = True
    tiles_j = jnp.asarray(tiles)

    def sparse_mod(b, hh, i, j):
        return tiles_j[i // blk, j // blk]

    causal_mask = make_block_mask(causal_mod, (), 1, n, n, blk, blk)
    sparse_mask = make_block_mask(sparse_mod, (), 1, n, n, blk, blk)
    rpb = RelativePositionBias(h, key=keys[3])

    def grad_of(**kwargs):
        def loss(q, k, v):
            return jnp.sum(flash_attention(q, k, v, **blocks, **kwargs)[0])

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    calls = {
        "causal=True": grad_of(causal=True),
        "causal mask_mod": grad_of(mask_mod=causal_mod),
        "causal mask_mod + block_mask": grad_of(mask_mod=causal_mod, block_mask=causal_mask),
        "dense (no mask)": grad_of(),
        "sparse mask_mod": grad_of(mask_mod=sparse_mod),
        "sparse mask_mod + block_mask": grad_of(mask_mod=sparse_mod, block_mask=sparse_mask),
        "RelativePositionBias score_mod": grad_of(score_mod=rpb),
    }
    for fn in calls.values():
        jax.block_until_ready(fn(q, k, v))
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(args.rounds):
        order = list(calls)
        random.shuffle(order)
        for name in order:
            t0 = time.perf_counter()
            jax.block_until_ready(calls[name](q, k, v))
            times[name].append(time.perf_counter() - t0)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    kept = float(np.mean(tiles))
    print(f"\nseq {n}, B1 H{h} D{d}, float32, blocks {blk}x{blk}, forward+backward, "
          f"median of {args.rounds}; sparse mask keeps {kept:.0%} of the block pairs\n")
    print("| configuration | median ms |\n|---|---:|")
    for name, ms in med.items():
        print(f"| {name} | {ms:.0f} |")
    print("\n| ratio | value |\n|---|---:|")
    ratios = [
        ("causal mask_mod / causal=True", "causal mask_mod", "causal=True"),
        ("causal mask_mod + block_mask / causal=True", "causal mask_mod + block_mask",
         "causal=True"),
        ("sparse + block_mask / dense", "sparse mask_mod + block_mask", "dense (no mask)"),
        ("sparse without block_mask / dense", "sparse mask_mod", "dense (no mask)"),
        ("RelativePositionBias / dense", "RelativePositionBias score_mod", "dense (no mask)"),
    ]
    for label, a, b in ratios:
        print(f"| {label} | {med[a] / med[b]:.2f}x |")


if __name__ == "__main__":
    main()
