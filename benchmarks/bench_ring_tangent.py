"""Forward mode on the ring, two designs side by side (issue #25), on 4 host devices.

    python benchmarks/bench_ring_tangent.py [--seq 4096] [--rounds 7]

One pass (`ring._ring_attention_tangent`): `jax.jvp` of the ring forward whose chunk
pairs carry the single-device derivative rules, the tangent partials merged as the
forward's. Two passes (`ring._ring_attention_tangent_two_pass`): after the forward ring,
a second ring pass runs each pair's tangent kernel against the merged `out` and `lse`
and sums the shares. `jax.jvp` of `sharded_flash_attention` along q, k and v, full and
causal, both checked against single-device `flash_attention` first; interleaved medians.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _interleave import interleaved_medians, problem_arguments  # noqa: E402

import eqx_flash  # noqa: E402
from eqx_flash._distributed import ring  # noqa: E402


def _jvp(mesh, two_pass: bool, causal: bool):
    ring.TWO_PASS_TANGENT[0] = two_pass  # read while tracing, below

    def attend(q, k, v):
        return eqx_flash.sharded_flash_attention(q, k, v, mesh=mesh, seq_axis="seq",
                                                 causal=causal)

    f = jax.jit(lambda *x: jax.jvp(attend, x[:3], x[3:]))
    return f


def main() -> None:
    args = problem_arguments(__doc__).parse_args()
    mesh = Mesh(np.array(jax.devices()[:4]), ("seq",))
    shape = (1, args.heads, args.seq, args.dim)
    keys = jax.random.split(jax.random.key(0), 6)
    xs = [jax.device_put(jax.random.normal(k, shape),
                         NamedSharding(mesh, PartitionSpec(None, None, "seq"))) for k in keys]
    calls = {}
    for causal in (False, True):
        expected = jax.jvp(lambda q, k, v, c=causal: eqx_flash.flash_attention(
            q, k, v, causal=c), xs[:3], xs[3:])
        for two_pass in (False, True):
            f = _jvp(mesh, two_pass, causal)
            got = jax.block_until_ready(f(*xs))  # compiled now, with the flag as set
            err = max(float(jnp.max(jnp.abs(a - b)))
                      for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got),
                                      strict=True))
            assert err < 1e-3, err
            calls[f"{'two' if two_pass else 'one'} pass, causal={causal}"] = (
                lambda f=f: f(*xs))
    ring.TWO_PASS_TANGENT[0] = False
    medians = interleaved_medians(calls, args.rounds, jax.block_until_ready, warm_up=False)
    print(f"\nseq {args.seq}, {args.heads} heads, dim {args.dim}, 4 host devices, "
          f"jvp along q, k, v; medians of {args.rounds} interleaved rounds")
    for causal in (False, True):
        one = medians[f"one pass, causal={causal}"]
        two = medians[f"two pass, causal={causal}"]
        print(f"causal={causal}: one pass {one * 1e3:.0f} ms, two passes {two * 1e3:.0f} ms,"
              f" two/one {two / one:.2f}")


if __name__ == "__main__":
    main()
