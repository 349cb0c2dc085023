"""The kernel choice, made once per call: which family runs it and how it is configured.

`choose` asks the families in turn (a requested one, or `default_order`) for their
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
from .._core.options import KERNEL_FAMILIES
from .contract import Call, KernelFamily, Kernels, Machine
from .pallas_tpu.family import FAMILY as PALLAS_TPU
from .xla.family import FAMILY as XLA

FAMILIES: dict[str, KernelFamily] = {XLA.name: XLA, PALLAS_TPU.name: PALLAS_TPU}
assert tuple(FAMILIES) == KERNEL_FAMILIES  # the names `make_options` accepts


def default_order(machine: Machine) -> tuple[str, ...]:
    """The families `kernels=None` tries, in order; the last (xla) covers every call. On
    one TPU the Pallas kernels first; under several devices (meshes, `shard_map`) the
    pure-JAX kernels, whose sharding XLA's partitioner handles."""
    if machine.backend == "tpu" and machine.device_count == 1:
        return (PALLAS_TPU.name, XLA.name)
    return (XLA.name,)


def machine() -> Machine:
    """The machine facts a choice reads, once (lowering for another platform is the
    caller's business: these are the default backend's)."""
    return Machine(backend=jax.default_backend(), device_count=jax.device_count())


def choose(call: Call, kernels: str | None = None, *, split_k: bool = True) -> KernelConfig:
    """The `KernelConfig` of `call`: the first family of `default_order` that covers it
    (`kernels=None`), or the one named by `kernels`, configured by that family.
    `split_k=False` rules flash-decoding out (the ring's chunk pairs).

    Raises `ValueError` naming `kernels` for an unknown family, and
    `NotImplementedError` naming it when the requested family does not cover the call.
    """
    if kernels is not None and (not isinstance(kernels, str) or kernels not in FAMILIES):
        names = ", ".join(repr(n) for n in FAMILIES)
        raise ValueError(f"kernels must be None or one of {names}; got kernels={kernels!r}")
    facts = machine()
    for name in default_order(facts) if kernels is None else (kernels,):
        cfg = _configured(name, call, facts, split_k)
        reason = _passed_over(name, cfg, call, kernels)
        if reason is None:
            return cfg
        if kernels is not None:
            raise NotImplementedError(
                f"kernels={kernels!r} does not cover this call: {reason}")
    raise AssertionError("the xla family covers every call")


def _passed_over(name: str, cfg: KernelConfig, call: Call, kernels: str | None
                 ) -> str | None:
    """Why family `name` does not run `call` (None: it does): what it does not cover, or,
    for `kernels=None`, what it covers but the default choice passes over."""
    family = FAMILIES[name]
    reason = family.covers(cfg, call)
    if reason is None and kernels is None and family.passes_over is not None:
        passed = family.passes_over(call)
        if passed is not None:
            reason = f"{passed} (run them with kernels={name!r})"
    return reason


def why(call: Call, kernels: str | None = None) -> tuple[str | None, str]:
    """`(family, reason)`: the family `choose` takes for `call` and why, or `(None, what
    the requested family lacks)` (`eqx_flash.kernel_family`)."""
    try:
        cfg = choose(call, kernels)
    except NotImplementedError as error:
        return None, str(error)
    if kernels is not None:
        return cfg.family, f"kernels={kernels!r} was asked for, and it covers the call"
    facts = machine()
    order = default_order(facts)
    passed = [f"{name} passes it over: "
              f"{_passed_over(name, _configured(name, call, facts), call, None)}"
              for name in order[: order.index(cfg.family)]]
    if passed:
        return cfg.family, "; ".join(passed)
    if len(order) > 1:
        return cfg.family, f"the first default here ({', '.join(order)}), and it covers the call"
    return cfg.family, (f"the only default on {facts.device_count} {facts.backend} device(s); "
                        "the Pallas kernels are the default on one TPU")


def _configured(name: str, call: Call, facts: Machine, split_k: bool = True) -> KernelConfig:
    """`call` configured by family `name` (xla's policy where it has none), recorded."""
    family = FAMILIES[name]
    configure = family.configure or _xla().configure
    assert configure is not None
    return dataclasses.replace(configure(call, facts, split_k), family=name)


def differentiable(cfg: KernelConfig) -> KernelConfig:
    """`cfg` for kernels that are differentiated again (second order: `jax.jvp` of the
    first-order kernels): a family whose kernels JAX cannot differentiate (Mosaic
    kernels) hands those to the xla family, which reads the same arrays."""
    if FAMILIES[cfg.family].differentiable:
        return cfg
    return dataclasses.replace(cfg, family=XLA.name)


def reads_block_flags(cfg: KernelConfig) -> bool:
    """Whether the family `cfg` records reads a `mask_mod`'s block summary."""
    return FAMILIES[cfg.family].reads_block_flags


def coarsens_block_mask(cfg: KernelConfig) -> bool:
    """Whether the family `cfg` records reads a `block_mask` built at smaller blocks than
    its own (which divide them), coarsened."""
    return FAMILIES[cfg.family].coarsens_block_mask


def plans_when_traced(cfg: KernelConfig) -> bool:
    """Whether the family `cfg` records plans its grid by a block summary known when
    traced (`KernelConfig.block_summary`)."""
    return FAMILIES[cfg.family].plans_when_traced


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
