"""The one tolerance table: how close attention must come to `plain_attention`, per
input dtype, at the matmul precision the checks compare at, with one factor per backend."""

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """`|got - expected| <= atol * size + rtol * |expected|` elementwise, where `size` is 1
    for `out` and `lse` and the largest `|expected|` of the tensor for gradients (whose
    magnitude grows with the sequence lengths)."""

    out: tuple[float, float]
    lse: tuple[float, float]
    grad: tuple[float, float]

    def scaled(self, factor: float) -> "Tolerance":
        """Every bound (atol and rtol of each quantity) times `factor`."""
        if factor == 1.0:
            return self

        def times(pair: tuple[float, float]) -> tuple[float, float]:
            return pair[0] * factor, pair[1] * factor

        return Tolerance(out=times(self.out), lse=times(self.lse), grad=times(self.grad))


PRECISION = "highest"
"""The matmul precision the checks compare at (`check_attention(precision=)`, `python -m
eqx_flash`, the test suite), which `TOLERANCES` is calibrated for: both sides run under
`jax.default_matmul_precision(PRECISION)`. At JAX's default precision a float32 matmul on
TPU runs in bfloat16 passes (on GPU in TF32), so two correct attentions differ there by
~1e-3 in outputs and ~1e-2 in gradients; at "highest" they agree to float32 round-off on
every backend. On CPU the two precisions compile to the same program."""

# (atol, rtol) per input dtype, calibrated on CPU: over 40 drawn problems the worst error of
# flash_attention against plain_attention was at most a third of these (out in bfloat16 and
# float16; a twentieth for gradients). lse is float32 for every input dtype and the logits
# are exact products of the inputs accumulated in float32, so its tolerance stays tight.
TOLERANCES: dict[Any, Tolerance] = {
    jnp.dtype(jnp.float64): Tolerance(out=(1e-10, 1e-10), lse=(1e-10, 1e-10), grad=(1e-9, 1e-9)),
    jnp.dtype(jnp.float32): Tolerance(out=(2e-5, 2e-5), lse=(2e-5, 2e-5), grad=(1e-4, 1e-4)),
    jnp.dtype(jnp.float16): Tolerance(out=(2e-3, 2e-3), lse=(1e-4, 1e-4), grad=(5e-3, 5e-3)),
    jnp.dtype(jnp.bfloat16): Tolerance(out=(2e-2, 2e-2), lse=(1e-4, 1e-4), grad=(4e-2, 4e-2)),
}

# How much wider than `TOLERANCES` a backend needs at `PRECISION`, the only place such a
# factor lives. TPU: at "highest" the float32 matmuls are a multi-pass bfloat16 product and
# the transcendentals are the TPU's own, so results are float32-accurate but not CPU's
# round-off: on a TPU v5e (2026-12-06, main at b414755) 26 of 27 `test_against_reference.py`
# cases passed with the CPU table and the 27th missed by 3.6e-5 against atol 2e-5 (1.8x);
# 4 leaves a margin of two over that. Other backends are unmeasured: a GPU at "highest"
# computes float32 matmuls in float32 (no TF32), so it keeps the CPU table until measured.
BACKEND_FACTORS: dict[str, float] = {"tpu": 4.0}


def backend_factor(backend: str | None = None) -> float:
    """`BACKEND_FACTORS[backend]` (default: JAX's default backend), 1 if absent."""
    return BACKEND_FACTORS.get(jax.default_backend() if backend is None else backend, 1.0)


def tolerance_for(dtype: Any, backend: str | None = None) -> Tolerance:
    """The tolerance for inputs of `dtype` on `backend` (default: JAX's default backend):
    `TOLERANCES[dtype]` scaled by the backend's factor (`BACKEND_FACTORS`, 1 if absent).
    Calibrated for comparisons at `PRECISION`."""
    return TOLERANCES[jnp.dtype(dtype)].scaled(backend_factor(backend))


@contextlib.contextmanager
def at_precision(precision: str | None) -> Iterator[None]:
    """`jax.default_matmul_precision(precision)` around the block, or nothing for None; a
    value JAX does not know is a `ValueError` naming the argument."""
    if precision is None:
        yield
        return
    try:
        context = jax.default_matmul_precision(precision)
        context.__enter__()
    except ValueError:
        raise ValueError(f"precision must be None or a JAX matmul precision ('highest', "
                         f"'high', 'default', ...); got {precision!r}") from None
    try:
        yield
    finally:
        context.__exit__(None, None, None)
