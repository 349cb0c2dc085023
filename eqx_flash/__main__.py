"""`python -m eqx_flash`: the seed's sanity check over several configurations.

Compares `flash_attention` with `plain_attention` (outputs and gradients), times the
jitted forward+backward of each and reads each one's compiled temporary memory from XLA.
Exits with status 1 if any difference exceeds its tolerance.
"""

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ._api.flash import flash_attention
from ._api.reference import plain_attention
from ._api.sanity import value_and_grad_difference

OUT_TOLERANCE = 1e-4
GRAD_TOLERANCE = 1e-3

# name, value_and_grad_difference shapes, attention keywords
CONFIGS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("key mask", dict(q_seq_len=512, k_seq_len=768), {}),
    ("causal", dict(q_seq_len=512, k_seq_len=512, add_key_mask=False), dict(causal=True)),
    ("causal + key mask, q < k", dict(q_seq_len=256, k_seq_len=768), dict(causal=True)),
    ("GQA 8 q heads / 2 kv heads", dict(heads=8, kv_heads=2, q_seq_len=512, k_seq_len=512), {}),
    ("odd lengths 1000 x 1500", dict(batch=1, q_seq_len=1000, k_seq_len=1500), {}),
    ("window (128, 0) + softcap 20", dict(q_seq_len=512, k_seq_len=512, add_key_mask=False),
     dict(window=(128, 0), softcap=20.0)),
]


def _loss(fn: Callable[..., Any], keywords: dict[str, Any]) -> Any:  # a jitted function
    def loss(q, k, v, mask):
        return jnp.sum(fn(q, k, v, mask, **keywords)[0])

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _profile(fn: Callable[..., Any], keywords: dict[str, Any], shapes: dict[str, Any],
             repeats: int) -> tuple[float, int]:
    """Median seconds and compiled temp bytes of the jitted forward+backward."""
    batch, heads = shapes.get("batch", 2), shapes.get("heads", 4)
    kv_heads = shapes.get("kv_heads", heads)
    sq, sk, dim = shapes["q_seq_len"], shapes["k_seq_len"], shapes.get("dim", 64)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (batch, heads, sq, dim))
    k = jax.random.normal(keys[1], (batch, kv_heads, sk, dim))
    v = jax.random.normal(keys[2], (batch, kv_heads, sk, dim))
    mask = jnp.ones((batch, sk), bool)
    grad = _loss(fn, keywords)
    compiled = grad.lower(q, k, v, mask).compile()
    memory = compiled.memory_analysis()
    temp = int(memory.temp_size_in_bytes) if memory is not None else -1
    jax.block_until_ready(compiled(q, k, v, mask))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v, mask))
        times.append(time.perf_counter() - start)
    return statistics.median(times), temp


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eqx_flash", description=__doc__)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per method")
    args = parser.parse_args(argv)
    print(f"eqx_flash sanity check on {jax.devices()[0].platform}: flash_attention vs "
          f"plain_attention, float32, tolerances out {OUT_TOLERANCE:g}, grads {GRAD_TOLERANCE:g}")
    rows = []
    failed = False
    for i, (name, shapes, keywords) in enumerate(CONFIGS, 1):
        print(f"[{i}/{len(CONFIGS)}] {name}: comparing ...", end="", flush=True)
        out_diff, grad_diffs = value_and_grad_difference(
            plain_attention, flash_attention, **shapes, **keywords
        )
        diffs = [float(out_diff), *(float(d) for d in grad_diffs)]
        ok = diffs[0] <= OUT_TOLERANCE and max(diffs[1:]) <= GRAD_TOLERANCE
        failed |= not ok
        print(" timing ...", end="", flush=True)
        t_flash, m_flash = _profile(flash_attention, keywords, shapes, args.repeats)
        t_plain, m_plain = _profile(plain_attention, keywords, shapes, args.repeats)
        print(" done")
        rows.append((name, *diffs, t_flash, t_plain, m_flash, m_plain, ok))

    header = (f"{'configuration':<30} {'out':>8} {'dq':>8} {'dk':>8} {'dv':>8} "
              f"{'flash ms':>9} {'plain ms':>9} {'flash MiB':>10} {'plain MiB':>10}  ok")
    print()
    print(header)
    print("-" * len(header))
    for name, o, dq, dk, dv, tf, tp, mf, mp, ok in rows:
        print(f"{name:<30} {o:8.1e} {dq:8.1e} {dk:8.1e} {dv:8.1e} {tf * 1e3:9.1f} "
              f"{tp * 1e3:9.1f} {mf / 2**20:10.1f} {mp / 2**20:10.1f}  {'yes' if ok else 'NO'}")
    print("\ntimes: median jitted forward+backward; memory: XLA's compiled temporary buffers.")
    if failed:
        print("FAILED: a difference exceeds its tolerance", file=sys.stderr)
        return 1
    print("all differences within tolerance")
    return 0


if __name__ == "__main__":
    sys.exit(main())
