"""Sequence parallelism on 1, 2 and 4 host (CPU) devices: time, memory, communication.

Run: `python benchmarks/bench_ring.py [--seq 4096] [--memory-seqs 8192,32768]`. The
script asks XLA for 4 host devices itself (before jax is imported). For plain
`flash_attention` and for `sharded_flash_attention` with the sequence over 1, 2 and 4
devices, with `strategy="ring"`, `"ulysses"` and `"all_gather"`, it reports the wall time of one
forward+backward step at `--seq` (median of `--rounds`, every setup once per round in a
shuffled order, in one process: `_interleave`), the per-device compiled temp
memory (`memory_analysis()`, compile only) at each of `--memory-seqs`, and the bytes each
device sends in the forward at `--seq` (counted from the strategy: the ring passes k and
v on `devices - 1` times; Ulysses' all-to-alls send `(devices - 1) / devices` of each
device's q, k, v and output shards; the all-gather sends its k and v shards to every
other device).

Host devices share the machine's cores, so expect memory, not speed, to improve with
more of them; on real accelerators each device brings its own compute.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()

import argparse  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _interleave import interleaved_medians  # noqa: E402

import eqx_flash  # noqa: E402


def _step(loss):
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _temp_mib(loss, args) -> float:
    """Per-device temp memory of the compiled step (compiled only, not run)."""
    memory = _step(loss).lower(*args).compile().memory_analysis()
    assert memory is not None, "this backend reports no memory analysis"
    return memory.temp_size_in_bytes / 2**20


def _setups(causal: bool):
    """(name, mesh or None, loss) for single-device flash_attention, the ring on 1, 2, 4
    devices, and Ulysses and the all-gather on 2, 4."""

    def single(q, k, v):
        return eqx_flash.flash_attention(q, k, v, causal=causal)[0].sum()

    yield "flash_attention", None, single
    for strategy, counts in (("ring", (1, 2, 4)), ("ulysses", (2, 4)), ("all_gather", (2, 4))):
        for n in counts:
            mesh = Mesh(np.array(jax.devices()[:n]), ("seq",))

            def sharded(q, k, v, mesh=mesh, strategy=strategy):
                out, _ = eqx_flash.sharded_flash_attention(
                    q, k, v, mesh=mesh, seq_axis="seq", causal=causal, strategy=strategy
                )
                return out.sum()

            yield f"{strategy}, {n} device{'s' * (n > 1)}", mesh, sharded


def _sent_mib(name: str, mesh, shape) -> float:
    """Bytes one device sends in the forward, in MiB (q, k, v, out alike: float32)."""
    if mesh is None:
        return 0.0
    n = mesh.shape["seq"]
    shard = np.prod(shape) // n * 4
    if name.startswith("ring"):
        return (n - 1) * 2 * shard / 2**20  # k and v, n - 1 hops
    if name.startswith("all_gather"):
        return (n - 1) * 2 * shard / 2**20  # its k and v shards to every other device
    return (n - 1) / n * 4 * shard / 2**20  # q, k, v in; out back


def _placed(shape, mesh, concrete: bool):
    sharding = None if mesh is None else NamedSharding(mesh, PartitionSpec(None, None, "seq"))
    if not concrete:
        return tuple(jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding) for _ in "qkv")
    keys = jax.random.split(jax.random.key(0), 3)
    arrays = tuple(jax.random.normal(key, shape, jnp.float32) for key in keys)
    return arrays if sharding is None else tuple(jax.device_put(x, sharding) for x in arrays)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=4096, help="sequence length for timing")
    parser.add_argument("--memory-seqs", type=str, default="8192,32768")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    opts = parser.parse_args()
    memory_seqs = [int(x) for x in opts.memory_seqs.split(",") if x]
    print(f"heads={opts.heads} dim={opts.dim} causal={opts.causal} float32, forward+backward, "
          f"{len(jax.devices())} host devices")
    shape = (1, opts.heads, opts.seq, opts.dim)
    setups = list(_setups(opts.causal))
    calls = {}
    for name, mesh, loss in setups:
        args = _placed(shape, mesh, True)
        calls[name] = functools.partial(_step(loss).lower(*args).compile(), *args)
    medians = interleaved_medians(calls, opts.rounds, jax.block_until_ready)
    header = f"| setup | median s @{opts.seq} | sent MiB/dev @{opts.seq} |"
    header += "".join(f" temp MiB/dev @{s} |" for s in memory_seqs)
    print("\n" + header + "\n|---|" + "---:|" * (2 + len(memory_seqs)))
    for name, mesh, loss in setups:
        row = f"| {name} | {medians[name]:.3f} | {_sent_mib(name, mesh, shape):.1f} |"
        for seq in memory_seqs:
            row += f" {_temp_mib(loss, _placed((1, opts.heads, seq, opts.dim), mesh, False)):.1f} |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
