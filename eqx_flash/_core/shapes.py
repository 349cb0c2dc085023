"""Array shapes: the problem's sizes (`Shapes`), and the internal five-axis layout.

Internally q is `(batch, kv_heads, groups, seq_q, dim)` and k, v are
`(batch, kv_heads, seq_k, dim)`: grouped-query heads sit on their kv head, so k and v are
never repeated. Masks and ids keep size-1 axes wherever they broadcast, so a mask shared
by all heads is never copied per head.
"""

import dataclasses
import math
from typing import Literal

import jax.numpy as jnp
from jaxtyping import Array


@dataclasses.dataclass(frozen=True)
class Shapes:
    batch_shape: tuple[int, ...]  # q's leading axes before the heads axis
    heads: int  # 1 when q has no leading axes at all
    kv_heads: int
    seq_q: int
    seq_k: int
    dim: int
    dim_v: int
    has_heads_axis: bool

    @property
    def batch(self) -> int:
        return math.prod(self.batch_shape)

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads

    @property
    def lead_shape(self) -> tuple[int, ...]:
        """q's leading axes, heads included: the shape masks broadcast against."""
        return (*self.batch_shape, self.heads) if self.has_heads_axis else ()


# Said by every error about q, k and v's shapes: jax.nn's `(batch, seq, heads, dim)`
# passed here has the right rank and, when the sizes happen to fit, raises nothing.
LAYOUT = ("Layout: q is (*batch, heads, seq_q, dim), k and v (*batch, kv_heads, seq_k, dim): "
          "heads before seq. For jax.nn's (batch, seq, heads, dim), call "
          "eqx_flash.dot_product_attention.")
def ceil_div(n, block):
    """`n / block` rounded up (ints or integer arrays): how many blocks of `block` hold
    `n`."""
    return -(-n // block)


def shapes_of(q: Array, k: Array, v: Array) -> Shapes:
    """Read the problem's sizes, raising on inconsistent shapes (names and values shown,
    then the layout)."""
    try:
        return _shapes_of(q, k, v)
    except ValueError as error:
        raise ValueError(f"{error}\n{LAYOUT}") from None


def _shapes_of(q: Array, k: Array, v: Array) -> Shapes:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim < 2:
            raise ValueError(
                f"{name} must have shape (*batch, seq, dim) with at least 2 axes; "
                f"got {name}.shape={x.shape}"
            )
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(
            "q, k and v must have the same number of axes; "
            f"got q.shape={q.shape}, k.shape={k.shape}, v.shape={v.shape}"
        )
    *q_lead, seq_q, dim = q.shape
    *k_lead, seq_k, k_dim = k.shape
    *v_lead, v_seq, dim_v = v.shape
    if k_dim != dim:
        raise ValueError(
            f"q and k must have the same head dim; got q.shape={q.shape} (dim={dim}), "
            f"k.shape={k.shape} (dim={k_dim})"
        )
    if v_seq != seq_k:
        raise ValueError(
            f"k and v must have the same sequence length; got k.shape={k.shape} "
            f"(seq_k={seq_k}), v.shape={v.shape} (seq_k={v_seq})"
        )
    if tuple(v_lead) != tuple(k_lead):
        raise ValueError(
            f"k and v must have the same leading axes; got k.shape={k.shape}, "
            f"v.shape={v.shape}"
        )
    for name, n in (("seq_q", seq_q), ("seq_k", seq_k), ("dim", dim), ("dim_v", dim_v)):
        if n == 0:
            raise ValueError(f"{name} must be positive; got q.shape={q.shape}, "
                             f"k.shape={k.shape}, v.shape={v.shape}")
    if not q_lead:
        return Shapes((), 1, 1, seq_q, seq_k, dim, dim_v, has_heads_axis=False)
    *batch_shape, heads = q_lead
    *k_batch, kv_heads = k_lead
    if tuple(k_batch) != tuple(batch_shape):
        raise ValueError(
            "q and k must have the same leading (batch) axes before the heads axis; "
            f"got q.shape={q.shape}, k.shape={k.shape}"
        )
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(
            "the heads axis (third from last) of k and v must divide q's "
            f"(grouped-query attention); got q heads={heads}, k/v heads={kv_heads} "
            f"(q.shape={q.shape}, k.shape={k.shape})"
        )
    return Shapes(tuple(batch_shape), heads, kv_heads, seq_q, seq_k, dim, dim_v, True)


def split_heads(q: Array, k: Array, v: Array, shapes: Shapes) -> tuple[Array, Array, Array]:
    q = q.reshape(shapes.batch, shapes.kv_heads, shapes.groups, shapes.seq_q, shapes.dim)
    k = k.reshape(shapes.batch, shapes.kv_heads, shapes.seq_k, shapes.dim)
    v = v.reshape(shapes.batch, shapes.kv_heads, shapes.seq_k, shapes.dim_v)
    return q, k, v


def merge_heads(out: Array, lse: Array, shapes: Shapes) -> tuple[Array, Array]:
    lead = shapes.lead_shape
    return out.reshape(*lead, shapes.seq_q, shapes.dim_v), lse.reshape(*lead, shapes.seq_q)


MaskKind = Literal["keys", "queries", "pairs"]


def mask_to_internal(x: Array, shapes: Shapes, kind: MaskKind, name: str) -> Array:
    """Bring a mask or ids array to `(batch|1, kv_heads|1, groups|1, seq_q|1, seq_k|1)`.

    `keys`/`queries` arrays are `(*lead, seq)` and may omit the heads axis (seed style:
    a `(batch, seq_k)` mask for `(batch, heads, seq, dim)` inputs); `pairs` arrays follow
    NumPy broadcasting against `(*batch, heads, seq_q, seq_k)`.
    """
    trailing = 2 if kind == "pairs" else 1
    target_lead = shapes.lead_shape
    if kind == "pairs":
        expected = f"broadcastable to {(*target_lead, shapes.seq_q, shapes.seq_k)}"
    else:
        seq = shapes.seq_k if kind == "keys" else shapes.seq_q
        expected = f"(*batch, [heads,] {seq}) with leading axes broadcastable to {target_lead}"
    if x.ndim < trailing:
        raise ValueError(f"{name} must have shape {expected}; got {name}.shape={x.shape}")
    lead, tail = x.shape[: x.ndim - trailing], x.shape[x.ndim - trailing :]
    if kind != "pairs" and shapes.has_heads_axis and len(lead) < len(target_lead):
        lead = (*lead, 1)  # no heads axis given: shared by all heads
    if len(lead) > len(target_lead):
        raise ValueError(f"{name} must have shape {expected}; got {name}.shape={x.shape}")
    lead = (1,) * (len(target_lead) - len(lead)) + lead
    if any(a not in (1, b) for a, b in zip(lead, target_lead, strict=True)):
        raise ValueError(f"{name} must have shape {expected}; got {name}.shape={x.shape}")
    if kind == "keys":
        tail_ok, tail = tail == (shapes.seq_k,), (1, shapes.seq_k)
    elif kind == "queries":
        tail_ok, tail = tail == (shapes.seq_q,), (shapes.seq_q, 1)
    else:
        tail_ok = tail[0] in (1, shapes.seq_q) and tail[1] in (1, shapes.seq_k)
    if not tail_ok:
        raise ValueError(f"{name} must have shape {expected}; got {name}.shape={x.shape}")
    x = x.reshape(*lead, *tail)
    if not shapes.has_heads_axis:
        return x.reshape(1, 1, 1, *tail)
    batch_lead, head = lead[:-1], lead[-1]
    if all(n == 1 for n in batch_lead):
        x = x.reshape(1, head, *tail)
    else:
        x = jnp.broadcast_to(x, (*shapes.batch_shape, head, *tail))
        x = x.reshape(shapes.batch, head, *tail)
    if head == 1:
        return x.reshape(x.shape[0], 1, 1, *tail)
    return x.reshape(x.shape[0], shapes.kv_heads, shapes.groups, *tail)
