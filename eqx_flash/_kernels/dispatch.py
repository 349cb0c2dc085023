"""The kernel choice, made once per call: which family runs it and how it is configured.

`choose` asks the families in turn (a requested one, or `DEFAULT_ORDER`) for their
configuration of the call and whether they cover it, and records the answer in the
static `KernelConfig` (`family`, block sizes, split-K, heads in parallel, compute
dtype). Everything downstream — the forward wiring (`_api.flash`), the derivative rules
(`_autodiff`), the ring and the sharded strategies (`_distributed`) — finds its kernels
with `family_of(cfg)` and never imports a kernel itself, so a call's pieces run the
family chosen for it, and a new family is one entry in `FAMILIES` (`contract` says what
it provides).
"""

import dataclasses

import jax
from jaxtyping import Array

from .._core.config import KernelConfig
from .._core.operands import Operands
from .contract import Call, KernelFamily, Kernels, Machine
from .xla.family import FAMILY as XLA

FAMILIES: dict[str, KernelFamily] = {XLA.name: XLA}
# The families `kernels=None` tries, in order; the last covers every call.
DEFAULT_ORDER: tuple[str, ...] = (XLA.name,)


def machine() -> Machine:
    """The machine facts a choice reads, once (lowering for another platform is the
    caller's business: these are the default backend's)."""
    return Machine(backend=jax.default_backend(), device_count=jax.device_count())


def choose(call: Call, kernels: str | None = None, *, split_k: bool = True) -> KernelConfig:
    """The `KernelConfig` of `call`: the first family of `DEFAULT_ORDER` that covers it
    (`kernels=None`), or the one named by `kernels`, configured by that family.
    `split_k=False` rules flash-decoding out (the ring's chunk pairs).

    Raises `ValueError` naming `kernels` for an unknown family, and
    `NotImplementedError` naming it when the requested family does not cover the call.
    """
    if kernels is not None and (not isinstance(kernels, str) or kernels not in FAMILIES):
        names = ", ".join(repr(n) for n in FAMILIES)
        raise ValueError(f"kernels must be None or one of {names}; got kernels={kernels!r}")
    facts = machine()
    for name in DEFAULT_ORDER if kernels is None else (kernels,):
        family = FAMILIES[name]
        configure = family.configure or _xla().configure
        assert configure is not None
        cfg = dataclasses.replace(configure(call, facts, split_k), family=name)
        reason = family.covers(cfg, call)
        if reason is None:
            return cfg
        if kernels is not None:
            raise NotImplementedError(
                f"kernels={kernels!r} does not cover this call: {reason}")
    raise AssertionError(f"no family of DEFAULT_ORDER={DEFAULT_ORDER} covers the call")


def family_of(cfg: KernelConfig) -> Kernels:
    """The kernels of the family `cfg` records, the xla family's where it has none."""
    family, xla = FAMILIES[cfg.family], _xla()

    def piece(name: str):
        chosen = getattr(family, name)
        return getattr(xla, name) if chosen is None else chosen

    return Kernels(*(piece(name) for name in Kernels._fields))


def forward(cfg: KernelConfig, q: Array, k: Array, v: Array, ops: Operands
            ) -> tuple[Array, Array, Array]:
    """The forward kernel `cfg` chose: the split-K one where `cfg.split_k`, else the
    regular one (`contract.ForwardKernel`)."""
    kernels = family_of(cfg)
    attention = kernels.split_k_forward if cfg.split_k else kernels.forward
    return attention(cfg, q, k, v, ops)


def _xla() -> KernelFamily:
    return FAMILIES[XLA.name]
