"""Tuning the Pallas TPU kernels on a TPU: correctness against the XLA kernels, block
sizes and implementation choices against splash attention, and the XLA kernels' blocks.

    python benchmarks/tune_pallas.py correctness tune xla_sweep     # on a TPU, ~7 min

Parts (each writes a JSON file under $OUT, default /tmp):

- `correctness`: the Pallas forward and backward against the XLA kernels at matmul
  precision "highest" (f32 and bf16, causal/window/softcap, GQA, head dim 64, segment
  ids, lengths, a key mask with a NaN value): max differences, NaN/inf patterns.
- `tune`: bf16, 16 heads of dim 128, 16k tokens per batch, seq `SEQS` (default 4096
  16384), causal and not: the Pallas kernels at several blocks and `Tuning` variants
  (base 2 or natural exponentials, fused or two-kernel backward, queries pre-scaled,
  keys computed in slices), against splash attention at 1024 blocks; medians of
  `ROUNDS` interleaved rounds, TFLOP/s (4 B H S^2 D forward, x3.5 forward+backward,
  halved causal). `BUDGET` seconds bound the compiling.
- `xla_sweep`: eqx_flash's pure-JAX kernels at explicit blocks (`XBLOCKS`) on seq
  `XSEQS`, forward and forward+backward, for their accelerator block policy.
- `bench`: an earlier, plainer comparison (Pallas blocks against splash 512/1024).

The results and the decisions taken from them: `benchmarks/tune_pallas.md`. The kernels
are called directly on padded internal-layout arrays (no public API around them), so the
times are the kernels' own.
"""
import functools, json, os, sys, time, traceback
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import jax, jax.numpy as jnp, numpy as np
from eqx_flash._core.config import KernelConfig
from eqx_flash._core.options import Window
from eqx_flash._core.operands import Operands
from eqx_flash._core.operands import differentiable_part
from eqx_flash._kernels.xla.forward import forward as xf
from eqx_flash._kernels.xla.backward import backward as xb
from eqx_flash._semantics.softmax import backward_statistics
from eqx_flash._kernels.pallas_tpu.forward import forward as pf
from eqx_flash._kernels.pallas_tpu.backward import backward as pb
from eqx_flash._kernels.pallas_tpu._tile import Tuning
from _interleave import interleaved_medians

OUT = os.environ.get("OUT", "/tmp")

def cfg_of(sq, sk, bq, bk, causal, d, softcap=None, window=None):
    w = Window(None, 0) if causal else Window(None, None)
    if window: w = Window(*window)
    return KernelConfig(seq_q=sq, seq_k=sk, block_q=bq, block_k=bk, window=w, scale=1/np.sqrt(d), softcap=softcap)

def inputs(b, h, g, sq, sk, d, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b,h,g,sq,d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b,h,sk,d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b,h,sk,d), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (b,h,g,sq,d), jnp.float32).astype(dtype)
    return q, k, v, do

def both(fwd, bwd, cfg, ops):
    def f(q, k, v, do):
        out, lse, mx = fwd(cfg, q, k, v, ops)
        slse, delta = backward_statistics(out, lse, do, jnp.zeros_like(lse))
        wanted = jax.tree.map(lambda _: False, differentiable_part(ops))
        dq, dk, dv, _ = bwd(cfg, q, k, v, ops, slse, delta, do, wanted)
        return out, lse, mx, dq, dk, dv
    return jax.jit(f)

def correctness():
    results = []
    cases = [
        dict(name="causal bf16 4k", b=1,h=2,g=1,sq=4096,sk=4096,d=128,bq=512,bk=512,causal=True,dtype=jnp.bfloat16),
        dict(name="full f32 2k", b=2,h=2,g=1,sq=2048,sk=2048,d=128,bq=512,bk=1024,causal=False,dtype=jnp.float32),
        dict(name="causal f32 1k bq1024", b=1,h=2,g=1,sq=1024,sk=1024,d=128,bq=1024,bk=512,causal=True,dtype=jnp.float32),
        dict(name="gqa4 causal f32", b=1,h=2,g=4,sq=1024,sk=1024,d=128,bq=256,bk=512,causal=True,dtype=jnp.float32),
        dict(name="d64 causal f32", b=1,h=2,g=1,sq=1024,sk=1536,d=64,bq=512,bk=512,causal=True,dtype=jnp.float32),
        dict(name="window softcap f32", b=1,h=2,g=1,sq=2048,sk=2048,d=128,bq=512,bk=512,causal=False,window=(700,100),softcap=20.0,dtype=jnp.float32),
        dict(name="segments f32", b=2,h=2,g=1,sq=1024,sk=1024,d=128,bq=256,bk=512,causal=True,dtype=jnp.float32, ops="segments"),
        dict(name="lengths f32", b=2,h=2,g=1,sq=1024,sk=1024,d=128,bq=256,bk=512,causal=True,dtype=jnp.float32, ops="lengths"),
        dict(name="keymask nan-v f32", b=2,h=2,g=1,sq=1024,sk=1024,d=128,bq=256,bk=512,causal=True,dtype=jnp.float32, ops="keymask", nan=True),
    ]
    only = os.environ.get("CASES")
    for c in cases:
        if only and not any(o in c["name"] for o in only.split(",")): continue
        try:
            cfg = cfg_of(c["sq"], c["sk"], c["bq"], c["bk"], c["causal"], c["d"], c.get("softcap"), c.get("window"))
            q, k, v, do = inputs(c["b"], c["h"], c["g"], c["sq"], c["sk"], c["d"], c["dtype"])
            if c.get("nan"): v = v.at[0, 0, 300, 5].set(jnp.nan)
            b, sq, sk = c["b"], c["sq"], c["sk"]
            ops = Operands()
            if c.get("ops") == "segments":
                ids = jnp.sort(jax.random.randint(jax.random.key(3), (b, sq), 0, 4), -1).astype(jnp.int32)
                ops = Operands(q_segment_ids=ids[:, None, None, :, None], kv_segment_ids=ids[:, None, None, None, :])
            if c.get("ops") == "lengths":
                ops = Operands(q_lengths=jnp.array([sq, 300], jnp.int32).reshape(2,1,1,1,1), kv_lengths=jnp.array([sk, 500], jnp.int32).reshape(2,1,1,1,1))
            if c.get("ops") == "keymask":
                ops = Operands(key_mask=jax.random.bernoulli(jax.random.key(5), 0.8, (b,1,1,1,sk)))
            with jax.default_matmul_precision("highest"):
                t = time.time()
                rp = both(pf, pb, cfg, ops)(q, k, v, do)
                jax.block_until_ready(rp); tp = time.time() - t
                rx = both(xf, xb, cfg, ops)(q, k, v, do)
            names = ["out", "lse", "max", "dq", "dk", "dv"]
            errs = {}
            for n, a, bb in zip(names, rp, rx):
                a = np.asarray(a.astype(jnp.float32)); bb = np.asarray(bb.astype(jnp.float32))
                same_nan = bool(np.array_equal(np.isnan(a), np.isnan(bb)))
                same_inf = bool(np.array_equal(np.isinf(a), np.isinf(bb)))
                fin = np.isfinite(a) & np.isfinite(bb)
                errs[n] = (float(np.max(np.abs(a[fin]-bb[fin]), initial=0)), float(np.max(np.abs(bb[fin]), initial=0)), same_nan, same_inf)
            print(c["name"], f"compile+run {tp:.1f}s", {n: "%.1e/%.1e nan%s inf%s" % e for n, e in errs.items()}, flush=True)
            results.append(dict(name=c["name"], errs=errs, seconds=tp))
        except Exception as e:
            print(c["name"], "FAILED", type(e).__name__, str(e)[:3000], flush=True)
            results.append(dict(name=c["name"], error=str(e)[:3000]))
    json.dump(results, open(os.path.join(OUT, "correctness.json"), "w"), indent=1)

def splash_fns(h, seq, causal, block, dtype):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk, splash_attention_mask as sm
    m = sm.CausalMask((seq, seq)) if causal else sm.FullMask((seq, seq))
    mask = sm.MultiHeadMask([m] * h)
    bs = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block, block_kv_dkv=block,
                       block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    kern = sk.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=bs)
    return jax.vmap(kern)

def bench():
    seqs = [int(s) for s in os.environ.get("SEQS", "4096 16384").split()]
    configs = os.environ.get("BLOCKS", "512x512 1024x512 1024x1024 2048x512").split()
    rounds = int(os.environ.get("ROUNDS", "5"))
    h, d, dtype = 16, 128, jnp.bfloat16
    calls, meta = {}, {}
    for seq in seqs:
        b = 16384 // seq
        q4, k4, v4, do4 = inputs(b, h, 1, seq, seq, d, dtype)
        for causal in (False, True):
            flops = 4.0 * b * h * seq * seq * d * (0.5 if causal else 1)
            for blk in configs:
                bq, bk = map(int, blk.split("x"))
                if bq > seq or bk > seq: continue
                cfg = cfg_of(seq, seq, bq, bk, causal, d)
                ops = Operands()
                fwd = jax.jit(lambda q, k, v, cfg=cfg: pf(cfg, q, k, v, ops)[0])
                fb = both(pf, pb, cfg, ops)
                for mode, fn, mult in (("fwd", fwd, 1.0), ("fwd+bwd", fb, 3.5)):
                    name = f"pallas {blk} seq{seq} causal{causal} {mode}"
                    try:
                        args = (q4, k4, v4) if mode == "fwd" else (q4, k4, v4, do4)
                        c = fn.lower(*args).compile()
                        jax.block_until_ready(c(*args))
                        calls[name] = functools.partial(c, *args); meta[name] = flops * mult
                    except Exception as e:
                        print(name, "FAILED", type(e).__name__, str(e)[:1500], flush=True)
            q3, k3, v3 = (x[:, :, 0] if x.ndim == 5 else x for x in (q4, k4, v4))
            for block in (512, 1024):
                if block > seq: continue
                try:
                    sp = splash_fns(h, seq, causal, block, dtype)
                    fwd = jax.jit(sp)
                    fb = jax.jit(jax.grad(lambda q, k, v: jnp.sum(sp(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))
                    for mode, fn, mult in (("fwd", fwd, 1.0), ("fwd+bwd", fb, 3.5)):
                        name = f"splash {block} seq{seq} causal{causal} {mode}"
                        c = fn.lower(q3, k3, v3).compile(); jax.block_until_ready(c(q3, k3, v3))
                        calls[name] = functools.partial(c, q3, k3, v3); meta[name] = flops * mult
                except Exception as e:
                    print("splash", block, seq, causal, "FAILED", type(e).__name__, str(e)[:500], flush=True)
    print("compiled", len(calls), flush=True)
    med = interleaved_medians(calls, rounds, jax.block_until_ready, warm_up=False)
    rows = []
    for name in calls:
        rows.append(dict(name=name, ms=med[name]*1e3, tflops=meta[name]/med[name]/1e12))
        print(f"{name:45s} {med[name]*1e3:9.3f} ms {meta[name]/med[name]/1e12:7.1f} TFLOP/s", flush=True)
    json.dump(rows, open(os.path.join(OUT, "bench.json"), "w"), indent=1)

def timed(calls, meta, rows_out, name_out):
    rounds = int(os.environ.get("ROUNDS", "5"))
    print("compiled", len(calls), flush=True)
    med = interleaved_medians(calls, rounds, jax.block_until_ready, warm_up=False)
    rows = []
    for name in calls:
        rows.append(dict(name=name, ms=med[name]*1e3, tflops=meta[name]/med[name]/1e12))
        print(f"{name:60s} {med[name]*1e3:9.3f} ms {meta[name]/med[name]/1e12:7.1f} TFLOP/s", flush=True)
    json.dump(rows, open(os.path.join(OUT, name_out), "w"), indent=1)

def add(calls, meta, name, fn, args, flops, budget):
    if time.time() > budget:
        print("SKIPPED (time budget)", name, flush=True); return
    try:
        c = fn.lower(*args).compile(); jax.block_until_ready(c(*args))
        calls[name] = functools.partial(c, *args); meta[name] = flops
    except Exception as e:
        print(name, "FAILED", type(e).__name__, str(e)[:800], flush=True)

# (The 2026-12-06 measurements in tune_pallas.md ran these, before slices became the
# default: "default" is what the family runs now.)
VARIANTS = {
    "default": Tuning(),
    "base2 fused": Tuning(chunk=None),
    "natural": Tuning(base2=False, chunk=None),
    "unfused": Tuning(fused_backward=False, chunk=None),
    "prescale": Tuning(prescale=True, chunk=None),
    "chunk256": Tuning(chunk=256, chunk_banded_backward=True),
    "whole rows": Tuning(partial_rows=None),
    "rows512": Tuning(partial_rows=512),
}
# `PLANS="1024x1024:default,2048x1024:whole rows"`: blocks and variant per kernel timed; a
# variant not named above is `Tuning` fields, e.g. "chunk=512/partial_rows=None".
def variant(name):
    if name in VARIANTS: return VARIANTS[name]
    fields = {}
    for item in name.split("/"):
        key, value = item.split("=")
        fields[key] = None if value == "None" else (value == "True" if value in ("True", "False") else int(value))
    return Tuning(**fields)

DEFAULT_PLANS = ("1024x512:base2 fused,1024x1024:base2 fused,2048x512:base2 fused,"
                 "2048x1024:base2 fused,1024x1024:natural,1024x1024:unfused,"
                 "1024x1024:prescale,1024x2048:chunk256,2048x1024:chunk256")

def tune():
    budget = time.time() + float(os.environ.get("BUDGET", "200"))
    seqs = [int(s) for s in os.environ.get("SEQS", "4096 16384").split()]
    h, d, dtype = 16, 128, jnp.bfloat16
    calls, meta = {}, {}
    for seq in seqs:
        b = 16384 // seq
        q4, k4, v4, do4 = inputs(b, h, 1, seq, seq, d, dtype)
        for causal in [bool(int(c)) for c in os.environ.get("CAUSAL", "0 1").split()]:
            flops = 4.0 * b * h * seq * seq * d * (0.5 if causal else 1)
            plans = [tuple(p.split(":")) for p in os.environ.get("PLANS", DEFAULT_PLANS).split(",")]
            for blk, var in plans:
                bq, bk = map(int, blk.split("x"))
                if bq > seq or bk > seq: continue
                cfg = cfg_of(seq, seq, bq, bk, causal, d); ops = Operands(); tun = variant(var)
                fwd = jax.jit(lambda q, k, v, cfg=cfg, tun=tun: pf(cfg, q, k, v, ops, tun)[0])
                fb = both(functools.partial(pf, tuning=tun), functools.partial(pb, tuning=tun), cfg, ops)
                add(calls, meta, f"pallas {blk} {var} seq{seq} c{int(causal)} fwd", fwd, (q4, k4, v4), flops, budget)
                add(calls, meta, f"pallas {blk} {var} seq{seq} c{int(causal)} fwd+bwd", fb, (q4, k4, v4, do4), flops * 3.5, budget)
            q3, k3, v3 = (x[:, :, 0] if x.ndim == 5 else x for x in (q4, k4, v4))
            sp = splash_fns(h, seq, causal, 1024, dtype)
            add(calls, meta, f"splash 1024 seq{seq} c{int(causal)} fwd", jax.jit(sp), (q3, k3, v3), flops, budget)
            add(calls, meta, f"splash 1024 seq{seq} c{int(causal)} fwd+bwd",
                jax.jit(jax.grad(lambda q, k, v: jnp.sum(sp(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))),
                (q3, k3, v3), flops * 3.5, budget)
    timed(calls, meta, None, "tune.json")

def xla_sweep():
    import eqx_flash as ef
    budget = time.time() + float(os.environ.get("BUDGET", "200"))
    seqs = [int(s) for s in os.environ.get("XSEQS", "1024 4096 16384").split()]
    blocks = os.environ.get("XBLOCKS", "128x256 256x256 256x512 512x512 512x1024 1024x1024").split()
    h, d, dtype = 16, 128, jnp.bfloat16
    calls, meta = {}, {}
    for seq in seqs:
        b = 16384 // seq
        ks = jax.random.split(jax.random.key(seq), 3)
        q, k, v = (jax.random.normal(kk, (b, h, seq, d), dtype) for kk in ks)
        for causal in ((False, True) if seq == 4096 else (False,)):
            flops = 4.0 * b * h * seq * seq * d * (0.5 if causal else 1)
            for blk in blocks:
                bq, bk = map(int, blk.split("x"))
                f = lambda q, k, v, bq=bq, bk=bk: ef.flash_attention(q, k, v, causal=causal, block_q=bq, block_k=bk)[0]
                add(calls, meta, f"xla {blk} seq{seq} c{int(causal)} fwd", jax.jit(f), (q, k, v), flops, budget)
                g = jax.jit(jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))
                add(calls, meta, f"xla {blk} seq{seq} c{int(causal)} fwd+bwd", g, (q, k, v), flops * 3.5, budget)
    timed(calls, meta, None, "xla_sweep.json")

if __name__ == "__main__":
    for part in sys.argv[1:]:
        t = time.time()
        {"correctness": correctness, "bench": bench, "tune": tune, "xla_sweep": xla_sweep}[part]()
        print(part, "took", time.time() - t, flush=True)
