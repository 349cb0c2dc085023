"""eqx_flash against the TPU's own attention kernels, on the FlashAttention paper's grid.

    python benchmarks/bench_device.py [--preset quick|full|sweep] [--seqs 1024 4096 ...]
        [--modes fwd fwd+bwd jvp] [--causal both|yes|no] [--configs h16d128 h16d64 gqa32-8]
        [--impls SUBSTRING ...] [--features alibi dropout bias ...] [--rounds 5] [--blocks 512 1024 2048]
        [--time-budget S]
        [--json out.json] [--markdown out.md] [--plot out.png]
    python benchmarks/bench_device.py --replot out.json [--plot out.png]   # no device needed
    python benchmarks/bench_device.py --sweep-xla-blocks [--sweep-blocks 256 512 1024 2048]

The grid: 16k tokens per batch (`--tokens`; batch = tokens // seq), bfloat16 (`--dtype`),
each `--configs` entry `h{heads}d{dim}` or `gqa{heads}-{kv_heads}[d{dim}]` (head dim 128
unless given), sequence lengths `--seqs`, causal and not, modes fwd, fwd+bwd (gradients of
q, k, v) and jvp (tangents along q, k, v). Implementations (`--impls` keeps those whose
name contains one of the given substrings):

- `eqx_flash`: `eqx_flash.flash_attention` at its default kernels and blocks; if it takes
  `kernels=`, one more row per kernel family (`eqx_flash[xla]`, ...); with `--features`,
  one more per family and feature (`eqx_flash[pallas_tpu]+alibi`: ALiBi's standard
  slopes, constants; `+dropout`: rate 0.1; `+bias`: a bias per head and pair, bf16,
  trained: fwd+bwd takes its gradient; `+softcap`: `softcap=30`; `+softcap_mod`: the
  same cap written as a `score_mod`; `+window_mod`: a causal window of 1024 keys as a
  `mask_mod`; `+doc_mod`: documents of 1024 tokens as a `mask_mod`, at 1024 x 1024 blocks,
  1 - 1024 / seq of the block pairs empty; `+doc_ids`: the same documents read from an
  array of ids; `+t5`: T5's `RelativePositionBias`, trained: fwd+bwd takes its table's
  gradient), for what the feature costs (a mask_mod's block
  summary drives the kernels' plan: the blocks it empties cost nothing).
- `pallas flash bN`: `jax.experimental.pallas.ops.tpu.flash_attention` with every block
  size N of `--blocks` (k and v repeated to the query heads for GQA: it has none).
- `splash bN`: `splash_attention.make_splash_mha` (a `CausalMask` or `FullMask` per head,
  the kernel built outside any trace, vmapped over the batch, q pre-scaled).
- `tokamax`: `tokamax.dot_product_attention` (its own choice of implementation), where it
  imports.
- `jax.nn xla`: `jax.nn.dot_product_attention(implementation="xla")`; on a GPU also
  `jax.nn cudnn`.

The Pallas kernels and tokamax run only on a TPU (elsewhere a line says why they were
skipped); they have no forward mode, so their jvp cells report that. Each cell reports the
median time over `--rounds` shuffled interleaved rounds (`_interleave.py`; the cells of one
(config, seq) are interleaved together with a big matmul), TFLOP/s counted as
4·B·H·S²·D for the forward (H the query heads), ×3.5 for fwd+bwd, ×2.5 for jvp, halved
when causal; the fraction of the chip's bf16 peak (a small table by device kind, omitted
for unknown devices); the fraction of the rate of an `--matmul`³ matmul in the same dtype
timed in the same rounds; and XLA's compiled temporary memory. A cell that fails (out of
memory, unsupported) prints a short error and the run goes on. Cells not compiled when
`--time-budget` seconds have passed are listed as skipped.

Presets (explicit options override them), with their cost on a TPU v5e, where each program
compiles in a few seconds:

- `quick` (default): h16d128, seqs 4096, 1024, 16384 (in that order), causal and not, all
  modes, blocks 512 and 1024: 84 programs (the peers' jvp cells fail at once), about 5-6
  minutes; budget 330 s. A kernel family adds 18 more: `--impls` trims.
- `full`: h16d128, h16d64, gqa32-8, seqs 1k-16k, blocks 512/1024/2048: ~500 programs,
  several 10-minute calls — split it with `--configs`/`--seqs`; budget 540 s per call.
- `sweep`: `--sweep-xla-blocks` over h16d128, seqs 4096, 1024, 16384, causal and not, fwd
  and fwd+bwd, block pairs block_q <= block_k from 256..2048 and the default: 116
  programs, more than the 330 s budget compiles (it stops there and says so; narrow it
  with `--seqs`/`--causal`/`--sweep-blocks`).

`--sweep-xla-blocks` times eqx_flash's pure-XLA kernels (`kernels="xla"` where the keyword
exists) at each `(block_q, block_k)` pair of `--sweep-blocks` (block_q <= block_k, both
<= seq) and at the default blocks, and prints per (config, seq, causal, mode) each pair's
time and the logits one block step touches (batch·heads·block_q·block_k float32), for the
accelerator block policy.

On CPU for testing: `--configs h2d16 --tokens 512 --seqs 128 256 --rounds 1 --matmul 256`.
"""

import argparse
import dataclasses
import datetime
import functools
import gc
import importlib.metadata
import inspect
import json
import os
import re
import subprocess
import sys
import time
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _interleave import interleaved_medians  # noqa: E402

import eqx_flash  # noqa: E402

MODES = ("fwd", "fwd+bwd", "jvp")
FLOP_FACTOR = {"fwd": 1.0, "fwd+bwd": 3.5, "jvp": 2.5}
# bf16 dense peak TFLOP/s per JAX device, by `device_kind` (vendors' figures).
PEAK_TFLOPS = {"TPU v5 lite": 197.0, "TPU v5e": 197.0, "TPU v5p": 459.0, "TPU v4": 275.0,
               "TPU v6 lite": 918.0, "TPU v6e": 918.0}
PRESETS: dict[str, dict[str, Any]] = {
    "quick": dict(configs=["h16d128"], seqs=[4096, 1024, 16384], modes=list(MODES),
                  causal="both", blocks=[512, 1024], time_budget=330.0),
    "full": dict(configs=["h16d128", "h16d64", "gqa32-8"],
                 seqs=[1024, 2048, 4096, 8192, 16384], modes=list(MODES), causal="both",
                 blocks=[512, 1024, 2048], time_budget=540.0),
    "sweep": dict(sweep_xla_blocks=True, configs=["h16d128"], seqs=[4096, 1024, 16384],
                  modes=["fwd", "fwd+bwd"], causal="both", sweep_blocks=[256, 512, 1024, 2048],
                  time_budget=330.0),
}
# Kernel families for `eqx_flash[family]` rows when `flash_attention(kernels=)` exists but
# its annotation does not list them.
DEFAULT_FAMILIES = ("xla", "pallas_tpu")


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    heads: int
    kv_heads: int
    dim: int


def parse_config(name: str) -> Config:
    """`h{heads}d{dim}` or `gqa{heads}-{kv_heads}[d{dim}]` (dim 128 unless given)."""
    if match := re.fullmatch(r"h(\d+)d(\d+)", name):
        heads, dim = map(int, match.groups())
        return Config(name, heads, heads, dim)
    if match := re.fullmatch(r"gqa(\d+)-(\d+)(?:d(\d+))?", name):
        heads, kv_heads, dim = match.groups()
        if int(heads) % int(kv_heads):
            raise argparse.ArgumentTypeError(f"{name}: heads must be a multiple of kv heads")
        return Config(name, int(heads), int(kv_heads), int(dim or 128))
    raise argparse.ArgumentTypeError(
        f"config {name!r}: expected h<heads>d<dim> (h16d128) or gqa<heads>-<kv>[d<dim>]")


def flops(mode: str, causal: bool, batch: int, heads: int, seq: int, dim: int) -> float:
    forward = 4.0 * batch * heads * seq * seq * dim * (0.5 if causal else 1.0)
    return forward * FLOP_FACTOR[mode]


def kernel_families(requested: Iterable[str] = DEFAULT_FAMILIES) -> list[str]:
    """The kernel families `flash_attention(kernels=)` offers: the values of its `Literal`
    annotation, or `requested`; none if it has no such keyword."""
    params = inspect.signature(eqx_flash.flash_attention).parameters
    if "kernels" not in params:
        return []

    def literals(annotation: Any) -> list[str]:
        if typing.get_origin(annotation) is typing.Literal:
            return [a for a in typing.get_args(annotation) if isinstance(a, str)]
        return [x for arg in typing.get_args(annotation) for x in literals(arg)]

    return literals(params["kernels"].annotation) or list(requested)


# --- implementations: (label, layout, block) -> attend(q, k, v) -> out -------------------


@dataclasses.dataclass(frozen=True)
class Impl:
    """One row of the table: `make(config, seq, causal, block)` returns `attend(q, k, v)`
    on inputs in `layout` ("bhsd": (batch, heads, seq, dim); "bshd": jax.nn's)."""

    label: str
    layout: str
    make: Callable[[Config, int, bool, int | None], Any]  # attend(q, k, v) or a WithArrays
    blocks: tuple[int | None, ...] = (None,)


# Options `--features` adds as rows of their own (`eqx_flash[family]+name`), to measure
# what each costs against the same kernels without it: keyword arguments of
# `flash_attention` for a config and sequence length (constants, but for `TRAINED`).
FEATURES: dict[str, Callable[[Config, int], dict[str, Any]]] = {
    "alibi": lambda config, seq: {"alibi_slopes": 2.0 ** (
        -8.0 * jnp.arange(1, config.heads + 1) / config.heads)},
    "dropout": lambda config, seq: {"dropout_rate": 0.1, "key": jax.random.key(0)},
    "bias": lambda config, seq: {"bias": 0.1 * jax.random.normal(
        jax.random.key(1), (config.heads, seq, seq), jnp.bfloat16)},
    "softcap": lambda config, seq: {"softcap": 30.0},
    "softcap_mod": lambda config, seq: {"score_mod": _softcap_mod},
    "window_mod": lambda config, seq: {"mask_mod": _window_mod},
    "doc_mod": lambda config, seq: {"mask_mod": _doc_mod, "block_q": 1024, "block_k": 1024},
    "t5": lambda config, seq: {"score_mod": eqx_flash.RelativePositionBias(
        config.heads, key=jax.random.key(2))},
    "doc_ids": lambda config, seq: {"mask_mod": _documents_by_id(seq), "block_q": 1024,
                                    "block_k": 1024},
}


def _documents_by_id(seq: int):
    """`doc_mod`'s documents read from an array of ids, as FlexAttention writes them (the
    Pallas kernels compute the ids per position outside and read them per tile)."""
    ids = jnp.arange(seq, dtype=jnp.int32) // 1024

    def same_document(batch, head, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]

    return same_document


def _softcap_mod(score, batch, head, q_idx, kv_idx):  # Gemma 2's soft cap, as a score_mod
    return 30.0 * jnp.tanh(score / 30.0)


def _window_mod(batch, head, q_idx, kv_idx):  # a causal window of 1024 keys, as a mask_mod
    return (kv_idx <= q_idx) & (q_idx - kv_idx < 1024)


def _doc_mod(batch, head, q_idx, kv_idx):  # documents of 1024 tokens (block-diagonal)
    return q_idx // 1024 == kv_idx // 1024


# Features whose array is trained, by the keyword that takes it: the array (or module) is
# an input of the timed program (after q, k, v), and fwd+bwd takes its gradient too.
TRAINED = {"bias": "bias", "t5": "score_mod"}


@dataclasses.dataclass(frozen=True)
class WithArrays:
    """An attention call that takes arrays of its own after q, k and v: inputs of the timed
    program (not constants folded into it), differentiated in fwd+bwd like q, k and v."""

    attend: Callable[..., Any]
    arrays: tuple[Any, ...]


def _eqx(family: str | None = None, block_q: int | None = None, block_k: int | None = None,
         feature: str | None = None):
    extra = {} if family is None else {"kernels": family}
    if block_q is not None:
        extra.update(block_q=block_q, block_k=block_k)

    def make(config, seq, causal, block):
        options = dict(extra, **(FEATURES[feature](config, seq) if feature else {}))
        if feature not in TRAINED:
            return lambda q, k, v: eqx_flash.flash_attention(q, k, v, causal=causal,
                                                             **options)[0]
        keyword = TRAINED[feature]
        array = options.pop(keyword)

        def attend(q, k, v, array):
            return eqx_flash.flash_attention(q, k, v, causal=causal, **{keyword: array},
                                             **options)[0]

        return WithArrays(attend, (array,))

    return make


def _jax_nn(implementation: str):
    def make(config, seq, causal, block):
        return functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                                 implementation=implementation)

    return make


def _pallas_flash(config, seq, causal, block):
    from jax.experimental.pallas.ops.tpu import flash_attention as pallas

    sizes = pallas.BlockSizes(
        block_q=block, block_k_major=block, block_k=block, block_b=1,
        block_q_major_dkv=block, block_k_major_dkv=block, block_k_dkv=block,
        block_q_dkv=block, block_k_major_dq=block, block_k_dq=block, block_q_dq=block)
    groups = config.heads // config.kv_heads

    def attend(q, k, v):
        k, v = (jnp.repeat(x, groups, axis=1) if groups > 1 else x for x in (k, v))
        return pallas.flash_attention(q, k, v, causal=causal, sm_scale=config.dim ** -0.5,
                                      block_sizes=sizes)

    return attend


def _splash(config, seq, causal, block):
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as masks,
    )

    head_mask = masks.CausalMask((seq, seq)) if causal else masks.FullMask((seq, seq))
    sizes = splash.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
        block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    # Built here, outside any trace: inside one, its mask arrays would leak as tracers.
    kernel = splash.make_splash_mha(masks.MultiHeadMask([head_mask] * config.heads),
                                    block_sizes=sizes, head_shards=1, q_seq_shards=1)
    scale = config.dim ** -0.5
    return lambda q, k, v: jax.vmap(kernel)(q * jnp.asarray(scale, q.dtype), k, v)


def _tokamax(config, seq, causal, block):
    import tokamax

    return lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=causal)


def implementations(blocks: list[int], families: list[str], features: Iterable[str] = ()
                    ) -> tuple[list[Impl], list[str]]:
    """The rows available on this backend, and a line for each one skipped and why."""
    found = [Impl("eqx_flash", "bhsd", _eqx())]
    found += [Impl(f"eqx_flash[{f}]", "bhsd", _eqx(f)) for f in families]
    found += [Impl(f"eqx_flash[{f}]+{name}", "bhsd", _eqx(f, feature=name))
              for name in features for f in families]
    skipped = []
    if jax.default_backend() == "tpu":
        found.append(Impl("pallas flash", "bhsd", _pallas_flash, tuple(blocks)))
        found.append(Impl("splash", "bhsd", _splash, tuple(blocks)))
        try:
            import tokamax  # noqa: F401

            sys.argv = sys.argv[:1]  # tokamax parses absl flags from sys.argv on first use
            found.append(Impl("tokamax", "bshd", _tokamax))
        except ImportError as error:
            skipped.append(f"tokamax: not importable ({error})")
    else:
        skipped.append(f"pallas flash, splash, tokamax: TPU kernels, and the backend is "
                       f"{jax.default_backend()}")
    found.append(Impl("jax.nn xla", "bshd", _jax_nn("xla")))
    if jax.default_backend() == "gpu":
        found.append(Impl("jax.nn cudnn", "bshd", _jax_nn("cudnn")))
    return found, skipped


def program(attend: Callable[..., Any] | WithArrays, mode: str) -> Callable[..., Any]:
    """The jitted program of a cell: it takes q, k, v (and a `WithArrays`' arrays)."""
    arity = 3 + (len(attend.arrays) if isinstance(attend, WithArrays) else 0)
    call = attend.attend if isinstance(attend, WithArrays) else attend
    if mode == "fwd":
        return jax.jit(call)
    if mode == "fwd+bwd":
        def loss(*args):
            return jnp.sum(call(*args).astype(jnp.float32))

        return jax.jit(jax.grad(loss, argnums=tuple(range(arity))))
    # jvp: tangents along q, k, v only (an array of the call's own keeps a zero tangent).
    def tangents(*args):
        return tuple(args[:3]) + tuple(jax.tree.map(jnp.zeros_like, a) for a in args[3:])

    return jax.jit(lambda *args: jax.jvp(call, args, tangents(*args)))


def _inputs(config: Config, batch: int, seq: int, dtype: Any, layout: str) -> tuple:
    keys = jax.random.split(jax.random.key(seq), 3)
    heads = (config.heads, config.kv_heads, config.kv_heads)

    def shape(h):
        return (batch, h, seq, config.dim) if layout == "bhsd" else (batch, seq, h, config.dim)

    return tuple(jax.random.normal(key, shape(h), dtype) for key, h in zip(keys, heads,
                                                                            strict=True))


def _short(error: Exception) -> str:
    text = str(error)
    lines = text.strip().splitlines()
    if "custom_vjp" in text and ("forward-mode" in text or "jvp" in text):
        return "no forward mode (custom_vjp)"
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        return "out of memory"
    return f"{type(error).__name__}: {lines[0][:100] if lines else ''}"


# --- the run -----------------------------------------------------------------------------


@dataclasses.dataclass
class Budget:
    seconds: float
    start: float = dataclasses.field(default_factory=time.perf_counter)
    skipped: list[str] = dataclasses.field(default_factory=list)

    def over(self) -> bool:
        return time.perf_counter() - self.start > self.seconds

    def allows(self, cell: str) -> bool:
        """Whether `cell` may still be compiled; if not, it is noted as skipped."""
        if not self.over():
            return True
        self.skipped.append(cell)
        return False


def _cell_name(r: dict[str, Any]) -> str:
    block = (f" b{r['block']}" if r.get("block") else
             f" {r['block_q']}x{r['block_k']}" if r.get("block_q") else "")
    causal = "causal" if r["causal"] else "full"
    return f"{r['config']} seq {r['seq']} {causal} {r['mode']} {r['impl']}{block}"


def measure_group(cells: list[tuple[dict[str, Any], Callable[..., Any], str]], config: Config,
                  batch: int, seq: int, dtype: Any, rounds: int, matmul: int, budget: Budget,
                  progress: list[int]) -> list[dict[str, Any]]:
    """Compile, warm up and time the cells of one (config, seq), interleaved with a
    `matmul`^3 matmul; each cell is `(record, attend, layout)`."""
    inputs = {} if budget.over() else {  # nothing to build if no cell will run
        layout: _inputs(config, batch, seq, dtype, layout)
        for layout in sorted({layout for _, _, layout in cells})}
    calls: dict[str, Callable[[], Any]] = {}
    records = []
    for record, attend, layout in cells:
        progress[0] += 1
        name = _cell_name(record)
        records.append(record)
        if not budget.allows(name):
            record["error"] = "skipped (time budget)"
            continue
        print(f"[{progress[0]}/{progress[1]}] {name}: compiling ...", end="", flush=True)
        start = time.perf_counter()
        try:
            args = inputs[layout] + (attend.arrays if isinstance(attend, WithArrays) else ())
            compiled = program(attend, record["mode"]).lower(*args).compile()
            record["compile_s"] = round(time.perf_counter() - start, 2)
            analysis = compiled.memory_analysis()
            record["temp_mib"] = (None if analysis is None
                                  else analysis.temp_size_in_bytes / 2**20)
            jax.block_until_ready(compiled(*args))  # warm-up; may run out of memory
            calls[str(len(records) - 1)] = functools.partial(compiled, *args)
            print(f" {record['compile_s']:.1f} s", flush=True)
        except Exception as error:  # noqa: BLE001 - report and go on
            record["error"] = _short(error)
            print(f" {record['error']}", flush=True)
    if not calls:
        return records
    a = jax.random.normal(jax.random.key(1), (matmul, matmul), dtype)
    square = jax.jit(lambda a: a @ a).lower(a).compile()
    calls["matmul"] = functools.partial(square, a)
    jax.block_until_ready(calls["matmul"]())
    medians = interleaved_medians(calls, rounds, jax.block_until_ready, warm_up=False)
    matmul_tflops = 2.0 * matmul**3 / medians.pop("matmul") / 1e12
    peak = PEAK_TFLOPS.get(jax.devices()[0].device_kind)
    for index, seconds in medians.items():
        r = records[int(index)]
        r["ms"] = seconds * 1e3
        r["tflops"] = flops(r["mode"], r["causal"], batch, config.heads, seq,
                            config.dim) / seconds / 1e12
        r["of_matmul"] = r["tflops"] / matmul_tflops
        r["matmul_tflops"] = matmul_tflops
        if peak is not None:
            r["of_peak"] = r["tflops"] / peak
    return records


def run(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[str]]:
    """Every cell of the grid; returns the records and the lines on what was skipped."""
    dtype = jnp.dtype(args.dtype)
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    families = kernel_families(args.families)
    impls, notes = implementations(args.blocks, families, args.features)
    family = "xla" if "xla" in families else None  # the sweep's kernels
    label = "eqx_flash" if family is None else "eqx_flash[xla]"
    if args.sweep_xla_blocks:
        notes = [f"sweep: {label}, default blocks and block_q x block_k pairs"]
    elif args.impls:
        dropped = [i.label for i in impls if not any(s in i.label for s in args.impls)]
        impls = [i for i in impls if any(s in i.label for s in args.impls)]
        notes.append(f"--impls left out: {', '.join(dropped)}" if dropped else "")
    groups = []
    for name in args.configs:
        config = parse_config(name)
        for seq in args.seqs:
            batch = max(1, args.tokens // seq)
            cells = []
            for causal in causals:
                base = dict(config=config.name, heads=config.heads, kv_heads=config.kv_heads,
                            dim=config.dim, batch=batch, seq=seq, causal=causal,
                            dtype=dtype.name)
                if args.sweep_xla_blocks:
                    pairs = [(None, None)] + [
                        (bq, bk) for bq in args.sweep_blocks for bk in args.sweep_blocks
                        if bq <= bk <= seq]
                    for bq, bk in pairs:
                        attend = _eqx(family, bq, bk)(config, seq, causal, None)
                        for mode in args.modes:
                            record = dict(base, mode=mode, impl=label, sweep=True,
                                          block_q=bq, block_k=bk)
                            if bq is not None:
                                record["step_logits_mib"] = (batch * config.heads * bq * bk
                                                             * 4 / 2**20)
                            cells.append((record, attend, "bhsd"))
                    continue
                for impl in impls:
                    for block in impl.blocks:
                        if block is not None and block > seq:
                            continue
                        record = dict(base, impl=impl.label, block=block)
                        try:
                            attend = impl.make(config, seq, causal, block)
                        except Exception as error:  # noqa: BLE001
                            for mode in args.modes:
                                cells.append((dict(record, mode=mode,
                                                   error=_short(error)), None, impl.layout))
                            continue
                        for mode in args.modes:
                            cells.append((dict(record, mode=mode), attend, impl.layout))
            groups.append((config, batch, seq, cells))
    budget = Budget(args.time_budget)
    progress = [0, sum(len(cells) for *_, cells in groups)]
    records = []
    for config, batch, seq, cells in groups:
        ready = [c for c in cells if "error" not in c[0]]
        records += [c[0] for c in cells if "error" in c[0]]
        records += measure_group(ready, config, batch, seq, dtype, args.rounds, args.matmul,
                                 budget, progress)
        gc.collect()
    if budget.skipped:
        notes.append(f"time budget {args.time_budget:g} s passed: {len(budget.skipped)} "
                     f"cells not measured, from {budget.skipped[0]} on")
    return records, [n for n in notes if n]


# --- reporting ---------------------------------------------------------------------------


def _best(records: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """Per (config, seq, causal, mode, impl) the fastest block's record (errors last)."""
    best: dict[tuple, dict[str, Any]] = {}
    for r in records:
        key = (r["config"], r["seq"], r["causal"], r["mode"], r["impl"])
        if key not in best or r.get("tflops", -1) > best[key].get("tflops", -1):
            best[key] = r
    return best


def _tf(x: float) -> str:
    """TFLOP/s to one decimal, or three significant digits below 10 (CPU runs)."""
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def _value(r: dict[str, Any] | None, with_block: bool = False) -> str:
    if r is None:
        return ""
    if "tflops" not in r:
        return r.get("error", "")
    block = f" (b{r['block']})" if with_block and r.get("block") else ""
    return f"{_tf(r['tflops'])}{block}"


def markdown(meta: dict[str, Any], records: list[dict[str, Any]]) -> str:
    lines = [f"Measured {meta['date']} on {meta['backend']} ({meta['device_kind']}), jax "
             f"{meta['jax']}, eqx_flash {meta['eqx_flash']} (commit {meta['commit']}); "
             f"{meta['dtype']}, {meta['tokens']} tokens per batch, medians of "
             f"{meta['rounds']} interleaved rounds.",
             "TFLOP/s = 4·B·H·S²·D (forward; H the query heads) ×3.5 fwd+bwd, ×2.5 jvp, "
             "halved when causal. Peers at their best block size among those tried (the "
             "block in brackets; every block below)."]
    if meta.get("peak_tflops"):
        lines.append(f"Peak: {meta['peak_tflops']:g} TFLOP/s bf16 ({meta['device_kind']}).")
    rates = [r["matmul_tflops"] for r in records if "matmul_tflops" in r]
    if rates:
        rates.sort()
        lines.append(f"A {meta['matmul']}³ {meta['dtype']} matmul in the same rounds: "
                     f"{_tf(rates[len(rates) // 2])} TFLOP/s (median over the groups).")
    lines += [f"Note: {n}" for n in meta.get("notes", [])]
    sweep = [r for r in records if r.get("sweep")]
    grid = [r for r in records if not r.get("sweep")]
    if grid:
        lines += ["", *_summary(grid), "", *_detail(grid)]
    if sweep:
        lines += ["", *_sweep_tables(sweep)]
    return "\n".join(lines) + "\n"


def _summary(records: list[dict[str, Any]]) -> list[str]:
    best = _best(records)
    impls = list(dict.fromkeys(r["impl"] for r in records))
    out = []
    for config in dict.fromkeys(r["config"] for r in records):
        out += [f"### {config}: TFLOP/s", "",
                "| seq (batch) | causal | mode | " + " | ".join(impls) + " |",
                "|---|---|---|" + "---:|" * len(impls)]
        rows = sorted({(r["seq"], r["batch"], r["causal"], r["mode"]) for r in records
                       if r["config"] == config},
                      key=lambda x: (x[0], x[2], MODES.index(x[3])))
        for seq, batch, causal, mode in rows:
            cells = [_value(best.get((config, seq, causal, mode, i)), with_block=True)
                     for i in impls]
            out.append(f"| {seq} ({batch}) | {'yes' if causal else 'no'} | {mode} | "
                       + " | ".join(cells) + " |")
        out.append("")
    return out


def _detail(records: list[dict[str, Any]]) -> list[str]:
    out = ["### Every cell", "",
           "| config | seq | batch | causal | mode | implementation | block | ms | TFLOP/s "
           "| × peak | × matmul | temp MiB | compile s |",
           "|---|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(records, key=lambda r: (r["config"], r["seq"], r["causal"],
                                            MODES.index(r["mode"]), r["impl"],
                                            r.get("block") or 0)):
        head = (f"| {r['config']} | {r['seq']} | {r['batch']} | {'yes' if r['causal'] else 'no'}"
                f" | {r['mode']} | {r['impl']} | {r.get('block') or ''} ")
        if "tflops" not in r:
            out.append(head + f"| {r.get('error', '')} | | | | | | |")
            continue
        peak = f"{r['of_peak']:.2f}" if "of_peak" in r else ""
        temp = "" if r.get("temp_mib") is None else f"{r['temp_mib']:.0f}"
        out.append(head + f"| {r['ms']:.2f} | {_tf(r['tflops'])} | {peak} | "
                   f"{r['of_matmul']:.2f} | {temp} | {r.get('compile_s', '')} |")
    return out


def _blocks(r: dict[str, Any]) -> str:
    return "default" if r.get("block_q") is None else f"{r['block_q']}×{r['block_k']}"


def _sweep_tables(records: list[dict[str, Any]]) -> list[str]:
    out = ["### Block sweep of the pure-XLA kernels", ""]
    keys = dict.fromkeys((r["config"], r["seq"], r["batch"], r["causal"], r["mode"])
                         for r in records)
    for config, seq, batch, causal, mode in keys:
        rows = [r for r in records if (r["config"], r["seq"], r["causal"], r["mode"])
                == (config, seq, causal, mode)]
        timed = [r for r in rows if "tflops" in r]
        fastest = max(timed, key=lambda r: r["tflops"]) if timed else None
        default = next((r for r in rows if r.get("block_q") is None), None)
        summary = ""
        if fastest is not None and default is not None:
            summary = (f": default {_value(default)} TFLOP/s, best {_blocks(fastest)} "
                       f"{_tf(fastest['tflops'])}")
        out += [f"{config}, seq {seq} (batch {batch}), {'causal' if causal else 'full'}, "
                f"{mode}{summary}", "",
                "| block_q × block_k | step logits MiB | ms | TFLOP/s | temp MiB |",
                "|---|---:|---:|---:|---:|"]
        for r in rows:
            blocks = _blocks(r)
            step = _tf(r["step_logits_mib"]) if "step_logits_mib" in r else ""
            if "tflops" not in r:
                out.append(f"| {blocks} | {step} | {r.get('error', '')} | | |")
                continue
            temp = "" if r.get("temp_mib") is None else f"{r['temp_mib']:.0f}"
            mark = " **best**" if r is fastest else ""
            out.append(f"| {blocks}{mark} | {step} | {r['ms']:.2f} | {_tf(r['tflops'])} | "
                       f"{temp} |")
        out.append("")
    return out


def plot(records: list[dict[str, Any]], path: Path) -> str:
    """TFLOP/s against the sequence length, one panel per (config, mode), one line per
    implementation (peers at their best block), dashed when causal. Returns a line
    saying what was written, or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (draw it elsewhere with --replot)"
    best = [r for r in _best([r for r in records if not r.get("sweep")]).values()
            if "tflops" in r]
    if not best:
        return "no plot: no cell was measured"
    configs = list(dict.fromkeys(r["config"] for r in best))
    modes = [m for m in MODES if any(r["mode"] == m for r in best)]
    fig, axes = plt.subplots(len(configs), len(modes), squeeze=False,
                             figsize=(4.5 * len(modes), 3.5 * len(configs)))
    impls = list(dict.fromkeys(r["impl"] for r in best))
    colours = {impl: f"C{i}" for i, impl in enumerate(impls)}
    rates = sorted(r["matmul_tflops"] for r in best if "matmul_tflops" in r)
    peaks = {r["tflops"] / r["of_peak"] for r in best if r.get("of_peak")}
    for row, config in enumerate(configs):
        for col, mode in enumerate(modes):
            ax = axes[row][col]
            for impl in impls:
                for causal in (False, True):
                    points = sorted((r["seq"], r["tflops"]) for r in best
                                    if (r["config"], r["mode"], r["impl"], r["causal"])
                                    == (config, mode, impl, causal))
                    if points:
                        ax.plot(*zip(*points, strict=True), marker="o",
                                color=colours[impl], linestyle="--" if causal else "-",
                                label=f"{impl}{' causal' if causal else ''}")
            if rates:
                ax.axhline(rates[len(rates) // 2], color="grey", linestyle=":",
                           label="big matmul")
            for peak in sorted(peaks)[:1]:
                ax.axhline(peak, color="black", linestyle=":", label="bf16 peak")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{config} {mode}")
            ax.set_xlabel("sequence length")
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot written to {path}"


def _commit() -> str:
    """`EQX_FLASH_COMMIT` if set (a copied tree has no git history), else git's HEAD."""
    if os.environ.get("EQX_FLASH_COMMIT"):
        return os.environ["EQX_FLASH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=Path(__file__).resolve().parent, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="quick",
                   help="defaults for the options below (default quick)")
    p.add_argument("--configs", nargs="+", type=str, help="h16d128, h16d64, gqa32-8, ...")
    p.add_argument("--seqs", nargs="+", type=int, help="sequence lengths, in this order")
    p.add_argument("--modes", nargs="+", choices=MODES, help="what each program computes")
    p.add_argument("--causal", choices=("both", "yes", "no"), help="causal cells, full, or both")
    p.add_argument("--impls", nargs="+", help="keep implementations whose name contains one "
                                              "of these substrings")
    p.add_argument("--blocks", nargs="+", type=int, help="the peers' block sizes")
    p.add_argument("--families", nargs="+", default=list(DEFAULT_FAMILIES),
                   help="eqx_flash kernel families to row, if flash_attention takes kernels= "
                        "without listing them")
    p.add_argument("--features", nargs="+", default=[], choices=sorted(FEATURES),
                   help="eqx_flash rows with these options too (their cost)")
    p.add_argument("--sweep-xla-blocks", action="store_true", default=None,
                   help="time eqx_flash's XLA kernels at explicit block pairs instead")
    p.add_argument("--sweep-blocks", nargs="+", type=int, help="block sizes of the sweep")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per batch (16384)")
    p.add_argument("--dtype", default="bfloat16", help="of q, k, v (default bfloat16)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (5)")
    p.add_argument("--matmul", type=int, default=None,
                   help="size of the reference matmul (8192 on accelerators, 512 on CPU)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds after which no more cells are compiled ('inf': none)")
    p.add_argument("--json", type=Path, help="write the records here")
    p.add_argument("--markdown", type=Path, help="write the tables here")
    p.add_argument("--plot", type=Path, help="draw TFLOP/s against seq here (matplotlib)")
    p.add_argument("--replot", type=Path, metavar="JSON",
                   help="draw and tabulate a JSON written by --json; runs nothing")
    return p


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parser().parse_args(argv)
    if args.replot is not None:
        saved = json.loads(args.replot.read_text())
        print(markdown(saved["meta"], saved["records"]))
        print(plot(saved["records"], args.plot or args.replot.with_suffix(".png")))
        return saved["records"]
    preset = PRESETS[args.preset]
    for name in ("configs", "seqs", "modes", "causal", "blocks", "sweep_blocks",
                 "time_budget", "sweep_xla_blocks"):
        if getattr(args, name) is None:
            setattr(args, name, preset.get(name, PRESETS["quick"].get(name)))
    if args.sweep_blocks is None:
        args.sweep_blocks = PRESETS["sweep"]["sweep_blocks"]
    args.sweep_xla_blocks = bool(args.sweep_xla_blocks)
    for name in args.configs:
        parse_config(name)
    if args.matmul is None:
        args.matmul = 512 if jax.default_backend() == "cpu" else 8192
    device = jax.devices()[0]
    meta = dict(date=datetime.date.today().isoformat(), backend=jax.default_backend(),
                device_kind=device.device_kind, jax=jax.__version__,
                eqx_flash=_version("eqx_flash"), commit=_commit(), dtype=args.dtype,
                tokens=args.tokens, rounds=args.rounds, matmul=args.matmul,
                peak_tflops=PEAK_TFLOPS.get(device.device_kind), preset=args.preset,
                argv=sys.argv[1:] if argv is None else argv)
    print(f"backend {meta['backend']}: {meta['device_kind']}; preset {args.preset}"
          f"{', block sweep' if args.sweep_xla_blocks else ''}, time budget "
          f"{args.time_budget:g} s", flush=True)
    records, notes = run(args)
    meta["notes"] = notes
    for note in notes:
        print(note, flush=True)
    table = markdown(meta, records)
    print(table)
    if args.json is not None:
        args.json.write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    if args.markdown is not None:
        args.markdown.write_text(table)
    if args.plot is not None:
        print(plot(records, args.plot))
    return records


if __name__ == "__main__":
    main()
