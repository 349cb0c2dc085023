"""One benchmark measurement in a fresh process, so peak RSS belongs to it alone.

`python benchmarks/_worker.py '<json spec>'` prints one JSON line: compile time, run times
and peak resident memory (`ru_maxrss`) of this process.
"""

import json
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def _plain_xla(q, k, v, causal, **_):
    t = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731  (B, H, S, D) <-> (B, S, H, D)
    return t(jax.nn.dot_product_attention(t(q), t(k), t(v), is_causal=causal,
                                          implementation="xla"))


def _seed(q, k, v, causal, **_):
    import flash_attention_jax as seed

    if causal:
        return seed.causal_flash_attention(q, k, v)
    return seed.flash_attention(q, k, v, jnp.ones((q.shape[0], k.shape[2]), bool))


def _ours(q, k, v, causal, window=None, segments=0, block_q=None, block_k=None):
    from eqx_flash import flash_attention

    kw = {}
    if segments:
        ids = (jnp.arange(q.shape[2]) * segments // q.shape[2]).astype(jnp.int32)
        kw = dict(q_segment_ids=ids[None], kv_segment_ids=ids[None])
    return flash_attention(q, k, v, causal=causal, window=window, block_q=block_q,
                           block_k=block_k, **kw)[0]


METHODS = {"eqx_flash": _ours, "plain_xla": _plain_xla, "seed": _seed}


def _matmul(spec):
    n = spec["seq"]
    a = jax.random.normal(jax.random.key(0), (n, n), spec["dtype"])
    f = jax.jit(lambda a, b: a @ b)
    return f, (a, a), 2.0 * n**3


def _attention(spec):
    dtype = jnp.dtype(spec["dtype"])
    b, h, kvh, s, d = spec["batch"], spec["heads"], spec["kv_heads"], spec["seq"], spec["dim"]
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (b, h, s, d), dtype)
    k = jax.random.normal(kk, (b, kvh, s, d), dtype)
    v = jax.random.normal(kv, (b, kvh, s, d), dtype)
    fn = METHODS[spec["method"]]
    kw = {key: spec[key] for key in ("window", "segments", "block_q", "block_k") if key in spec}
    window = kw.get("window")
    if isinstance(window, list):
        kw["window"] = tuple(window)

    def attend(q, k, v):
        return fn(q, k, v, spec["causal"], **kw)

    if spec["mode"] == "fwd":
        f = jax.jit(attend)
    else:
        f = jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(),
                             argnums=(0, 1, 2)))
    return f, (q, k, v), None


def main(spec):
    f, args, flops = (_matmul if spec["method"] == "matmul" else _attention)(spec)
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    compile_s = time.perf_counter() - t0
    times = []
    deadline = time.perf_counter() + spec.get("max_seconds", 1e9)
    for _ in range(spec["reps"]):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
        if time.perf_counter() > deadline:
            break
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return dict(spec, compile_s=compile_s, times=times, median_s=float(np.median(times)),
                best_s=float(np.min(times)), peak_rss_bytes=rss, flops=flops)


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
