"""The pure-JAX kernel family (`"xla"`): blockwise loops that XLA compiles for any
backend, the reference every other family pairs with and falls back to."""

from ..._core.config import KernelConfig
from ..contract import Call, KernelFamily
from .backward import backward
from .forward import forward
from .policy import configure
from .split_k import split_k_forward
from .tangent import forward_and_tangent, tangent


def covers(cfg: KernelConfig, call: Call) -> str | None:
    """The pure-JAX kernels run every call."""
    del cfg, call
    return None


FAMILY = KernelFamily(
    name="xla",
    covers=covers,
    forward=forward,
    backward=backward,
    tangent=tangent,
    forward_and_tangent=forward_and_tangent,
    split_k_forward=split_k_forward,
    configure=configure,
)
