"""The Pallas TPU kernel family (`"pallas_tpu"`): Mosaic kernels on a TPU, Pallas'
interpreter elsewhere.

It runs the forward and the backward of what it covers (`covers`); forward mode and
second order pair its forward with the xla family's tangent kernels, and its backward
with theirs where the backward is differentiated again (Mosaic kernels have no
derivative of their own: `dispatch.differentiable`). Its configuration (`configure`)
starts from the xla family's (split-K, heads, compute dtype) and sets its own blocks:
large ones, in multiples of the TPU's `(8, 128)` tiles (`policy`).
"""

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array

from ..._core.config import KernelConfig, stat_dtype
from ..._core.operands import Operands
from ..._mods.position_bias import RelativeScoreMod
from ..contract import Call, KernelFamily, Machine
from ..xla.policy import configure as xla_configure
from . import backward as _backward
from . import forward as _forward
from . import tangent as _tangent
from ._relative import MAX_VECTOR_BYTES, MULTIPLE, vector_bytes
from ._tile_mods import uncovered
from .policy import blocks, with_block_mask

# Head dims the kernels take: a dim that is not a multiple of the 128 lanes is padded
# with zeros up to one (64 runs as it is).
MAX_DIM = 256


def configure(call: Call, machine: Machine, split_k: bool) -> KernelConfig:
    """The xla family's configuration (flash-decoding, heads, compute dtype) with this
    family's blocks, unless the call runs split-K (then not covered)."""
    cfg = xla_configure(call, machine, split_k)
    if cfg.split_k:
        return cfg
    block_q, block_k = blocks(call, cfg)
    return dataclasses.replace(cfg, block_q=block_q, block_k=block_k,
                               compute_dtype=jnp.dtype(call.dtype))


def covers(cfg: KernelConfig, call: Call) -> str | None:
    """None where the kernels run `call`, else what they lack."""
    stat = stat_dtype(call.dtype)
    unsupported = [
        (cfg.split_k, "few queries against many keys (the xla family's split-K kernel)"),
        (call.block_mask is not None and with_block_mask(call, (cfg.block_q, cfg.block_k))
         is None, f"a block_mask built at blocks {call.block_mask} (neither dividing the "
         f"kernels' blocks {(cfg.block_q, cfg.block_k)} nor whole TPU tiles of 16 query "
         "rows and 128 keys)"),
        (jnp.dtype(call.dtype) == jnp.float64, "float64 inputs (a TPU has no float64)"),
        (call.shapes.dim > MAX_DIM or call.shapes.dim_v > MAX_DIM,
         f"head dims above {MAX_DIM}"),
    ]
    if isinstance(call.score_mod, RelativeScoreMod):
        unsupported += [
            (cfg.block_q % MULTIPLE != 0, f"a RelativeScoreMod with a block_mask built at "
             f"query blocks of {cfg.block_q} (its term needs blocks of whole {MULTIPLE}s)"),
            (vector_bytes(cfg, call.shapes.groups) > MAX_VECTOR_BYTES,
             "a RelativeScoreMod at sequences whose bias vectors do not fit in VMEM"),
        ]
    reasons = [reason for missing, reason in unsupported if missing]
    # A score_mod / mask_mod: what Mosaic can run of it (`_tile_mods.uncovered`).
    reasons += [reason for reason in (
        uncovered("score_mod", call.score_mod, call.shapes.groups, stat),
        uncovered("mask_mod", call.mask_mod, call.shapes.groups, stat))
        if reason is not None]
    return None if not reasons else "; ".join(reasons)


def _lanes(dim: int) -> int:
    return dim if dim == 64 or dim % 128 == 0 else -(-dim // 128) * 128


def _pad_dim(x: Array, dim: int) -> Array:
    return x if x.shape[-1] == dim else jnp.pad(x, [(0, 0)] * (x.ndim - 1)
                                                + [(0, dim - x.shape[-1])])


def forward(cfg: KernelConfig, q: Array, k: Array, v: Array, ops: Operands
            ) -> tuple[Array, Array, Array]:
    """`_forward.forward` with head dims padded to whole lanes (zeros: the same logits;
    padded value columns cut off)."""
    d, dv = _lanes(q.shape[-1]), _lanes(v.shape[-1])
    out, lse, max_score = _forward.forward(cfg, _pad_dim(q, d), _pad_dim(k, d),
                                           _pad_dim(v, dv), ops)
    return out[..., : v.shape[-1]], lse, max_score


def backward(cfg: KernelConfig, q: Array, k: Array, v: Array, ops: Operands, lse: Array,
             delta: Array, d_out: Array, wanted: Operands
             ) -> tuple[Array, Array, Array, Operands]:
    d, dv = _lanes(q.shape[-1]), _lanes(v.shape[-1])
    dq, dk, d_v, d_ops = _backward.backward(
        cfg, _pad_dim(q, d), _pad_dim(k, d), _pad_dim(v, dv), ops, lse, delta,
        _pad_dim(d_out, dv), wanted)
    return dq[..., : q.shape[-1]], dk[..., : k.shape[-1]], d_v[..., : v.shape[-1]], d_ops


def forward_and_tangent(cfg: KernelConfig, q: Array, k: Array, v: Array, ops: Operands,
                        dq: Array | None, dk: Array | None, dv: Array | None,
                        d_ops: Operands) -> tuple[Array, Array, Array, Array, Array]:
    d, d_v = _lanes(q.shape[-1]), _lanes(v.shape[-1])
    pad = _pad_dim
    out, lse, max_score, d_out, d_lse = _tangent.forward_and_tangent(
        cfg, pad(q, d), pad(k, d), pad(v, d_v), ops, None if dq is None else pad(dq, d),
        None if dk is None else pad(dk, d), None if dv is None else pad(dv, d_v), d_ops)
    return out[..., : v.shape[-1]], lse, max_score, d_out[..., : v.shape[-1]], d_lse


FAMILY = KernelFamily(
    name="pallas_tpu",
    covers=covers,
    forward=forward,
    backward=backward,
    forward_and_tangent=forward_and_tangent,
    configure=configure,
    differentiable=False,
    # A mask_mod's block summary narrows the plan (`_plan`): the blocks it empties are
    # never visited; a user's `block_mask` at smaller blocks is read coarsened.
    reads_block_flags=True,
    coarsens_block_mask=True,
    plans_when_traced=True,
)
