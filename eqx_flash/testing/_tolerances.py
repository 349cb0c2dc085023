"""The one tolerance table: how close attention must come to `plain_attention`, per
input dtype."""

import dataclasses
from typing import Any

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """`|got - expected| <= atol * size + rtol * |expected|` elementwise, where `size` is 1
    for `out` and `lse` and the largest `|expected|` of the tensor for gradients (whose
    magnitude grows with the sequence lengths)."""

    out: tuple[float, float]
    lse: tuple[float, float]
    grad: tuple[float, float]


# (atol, rtol) per input dtype, calibrated on CPU: over 40 drawn problems the worst error of
# flash_attention against plain_attention was at most a third of these (out in bfloat16 and
# float16; a twentieth for gradients). lse is float32 for every input dtype and the logits
# are exact products of the inputs accumulated in float32, so its tolerance stays tight.
# On GPU, float32 matmuls default to TF32: pass `tolerance=` or raise the matmul precision.
TOLERANCES: dict[Any, Tolerance] = {
    jnp.dtype(jnp.float64): Tolerance(out=(1e-10, 1e-10), lse=(1e-10, 1e-10), grad=(1e-9, 1e-9)),
    jnp.dtype(jnp.float32): Tolerance(out=(2e-5, 2e-5), lse=(2e-5, 2e-5), grad=(1e-4, 1e-4)),
    jnp.dtype(jnp.float16): Tolerance(out=(2e-3, 2e-3), lse=(1e-4, 1e-4), grad=(5e-3, 5e-3)),
    jnp.dtype(jnp.bfloat16): Tolerance(out=(2e-2, 2e-2), lse=(1e-4, 1e-4), grad=(4e-2, 4e-2)),
}
