"""Benchmark eqx_flash against plain XLA attention and the seed (`flash-attention-jax`).

    python benchmarks/run.py            # full run: headline table + 1k..64k sweep + plots
    python benchmarks/run.py --quick    # a few minutes: smaller reps, sweep 1k..4k

Every measurement runs in its own subprocess (`_worker.py`) so its peak resident memory is
its own. Prints progress and a markdown table; a full run writes `benchmarks/results.json`,
`benchmarks/results.md` and the plots `docs/perf_time.png`, `docs/perf_memory.png` (the
tracked results); a `--quick` run writes the same files to `benchmarks/results/quick/`
(git-ignored), so it never overwrites them. `--out` and `--plots` choose other places.
"""

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
QUICK = ROOT / "benchmarks" / "results" / "quick"  # git-ignored
WORKER = ROOT / "benchmarks" / "_worker.py"
METHODS = ("eqx_flash", "plain_xla", "seed")


def measure(spec: dict, label: str, timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    print(f"  {label} ...", end="", flush=True)
    try:
        proc = subprocess.run([sys.executable, str(WORKER), json.dumps(spec)], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f" timed out after {timeout:.0f}s", flush=True)
        return dict(spec, error="timeout")
    if proc.returncode != 0:
        print(f" failed (rc {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}",
              flush=True)
        return dict(spec, error=proc.stderr[-2000:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f" {result['median_s'] * 1e3:9.1f} ms  {result['peak_rss_bytes'] / 2**20:7.0f} MiB"
          f"  ({time.perf_counter() - t0:.0f}s)", flush=True)
    return result


def attention_flops(r: dict) -> float:
    """Useful FLOPs: 4 sq sk d per head forward, 2.5x that more for the backward, counting
    only the pairs that attend (causal half, window band, within-document pairs)."""
    seq = r["seq"]
    if "window" in r:  # keys per query: the causal half of the window (a band)
        keys = min(seq, r["window"][0] + 1)
    elif "segments" in r:  # documents of equal length attend within themselves
        keys = seq / r["segments"]
    else:
        keys = seq / 2 if r["causal"] else seq
    f = 4.0 * seq * keys * r["dim"] * r["heads"] * r["batch"]
    return f * 3.5 if r["mode"] == "fwd+bwd" else f


def spec_of(args, **kw) -> dict:
    base = dict(batch=1, heads=args.heads, kv_heads=args.heads, seq=args.seq, dim=args.dim,
                dtype=args.dtype, causal=False, mode="fwd+bwd", reps=args.reps,
                max_seconds=args.max_seconds)
    base.update(kw)
    return base


def label_of(s: dict) -> str:
    extra = "".join(f" {k}={s[k]}" for k in ("window", "segments", "block_q", "block_k")
                    if k in s)
    heads = f"{s['heads']}/{s['kv_heads']}h" if s["heads"] != s["kv_heads"] else f"{s['heads']}h"
    return (f"{s['method']:<9} {s['mode']:<7} seq={s['seq']:<6} {heads:<5} {s['dtype']:<8}"
            f"{' causal' if s['causal'] else ''}{extra}")


def headline(args) -> tuple[list[dict], float]:
    print(f"== matmul peak ({args.dtype}, 2048^3)", flush=True)
    mm = measure(dict(method="matmul", seq=2048, dtype=args.dtype, reps=args.reps),
                 "matmul", args.timeout)
    peak = mm["flops"] / mm["best_s"]
    print(f"  -> {peak / 1e9:.1f} GFLOP/s", flush=True)
    s = args.seq
    plan = []
    for mode in ("fwd", "fwd+bwd"):
        for causal in (False, True):
            for method in METHODS:
                plan.append(spec_of(args, method=method, mode=mode, causal=causal))
    plan += [
        spec_of(args, method="eqx_flash", causal=True, window=[512, 0]),
        spec_of(args, method="eqx_flash", causal=True, window=[512, 0], seq=2 * s),
        spec_of(args, method="eqx_flash", segments=s // 512),
        spec_of(args, method="eqx_flash", segments=2 * s // 512, seq=2 * s),
        spec_of(args, method="eqx_flash", heads=8, kv_heads=8),
        spec_of(args, method="eqx_flash", heads=8, kv_heads=1),
        spec_of(args, method="eqx_flash", dtype="bfloat16"),
        spec_of(args, method="plain_xla", dtype="bfloat16"),
        spec_of(args, method="eqx_flash", causal=True, heads=1, kv_heads=1, seq=args.long_seq,
                reps=1),
    ]
    print(f"== headline comparisons ({len(plan)} configurations)", flush=True)
    results = []
    for i, spec in enumerate(plan):
        results.append(measure(spec, f"[{i + 1}/{len(plan)}] {label_of(spec)}", args.timeout))
    return [mm, *results], peak


def sweep(args) -> list[dict]:
    print(f"== sweep: fwd+bwd time and memory vs seq {args.sweep} ({args.sweep_heads} head)",
          flush=True)
    caps = {"eqx_flash": 1 << 30, "plain_xla": args.max_plain_seq, "seed": args.max_seed_seq}
    results = []
    for causal in (False, True):
        for method in METHODS:
            for seq in args.sweep:
                if seq > caps[method]:
                    print(f"  {method} seq={seq}: skipped (over --max-{method.split('_')[0]}"
                          "-seq)", flush=True)
                    continue
                spec = spec_of(args, method=method, causal=causal, seq=seq,
                               heads=args.sweep_heads, kv_heads=args.sweep_heads,
                               reps=args.sweep_reps)
                r = measure(spec, label_of(spec), args.timeout)
                results.append(r)
                if "error" in r or r["median_s"] > args.max_seconds:
                    print(f"  {method}: stopping its sweep here", flush=True)
                    break
    return results


def _find(results, **kw):
    for r in results:
        if "error" not in r and all(r.get(k) == v for k, v in kw.items()):
            keys = ("window", "segments")
            if all(k in kw or k not in r for k in keys):
                return r
    return None


def table(results: list[dict], peak: float, args) -> str:
    rows = ["| configuration | median ms | vs plain XLA | vs seed | GFLOP/s | of matmul peak "
            "| peak RSS MiB |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if r.get("method") == "matmul" or "error" in r:
            if "error" in r:
                rows.append(f"| {label_of(r)} | failed: {r['error'][:40]!r} | | | | | |")
            continue
        common = {k: r[k] for k in ("mode", "causal", "seq", "heads", "kv_heads", "dtype")}
        if "window" in r or "segments" in r:
            xla = seed = None
        else:
            xla, seed = _find(results, method="plain_xla", **common), _find(
                results, method="seed", **common)

        def ratio(o, r=r):
            return f"{o['median_s'] / r['median_s']:.2f}x" if o else ""

        flops = attention_flops(r) / r["median_s"]
        rows.append(
            f"| {label_of(r)} | {r['median_s'] * 1e3:.0f} | "
            f"{ratio(xla) if r['method'] != 'plain_xla' else ''} | "
            f"{ratio(seed) if r['method'] != 'seed' else ''} | {flops / 1e9:.1f} | "
            f"{flops / peak:.2f} | {r['peak_rss_bytes'] / 2**20:.0f} |"
        )
    lines = ["\n".join(rows), ""]
    nc = _find(results, method="eqx_flash", mode="fwd+bwd", causal=False, seq=args.seq,
               heads=args.heads, kv_heads=args.heads, dtype=args.dtype)
    c = _find(results, method="eqx_flash", mode="fwd+bwd", causal=True, seq=args.seq,
              heads=args.heads, kv_heads=args.heads, dtype=args.dtype)
    if nc and c:
        lines.append(f"causal vs non-causal fwd+bwd (eqx_flash): "
                     f"{nc['median_s'] / c['median_s']:.2f}x faster")
    lines.append(f"float32 matmul peak measured in this run: {peak / 1e9:.1f} GFLOP/s")
    return "\n".join(lines)


def plot(results: list[dict], out_dir: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"eqx_flash": "C0", "plain_xla": "C1", "seed": "C2"}
    for key, ylabel, name, scale in (
        ("median_s", "fwd+bwd time (s)", "perf_time.png", 1.0),
        ("peak_rss_bytes", "peak resident memory (MiB)", "perf_memory.png", 2.0**-20),
    ):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for method in METHODS:
            for causal in (False, True):
                pts = sorted((r["seq"], r[key] * scale) for r in results
                             if "error" not in r and r["method"] == method
                             and r["causal"] == causal)
                if pts:
                    xs, ys = zip(*pts, strict=True)
                    ax.plot(xs, ys, "o-" if not causal else "s--", color=colours[method],
                            label=f"{method}{' causal' if causal else ''}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(f"{ylabel.split(' (')[0]}, 1 head, dim 64, float32, CPU")
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        print(f"wrote {out_dir / name}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    """The options, with the defaults that depend on `--quick` filled in."""
    p = argparse.ArgumentParser(description="Benchmark eqx_flash against plain XLA and the seed.")
    p.add_argument("--quick", action="store_true", help="fewer reps, sweep 1k..4k")
    p.add_argument("--seq", type=int, default=4096, help="headline sequence length")
    p.add_argument("--heads", type=int, default=4, help="query heads of the headline runs")
    p.add_argument("--dim", type=int, default=64, help="head dim")
    p.add_argument("--dtype", default="float32", help="dtype of q, k and v")
    p.add_argument("--reps", type=int, default=None, help="timed runs per measurement")
    p.add_argument("--long-seq", type=int, default=None,
                   help="seq of the long causal memory check (default 65536, quick 16384)")
    p.add_argument("--sweep", type=int, nargs="*", default=None,
                   help="sweep sequence lengths (default 1024..65536, quick 1024..4096)")
    p.add_argument("--sweep-heads", type=int, default=1, help="heads in the sweep")
    p.add_argument("--sweep-reps", type=int, default=3, help="timed runs per sweep point")
    p.add_argument("--max-plain-seq", type=int, default=8192,
                   help="largest seq for plain XLA (it materialises seq^2 logits)")
    p.add_argument("--max-seed-seq", type=int, default=16384,
                   help="largest seq for the seed (flash-attention-jax)")
    p.add_argument("--max-seconds", type=float, default=60.0,
                   help="stop timing reps / growing a method's sweep past this")
    p.add_argument("--timeout", type=float, default=1800.0, help="per measurement")
    p.add_argument("--skip-sweep", action="store_true", help="only the headline table")
    p.add_argument("--sweep-only", action="store_true", help="no headline table, only plots")
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="results JSON (its .md beside it); default benchmarks/results.json, "
                   "with --quick benchmarks/results/quick/results.json")
    p.add_argument("--plots", type=pathlib.Path, default=None,
                   help="folder for perf_time.png and perf_memory.png; default docs/, with "
                   "--quick benchmarks/results/quick/")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = (QUICK if args.quick else ROOT / "benchmarks") / "results.json"
    if args.plots is None:
        args.plots = QUICK if args.quick else ROOT / "docs"
    args.reps = args.reps or (3 if args.quick else 7)
    args.long_seq = args.long_seq or (16384 if args.quick else 65536)
    if args.sweep is None:
        args.sweep = [1024, 2048, 4096] if args.quick else [1024 << i for i in range(7)]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.sweep_only:
        swept = sweep(args)
        args.plots.mkdir(parents=True, exist_ok=True)
        plot(swept, args.plots)
        args.out.with_name("sweep.json").write_text(json.dumps(swept, indent=1))
        return
    results, peak = headline(args)
    swept = [] if args.skip_sweep else sweep(args)
    text = table(results, peak, args)
    print("\n" + text)
    meta = dict(argv=sys.argv[1:], machine=platform.machine(), processor=platform.processor(),
                cpus=os.cpu_count(), python=platform.python_version(),
                matmul_flops_per_s=peak, wall_s=time.perf_counter() - t0)
    try:
        import jax

        meta.update(jax=jax.__version__, backend=jax.default_backend())
    except Exception:  # noqa: BLE001 - metadata only
        pass
    args.out.write_text(json.dumps(dict(meta=meta, headline=results, sweep=swept), indent=1))
    args.out.with_suffix(".md").write_text(text + "\n")
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    if swept:
        args.plots.mkdir(parents=True, exist_ok=True)
        plot(swept, args.plots)


if __name__ == "__main__":
    main()
