"""Decoding and variable-length benchmarks (issue 14), interleaved in one process.

    python benchmarks/bench_decode.py [--lengths 4096 32768 131072] [--rounds 5]
                                      [--varlen-max 4096] [--skip-varlen]

Decode: one query token, batch 1, 8 query heads on 2 kv heads, dim 64, float32, a cache
of each length (half of it valid, the rest padding): time per token of
`flash_attention(..., kv_lengths=)` (the flash-decoding path), of the regular blockwise
path on the same problem (`SPLIT_K_MAX_Q` lowered so the split is not taken), and of
`jax.nn.dot_product_attention(..., key_value_seq_lengths=)` (materialised XLA); and the
bytes of valid K and V read per second against a large-array copy measured in the same
run.

Variable lengths: batch 8, lengths uniform in [512, max] padded to max, causal,
forward+backward, against the same total tokens packed into one sequence with segment
ids.

Each round times every configuration once, in a shuffled order; medians are reported.
"""

import argparse
import random
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import eqx_flash._kernels.xla.policy as policy
from eqx_flash import flash_attention


def _time(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def _interleaved(configs: dict, rounds: int) -> dict:
    for fn, args in configs.values():
        jax.block_until_ready(fn(*args))  # compile
    times: dict = {name: [] for name in configs}
    names = list(configs)
    for _ in range(rounds):
        random.shuffle(names)
        for name in names:
            fn, args = configs[name]
            times[name].append(_time(fn, *args))
    return {name: statistics.median(t) for name, t in times.items()}


def decode(lengths: list[int], rounds: int) -> None:
    big = jnp.ones((64 * 2**20 // 4,), jnp.float32)  # 64 MiB
    copy = jax.jit(lambda x: x + 1.0)
    copy_time = _interleaved({"copy": (copy, (big,))}, rounds * 3)["copy"]
    bandwidth = 2 * big.nbytes / copy_time  # read + write
    print(f"copy bandwidth (64 MiB read + write): {bandwidth / 1e9:.1f} GB/s")
    print("| cache | valid | split-K flash | regular flash | XLA materialised | "
          "split-K vs XLA | K,V GB/s (split-K) | of copy bw |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for n in lengths:
        keys = jax.random.split(jax.random.key(n), 3)
        q = jax.random.normal(keys[0], (1, 8, 1, 64))
        k = jax.random.normal(keys[1], (1, 2, n, 64))
        v = jax.random.normal(keys[2], (1, 2, n, 64))
        valid = jnp.array([n // 2], jnp.int32)
        split = jax.jit(lambda q, k, v, n: flash_attention(q, k, v, kv_lengths=n)[0])
        old = policy.SPLIT_K_MAX_Q
        policy.SPLIT_K_MAX_Q = 0  # the regular path, compiled now
        regular = jax.jit(lambda q, k, v, n: flash_attention(q, k, v, kv_lengths=n)[0])
        jax.block_until_ready(regular(q, k, v, valid))
        policy.SPLIT_K_MAX_Q = old

        def xla(q, k, v, n):
            # jax.nn wants (batch, seq, heads, dim)
            def swap(x):
                return jnp.swapaxes(x, 1, 2)

            out = jax.nn.dot_product_attention(swap(q), swap(k), swap(v), key_value_seq_lengths=n,
                                               implementation="xla")
            return jnp.swapaxes(out, 1, 2)

        configs = {"split": (split, (q, k, v, valid)), "regular": (regular, (q, k, v, valid)),
                   "xla": (jax.jit(xla), (q, k, v, valid))}
        ref = np.asarray(configs["xla"][0](q, k, v, valid))
        for name in ("split", "regular"):
            np.testing.assert_allclose(np.asarray(configs[name][0](q, k, v, valid)), ref,
                                       atol=1e-4)
        t = _interleaved(configs, rounds)
        read = 2 * 2 * (n // 2) * 64 * 4  # valid K and V bytes
        gbs = read / t["split"] / 1e9
        print(f"| {n} | {n // 2} | {t['split'] * 1e3:.3f} ms | {t['regular'] * 1e3:.3f} ms | "
              f"{t['xla'] * 1e3:.3f} ms | {t['xla'] / t['split']:.2f}x | {gbs:.1f} | "
              f"{gbs * 1e9 / bandwidth:.0%} |", flush=True)


def varlen(max_len: int, rounds: int) -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(512, max_len + 1, 8).astype(np.int32)
    total = int(lengths.sum())
    keys = jax.random.split(jax.random.key(1), 3)
    q, k, v = (jax.random.normal(kk, (8, 4, max_len, 64)) for kk in keys)
    qp, kp, vp = (jax.random.normal(kk, (4, total, 64)) for kk in keys)
    ids = jnp.asarray(np.repeat(np.arange(8), lengths).astype(np.int32))

    def padded(q, k, v, n):
        return flash_attention(q, k, v, causal=True, q_lengths=n, kv_lengths=n)[0].sum()

    def packed(q, k, v, ids):
        return flash_attention(q, k, v, causal=True, q_segment_ids=ids,
                               kv_segment_ids=ids)[0].sum()

    def full(q, k, v):
        return flash_attention(q, k, v, causal=True)[0].sum()

    def grad(f):
        return jax.jit(jax.grad(f, argnums=(0, 1, 2)))

    configs = {"padded + lengths": (grad(padded), (q, k, v, jnp.asarray(lengths))),
               "packed + segment ids": (grad(packed), (qp, kp, vp, ids)),
               "padded, no lengths": (grad(full), (q, k, v))}
    t = _interleaved(configs, rounds)
    print(f"varlen fwd+bwd, batch 8, lengths {lengths.tolist()} (total {total}) padded to "
          f"{max_len}, causal, 4 heads, dim 64:")
    for name, x in t.items():
        print(f"  {name}: {x * 1e3:.0f} ms ({x / t['packed + segment ids']:.2f}x packed)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768, 131072])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--varlen-max", type=int, default=4096)
    p.add_argument("--skip-varlen", action="store_true")
    args = p.parse_args()
    print(f"backend: {jax.default_backend()}, devices: {jax.devices()}")
    decode(args.lengths, args.rounds)
    if not args.skip_varlen:
        varlen(args.varlen_max, max(args.rounds // 2, 2))


if __name__ == "__main__":
    main()
