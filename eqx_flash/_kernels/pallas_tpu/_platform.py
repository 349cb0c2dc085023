"""Compiled on a TPU, interpreted elsewhere: the choice made when the program is lowered.

`jax.lax.platform_dependent` keeps only the branch of the platform a program is lowered
for, so one traced call compiles to Mosaic kernels on a TPU (and `jax.export(...,
platforms=("tpu",))` on any host yields them), and runs Pallas' interpreter on a CPU
(slow: for tests and for `kernels="pallas_tpu"` asked for off a TPU).

Inside a user's `shard_map` (`check_vma=True`) a `pallas_call` must say over which mesh
axes its outputs vary: `output_struct` gives them the union of what the inputs vary over.
"""

import functools
from collections.abc import Callable
from typing import Any

import jax
from jaxtyping import Array

from ..._core.compat import varying_axes, varying_struct


def on_tpu_or_interpreted(call: Callable[..., Any], *args: Any) -> Any:
    """`call(*args, interpret=False)` on a TPU, `call(*args, interpret=True)` elsewhere."""
    return jax.lax.platform_dependent(
        *args,
        tpu=functools.partial(call, interpret=False),
        default=functools.partial(call, interpret=True),
    )


def output_struct(shape: tuple[int, ...], dtype: Any, inputs: tuple[Array, ...]
                  ) -> jax.ShapeDtypeStruct:
    """A kernel output's `ShapeDtypeStruct`, varying over every manual mesh axis one of
    `inputs` varies over (none outside `shard_map`)."""
    axes = frozenset().union(*(varying_axes(x) for x in inputs))
    return varying_struct(shape, dtype, axes)
