"""What jaxtyping + beartype's runtime checks cost a `flash_attention` call.

Run: `python benchmarks/typing_overhead.py`. Prints microseconds per call:

- "check alone": the `jaxtyped(typechecker=beartype)` wrapper of `flash_attention`'s exact
  signature around a function that does nothing, minus that function unwrapped. Pure
  Python on one thread, so it is measured in process time, which is robust on a busy
  machine;
- "eager" and "jit": whole calls with the checks on and off (wall time; on a loaded
  machine the noise can exceed the difference). Under `jax.jit` the checks run once,
  while tracing, and the compiled call never runs them.

Each figure is the best of several interleaved runs.
"""

import inspect
import time
import timeit

import jax
import jax.numpy as jnp
import jaxtyping
from beartype import beartype

import eqx_flash


def _best(fn, number: int, rounds: int, timer=time.perf_counter) -> float:
    return min(timeit.Timer(fn, timer=timer).repeat(repeat=rounds, number=number)) / number * 1e6


def main() -> None:
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 4, 16, 16))
    k = jax.random.normal(keys[1], (2, 2, 16, 16))
    v = jax.random.normal(keys[2], (2, 2, 16, 16))
    mask = jnp.ones((2, 16), bool)
    result = eqx_flash.flash_attention(q, k, v, mask, causal=True)

    def noop(*args, **kwargs):
        return result

    noop.__signature__ = inspect.signature(eqx_flash.flash_attention)  # pyright: ignore
    checked_noop = jaxtyping.jaxtyped(typechecker=beartype)(noop)
    checked = _best(lambda: checked_noop(q, k, v, mask, causal=True), 2000, 7, time.process_time)
    bare = _best(lambda: noop(q, k, v, mask, causal=True), 2000, 7, time.process_time)
    print(f"check alone: {checked - bare:7.1f} us per call")

    def eager():
        return jax.block_until_ready(eqx_flash.flash_attention(q, k, v, mask, causal=True))

    jitted_fn = jax.jit(lambda q, k, v, m: eqx_flash.flash_attention(q, k, v, m, causal=True))

    def jitted():
        return jax.block_until_ready(jitted_fn(q, k, v, mask))

    eager(), jitted()  # compile
    results: dict[tuple[str, bool], float] = {}
    for disable in (False, True) * 5:  # interleaved; the minimum filters machine noise
        jaxtyping.config.update("jaxtyping_disable", disable)
        for name, fn in (("eager", eager), ("jit", jitted)):
            best = _best(fn, 100, 3)
            results[name, disable] = min(results.get((name, disable), float("inf")), best)
    jaxtyping.config.update("jaxtyping_disable", False)
    for name in ("eager", "jit"):
        on, off = results[name, False], results[name, True]
        print(f"{name:5s}: checks on {on:7.1f} us, off {off:7.1f} us per call")


if __name__ == "__main__":
    main()
