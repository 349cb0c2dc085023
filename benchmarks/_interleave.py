"""Interleaved timing, shared by the benchmark scripts: every call once per round, in a
shuffled order, so that a shared machine's drift hits every configuration alike."""

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any


def interleaved_medians(calls: dict[str, Callable[[], Any]], rounds: int,
                        block: Callable[[Any], Any], warm_up: bool = True,
                        settle: int = 0) -> dict[str, float]:
    """Median seconds of each thunk in `calls` over `rounds` rounds, after one warm-up
    call each (unless the caller ran them already); `block` waits for a result
    (`jax.block_until_ready`). `settle`: untimed calls right before each timed one, so
    that a call is timed as it runs when repeated (its buffers mapped, its data in
    cache), not just after another configuration that freed and touched gigabytes: a
    12 GiB dense peer slowed the next call by up to 1.5x."""
    for call in calls.values() if warm_up else ():
        block(call())
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    for r in range(rounds):
        random.shuffle(order)
        for name in order:
            for _ in range(settle):
                block(calls[name]())
            start = time.perf_counter()
            block(calls[name]())
            times[name].append(time.perf_counter() - start)
        print(f"round {r + 1}/{rounds} done", flush=True)
    return {name: statistics.median(t) for name, t in times.items()}


def problem_arguments(doc: str | None) -> argparse.ArgumentParser:
    """The parser every interleaved benchmark starts from: `--seq`, `--heads`, `--dim`,
    `--rounds` (the description: `doc`'s first paragraph); add more, then parse."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    p.add_argument("--seq", type=int, default=4096, help="sequence length (queries and keys)")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--dim", type=int, default=64, help="head dim")
    p.add_argument("--rounds", type=int, default=7,
                   help="interleaved rounds; each time is the median over them")
    return p
