"""`kernel_family`: which kernel family a call would run, and why."""

from typing import Any

from jaxtyping import ArrayLike

from .._kernels.dispatch import why
from .binder import bind
from .flash import call_of, recognised_mods


def kernel_family(q: ArrayLike, k: ArrayLike, v: ArrayLike, mask: ArrayLike | None = None,
                  **options: Any) -> tuple[str | None, str]:
    """Which kernel family `flash_attention(q, k, v, mask, **options)` runs, and why.

    **Arguments:** as `flash_attention`'s (arrays or `jax.ShapeDtypeStruct`-like arrays
    of the same shapes; nothing is computed), `kernels=` included.

    **Returns:** `(family, reason)`: `"pallas_tpu"` or `"xla"` and a sentence saying why
    (with `kernels=None`: the machine's defaults, and what the Pallas kernels lack when
    they do not cover the call); `(None, reason)` when the family asked for with
    `kernels=` does not cover the call (`flash_attention` would raise
    `NotImplementedError` with that reason).

    **Raises:** what `flash_attention` raises for bad arguments.
    """
    bound = bind("kernel_family", q, k, v, mask, **options)
    return why(call_of(recognised_mods(bound)[0]), bound.options.kernels)
