"""The public attention options, checked and normalised in one place.

Every entry point (`flash_attention`, `plain_attention`, the modules' `__check_init__`,
`ring_flash_attention`, `sharded_flash_attention`) turns its keyword arguments into one
frozen, hashable `AttentionOptions` with `make_options`, before anything is traced. So a
bad value raises the same exception with the same message wherever it is passed:
`TypeError` for a value of the wrong type, `ValueError` for one of the right type out of
range, the message naming the argument and showing the value.

A new option is added here (field, check) and read where it is used; the signatures of
the entry points list it, nothing else re-checks it.
"""

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Window:
    """Keys a query may see, relative to its bottom-right aligned position `p`.

    Query `i` sees key `j` iff `p - left <= j <= p + right` with `p = i + seq_k - seq_q`;
    `None` leaves that side unbounded. Causal attention is `right = 0`.
    """

    left: int | None = None
    right: int | None = None

    @property
    def is_unbounded(self) -> bool:
        return self.left is None and self.right is None


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """Static options of one attention call, validated (see `make_options`).

    `window` already includes `causal` (as `right <= 0`); `causal` is kept for callers
    that report it. `scale=None` means `1/sqrt(dim)`, resolved by `scale_for`.
    """

    causal: bool = False
    window: Window = Window()
    scale: float | None = None
    softcap: float | None = None
    block_q: int | None = None
    block_k: int | None = None
    dropout_rate: float = 0.0
    # The kernel family asked for (`_kernels.dispatch.choose`): None lets the call choose.
    kernels: str | None = None

    def scale_for(self, dim: int) -> float:
        return 1.0 / math.sqrt(dim) if self.scale is None else self.scale


def make_options(
    *,
    causal: Any = False,
    window: Any = None,
    scale: Any = None,
    softcap: Any = None,
    block_q: Any = None,
    block_k: Any = None,
    dropout_rate: Any = 0.0,
    kernels: Any = None,
) -> AttentionOptions:
    """Check every option and return them normalised; raises `TypeError`/`ValueError`
    naming the argument. Runs on Python values only, so it works at trace time."""
    if not isinstance(causal, bool | np.bool_):
        raise TypeError(f"causal must be a bool; got causal={causal!r}")
    return AttentionOptions(
        causal=bool(causal),
        window=_window(window, bool(causal)),
        scale=None if scale is None else _real("scale", scale, positive=False),
        softcap=None if softcap is None else _real("softcap", softcap, positive=True),
        block_q=_block("block_q", block_q),
        block_k=_block("block_k", block_k),
        dropout_rate=check_rate("dropout_rate", dropout_rate),
        kernels=check_kernels(kernels),
    )


# The kernel families (`_kernels.dispatch.FAMILIES`): "xla", the pure-JAX loops that run
# anywhere; "pallas_tpu", Mosaic kernels on a TPU (Pallas' interpreter elsewhere).
KERNEL_FAMILIES = ("xla", "pallas_tpu")


def check_kernels(kernels: Any) -> str | None:
    """`kernels`: None (the call chooses) or the name of a kernel family."""
    if kernels is None:
        return None
    if not isinstance(kernels, str):
        raise TypeError(f"kernels must be None or a str naming a kernel family; got "
                        f"kernels={kernels!r}")
    if kernels not in KERNEL_FAMILIES:
        names = ", ".join(repr(name) for name in KERNEL_FAMILIES)
        raise ValueError(f"kernels must be None or one of {names}; got kernels={kernels!r}")
    return kernels


# The options that decide the compiled kernels, as the modules hold them in static
# fields of these names (`_nn.module_call.static_options`).
KERNEL_OPTIONS = ("causal", "window", "scale", "softcap", "block_q", "block_k", "kernels")


def check_rate(name: str, value: Any) -> float:
    """A dropout probability in `[0, 1)`, as a Python float."""
    rate = _real(name, value, positive=False)
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"{name} must be in [0, 1); got {name}={value!r}")
    return rate


def _real(name: str, value: Any, positive: bool) -> float:
    """A real number known at trace time (it decides the compiled program)."""
    expected = "a real number > 0" if positive else "a real number"
    if isinstance(value, bool) or not isinstance(value, int | float | np.number | jax.Array):
        raise TypeError(f"{name} must be {expected}; got {name}={value!r}")
    if isinstance(value, np.number | jax.Array) and not (
        jnp.issubdtype(value.dtype, jnp.integer) or jnp.issubdtype(value.dtype, jnp.floating)
    ):
        raise TypeError(f"{name} must be {expected}; got {name}={value!r}")
    try:
        number = float(value)
    except TypeError:  # a traced JAX value: float() cannot make it concrete
        raise TypeError(
            f"{name} must be a concrete Python number, not a traced value; got {name}={value!r}"
        ) from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite; got {name}={value!r}")
    if positive and number <= 0:
        raise ValueError(f"{name} must be > 0; got {name}={value!r}")
    return number


def _block(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be a positive int or None; got {name}={value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int or None; got {name}={value!r}")
    return int(value)


_REACHES_ALL = 2**32 - 1


def _window(window: Any, causal: bool) -> Window:
    """`None`, `w` for `(w, w)`, or a pair `(left, right)` of ints >= 0 or None."""
    expected = "an int >= 0, a pair (left, right) of ints >= 0 or None, or None"
    if window is None:
        left, right = None, None
    elif isinstance(window, tuple | list):
        if len(window) != 2:
            raise TypeError(f"window must be {expected}; got window={window!r}")
        left, right = window
    else:
        left = right = window
    for side in (left, right):
        if side is None:
            continue
        if isinstance(side, bool) or not isinstance(side, int | np.integer):
            raise TypeError(f"window must be {expected}; got window={window!r}")
        if side < 0:
            raise ValueError(f"window must be {expected}; got window={window!r}")
    # A side reaching 2^32 - 1 reaches every int32 position from any other: unbounded
    # (and never a constant past int32 in the kernels).
    left = None if left is None or left >= _REACHES_ALL else int(left)
    right = None if right is None or right >= _REACHES_ALL else int(right)
    if causal:
        right = 0 if right is None else min(right, 0)
    return Window(left, right)
