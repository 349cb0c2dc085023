"""Compiled on a TPU, interpreted elsewhere: the choice made when the program is lowered.

`jax.lax.platform_dependent` keeps only the branch of the platform a program is lowered
for, so one traced call compiles to Mosaic kernels on a TPU (and `jax.export(...,
platforms=("tpu",))` on any host yields them), and runs Pallas' interpreter on a CPU
(slow: for tests and for `kernels="pallas_tpu"` asked for off a TPU).
"""

import functools
from collections.abc import Callable
from typing import Any

import jax


def on_tpu_or_interpreted(call: Callable[..., Any], *args: Any) -> Any:
    """`call(*args, interpret=False)` on a TPU, `call(*args, interpret=True)` elsewhere."""
    return jax.lax.platform_dependent(
        *args,
        tpu=functools.partial(call, interpret=False),
        default=functools.partial(call, interpret=True),
    )

