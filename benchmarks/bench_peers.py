"""eqx_flash against the JAX attention libraries that install, side by side in one process.

    pip install -e ".[bench]"   # adds the peers that install for this Python
    python benchmarks/bench_peers.py [--seq 4096] [--rounds 7] [--memory-seq 16384]
        [--out benchmarks/peers_results.md] [--records runs.json] [--plot peers.png]
    python benchmarks/bench_peers.py --replot benchmarks/peers_results.json  # no measuring

`--records` saves the run as JSON records (`_peers_records.py`), `--plot` draws them:
time per implementation and mode, and compiled memory. `--replot JSON` redraws a plot
from saved records (to `--plot`, default `docs/perf_peers.png`, the performance guide's),
and `--from-markdown MD` reads records from a results file's tables instead (how
`benchmarks/peers_results.json` was made from `peers_results.md`, which holds runs from
before the records existed).

Peers (each skipped, and said so, when it does not import): `jax.nn.dot_product_attention`
(`implementation="xla"`), tokamax `dot_product_attention` with `implementation="xla"` and
`"xla_chunked"`, attnax `standard_attention` (dense) and `flash_attention` (blocked jnp on
CPU), and the seed, `flash-attention-jax`. Each is first checked against
`eqx_flash.plain_attention` (values and gradients) on a small problem, then every call is
timed in shuffled interleaved rounds (each timed call right after an untimed one of its
own, so that no call pays for the memory its predecessor freed); the "peak" the
fractions are of is the rate of a warm 2048^3 float32 matmul measured in the same
process (`matmul_peak`). The last column is the compiled temporary memory of the causal
forward+backward at `--memory-seq` (XLA's `memory_analysis()`; compiled, not run).

FLOP counts: 4 * seq^2 * dim per head for the forward (two block products), 3.5x that for
forward+backward (eqx_flash recomputes the logits: 7 products); causal counts half.
A last table times eqx_flash alone (fwd, fwd+bwd, jvp at `--seq` and twice it) in rounds
interleaved with the matmul, no peer between them: its fractions of the peak are the
kernels' own (a jvp counted as 6 products, 3 forwards).
"""

import importlib.metadata
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import _peers_records
import jax
import jax.numpy as jnp
from _interleave import interleaved_medians, problem_arguments

import eqx_flash

Attend = Callable[[jax.Array, jax.Array, jax.Array, bool], jax.Array]  # (b, h, s, d) -> out
DEFAULT_PLOT = Path(__file__).resolve().parent.parent / "docs" / "perf_peers.png"


def _eqx_flash(q, k, v, causal):
    return eqx_flash.flash_attention(q, k, v, causal=causal)[0]


def _bthd(fn):
    """A peer that takes `(batch, seq, heads, dim)`, in eqx_flash's layout."""
    def attend(q, k, v, causal):
        q, k, v = (x.swapaxes(1, 2) for x in (q, k, v))
        return fn(q, k, v, causal).swapaxes(1, 2)
    return attend


def _causal_mask(seq: int) -> jax.Array:
    return jnp.tril(jnp.ones((seq, seq), bool))[None, None]


def peers() -> tuple[dict[str, Attend], dict[str, str]]:
    """`({name: attend}, {name: why it is missing})`."""
    found: dict[str, Attend] = {
        "eqx_flash": _eqx_flash,
        "jax.nn xla": _bthd(lambda q, k, v, c: jax.nn.dot_product_attention(
            q, k, v, is_causal=c, implementation="xla")),
    }
    missing: dict[str, str] = {}
    try:
        import tokamax

        for impl in ("xla", "xla_chunked"):
            found[f"tokamax {impl}"] = _bthd(lambda q, k, v, c, impl=impl:
                                             tokamax.dot_product_attention(
                                                 q, k, v, is_causal=c, implementation=impl))
    except ImportError as e:
        missing["tokamax"] = str(e)
    try:
        import attnax

        def attnax_fn(fn):
            def attend(q, k, v, causal):
                mask = _causal_mask(q.shape[-2]) if causal else None
                return fn(q, k, v, mask=mask)
            return attend

        found["attnax standard_attention"] = attnax_fn(attnax.standard_attention)
        found["attnax flash_attention"] = attnax_fn(attnax.flash_attention)
    except ImportError as e:
        missing["attnax"] = str(e)
    try:
        import flash_attention_jax as seed

        def seed_attend(q, k, v, causal):
            if causal:
                return seed.causal_flash_attention(q, k, v)
            mask = jnp.ones((q.shape[0], k.shape[-2]), bool)
            return seed.flash_attention(q, k, v, mask)

        found["seed (flash-attention-jax)"] = seed_attend
    except ImportError as e:
        missing["seed (flash-attention-jax)"] = str(e)
    return found, missing


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _loss(attend: Attend, causal: bool):
    return lambda q, k, v: jnp.sum(attend(q, k, v, causal))


def _reference(q, k, v, causal):
    return eqx_flash.plain_attention(q, k, v, causal=causal)[0]


def check_against_reference(name: str, attend: Attend) -> str | None:
    """None if `attend` matches `plain_attention` (values and gradients), else why not."""
    shape = (1, 2, 256, 32)
    q, k, v = (jax.random.normal(jax.random.key(i), shape) for i in range(3))
    for causal in (False, True):
        want = _reference(q, k, v, causal)
        got = jax.jit(attend, static_argnums=3)(q, k, v, causal)
        ref_grad = jax.grad(_loss(_reference, causal), argnums=(0, 1, 2))(q, k, v)
        grad = jax.jit(jax.grad(_loss(attend, causal), argnums=(0, 1, 2)))(q, k, v)
        errors = [float(jnp.max(jnp.abs(got - want)))]
        errors += [float(jnp.max(jnp.abs(a - b))) for a, b in zip(grad, ref_grad, strict=True)]
        if max(errors) > 2e-4:
            return f"{name} causal={causal} differs from plain_attention by {max(errors):.2e}"
    return None


def compiled_temp_mib(attend: Attend, seq: int, heads: int, dim: int) -> float:
    x = jax.ShapeDtypeStruct((1, heads, seq, dim), jnp.float32)
    fn = jax.jit(jax.grad(_loss(attend, True), argnums=(0, 1, 2)))
    analysis = fn.lower(x, x, x).compile().memory_analysis()
    return float("nan") if analysis is None else analysis.temp_size_in_bytes / 2**20


def matmul_peak(n: int = 2048, repeats: int = 15) -> float:
    """FLOP/s of a warm `n`^3 float32 matmul on normal random operands, the median of
    `repeats` back-to-back calls. Timed apart from the interleaved rounds: there it runs
    with caches the peers' multi-GiB programs just flushed, which measured up to 1.4x
    below this and put eqx_flash above "peak"."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    matmul = jax.jit(lambda a: a @ a)
    calls = {"matmul": lambda: matmul(a)}
    return 2 * n**3 / interleaved_medians(calls, repeats, jax.block_until_ready)["matmul"]


def own_fractions(seq: int, heads: int, dim: int, rounds: int) -> list[str]:
    """eqx_flash's fwd, fwd+bwd and jvp at `seq` and `2 * seq` (full attention), each
    against the matmul timed in the same interleaved rounds, with no multi-GiB peer in
    between: the kernels' own efficiency, as markdown lines."""
    calls: dict[str, Callable[[], object]] = {}
    a = jax.random.normal(jax.random.key(0), (2048, 2048), jnp.float32)
    matmul = jax.jit(lambda a: a @ a)
    calls["matmul"] = lambda: matmul(a)
    for n in (seq, 2 * seq):
        x = [jax.random.normal(jax.random.key(i), (1, heads, n, dim)) for i in range(6)]
        fwd = jax.jit(lambda q, k, v: _eqx_flash(q, k, v, False))
        grad = jax.jit(jax.grad(_loss(_eqx_flash, False), argnums=(0, 1, 2)))
        jvp = jax.jit(lambda q, k, v, *t: jax.jvp(lambda *a: _eqx_flash(*a, False),
                                                   (q, k, v), t))
        calls[f"fwd|{n}"] = lambda f=fwd, x=x: f(*x[:3])
        calls[f"fwd+bwd|{n}"] = lambda f=grad, x=x: f(*x[:3])
        calls[f"jvp|{n}"] = lambda f=jvp, x=x: f(*x)
    medians = interleaved_medians(calls, rounds, jax.block_until_ready, settle=1)
    peak = 2 * 2048**3 / medians["matmul"]
    lines = [f"eqx_flash alone, interleaved with the 2048^3 matmul ({peak / 1e9:.0f} "
             "GFLOP/s in these rounds), full attention:", "",
             "| seq | fwd | fwd+bwd | jvp | jvp / fwd |", "|---|---|---|---|---|"]
    for n in (seq, 2 * seq):
        fwd_flops = 4 * n**2 * dim * heads
        cells = []
        for mode, forwards in (("fwd", 1), ("fwd+bwd", 3.5), ("jvp", 3)):
            t = medians[f"{mode}|{n}"]
            cells.append(f"{t * 1e3:.0f} ms ({forwards * fwd_flops / t / peak:.2f} of peak)")
        ratio = medians[f"jvp|{n}"] / medians[f"fwd|{n}"]
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = problem_arguments(__doc__)
    p.add_argument("--memory-seq", type=int, default=16384,
                   help="seq of the compiled-memory column (causal fwd+bwd, not run)")
    p.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    p.add_argument("--records", type=Path, default=None,
                   help="write the run as JSON records here (with --from-markdown: those)")
    p.add_argument("--plot", type=Path, default=None,
                   help="draw the records' plot here (PNG; needs matplotlib)")
    p.add_argument("--replot", type=Path, default=None, metavar="JSON",
                   help="measure nothing: draw the plot of these saved records (to --plot, "
                   "default docs/perf_peers.png)")
    p.add_argument("--from-markdown", type=Path, default=None, metavar="MD",
                   help="measure nothing: read the records from this results file's tables")
    args = p.parse_args(argv)
    if args.replot is not None or args.from_markdown is not None:
        records = (_peers_records.load(args.replot) if args.replot is not None else
                   _peers_records.records_from_markdown(args.from_markdown.read_text()))
        if args.records is not None:
            _peers_records.save(records, args.records)
        plot = args.plot or (DEFAULT_PLOT if args.replot is not None else None)
        if plot is not None:
            _peers_records.plot(records, plot)
            print(f"wrote {plot}")
        return
    sys.argv = sys.argv[:1]  # tokamax parses absl flags from sys.argv on first use
    found, missing = peers()
    for name, attend in list(found.items()):
        why = check_against_reference(name, attend)
        if why is not None:
            print(f"skipping: {why}", flush=True)
            missing[name] = why
            del found[name]
    shape = (1, args.heads, args.seq, args.dim)
    q, k, v = (jax.random.normal(jax.random.key(i), shape) for i in range(3))
    modes = {"fwd": False, "fwd causal": True, "fwd+bwd": False, "fwd+bwd causal": True}
    calls: dict[str, Callable[[], object]] = {}
    for name, attend in found.items():
        for mode, causal in modes.items():
            if mode.startswith("fwd+bwd"):
                fn = jax.jit(jax.grad(_loss(attend, causal), argnums=(0, 1, 2)))
            else:
                fn = jax.jit(lambda q, k, v, a=attend, c=causal: a(q, k, v, c))
            calls[f"{name}|{mode}"] = lambda fn=fn: fn(q, k, v)
    # Each call settles with one untimed run first: the dense peers free and touch
    # gigabytes, which otherwise slows whatever runs next (eqx_flash's forward 1.5x).
    medians = interleaved_medians(calls, args.rounds, jax.block_until_ready, settle=1)
    peak = matmul_peak()
    forward_flops = 4 * args.seq**2 * args.dim * args.heads

    def flops(mode: str) -> float:
        return forward_flops * (3.5 if mode.startswith("fwd+bwd") else 1) * (
            0.5 if mode.endswith("causal") else 1)

    memory = {name: compiled_temp_mib(attend, args.memory_seq, args.heads, args.dim)
              for name, attend in found.items()}
    versions = {"jax": _version("jax"), "tokamax": _version("tokamax"),
                "attnax": _version("attnax"), "flash-attention-jax":
                _version("flash-attention-jax"), "eqx_flash": _version("eqx_flash")}
    lines = [
        f"Python {platform.python_version()}, "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
        + f"; {platform.machine()}, {jax.device_count()} {jax.default_backend()} device(s)",
        "",
        f"seq {args.seq}, batch 1, {args.heads} heads, dim {args.dim}, float32; medians of "
        f"{args.rounds} interleaved rounds; float32 matmul peak (2048^3, warm) in this run: "
        f"{peak / 1e9:.0f} GFLOP/s. Cells: ms (time / eqx_flash's time; for eqx_flash, the "
        "fraction of the matmul peak).",
        "",
        "| impl | " + " | ".join(modes) + f" | fwd+bwd causal temp at seq {args.memory_seq} |",
        "|---" * (len(modes) + 2) + "|",
    ]
    rows = []
    for name in found:
        cells = []
        rows.append({"impl": name, "ms": {m: medians[f"{name}|{m}"] * 1e3 for m in modes},
                     "temp_mib": memory[name]})
        for mode in modes:
            t = medians[f"{name}|{mode}"]
            ours = medians[f"eqx_flash|{mode}"]
            ratio = (f"{flops(mode) / t / peak:.2f} of peak" if name == "eqx_flash"
                     else f"{t / ours:.2f}x")
            cells.append(f"{t * 1e3:.0f} ({ratio})")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {memory[name]:.0f} MiB |")
    lines.append("")
    for mode in modes:
        others = [medians[f"{n}|{mode}"] for n in found if n != "eqx_flash"]
        if others:
            lines.append(f"- {mode}: fastest peer / eqx_flash = "
                         f"{min(others) / medians[f'eqx_flash|{mode}']:.2f}x")
    for name, why in missing.items():
        lines.append(f"- not measured: {name} ({why})")
    lines += ["", *own_fractions(args.seq, args.heads, args.dim, args.rounds)]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    records = {"runs": [{"section": time.strftime("%Y-%m-%d"), "title": "",
                         "environment": lines[0], "problem": lines[2],
                         "memory_seq": args.memory_seq, "rows": rows}]}
    if args.records is not None:
        _peers_records.save(records, args.records)
    if args.plot is not None:
        _peers_records.plot(records, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
