"""The loop over heads: kernels run one kv head at a time.

Per kv head, q is `(groups, seq_q, dim)` against k, v `(seq_k, dim)`: every block product
is then a plain 2-d matmul, the form XLA's CPU GEMM runs fastest (batched products of the
same size measured 2-3x slower per FLOP).
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array

from ..._core.operands import Operands, combine, per_head_part
from ..._semantics.dropout import flat_head_index


class Head(NamedTuple):
    """What one kv head's kernel sees besides its q, k, v slices."""

    # The call's operands, the per-head ones sliced: `GRID` fields `(groups|1, seq_q|1,
    # seq_k|1)`, `BLOCKS` fields `(1, num_q, num_k)`; `SHARED` ones whole.
    operands: Operands
    head_ids: Array  # flat q-head index of each group, `(groups, 1, 1)`
    # Forward mode: tangents of the differentiable operands, shaped as `operands` (None
    # where zero).
    tangents: Operands | None = None


HeadKernel = Callable[..., Any]  # (head, per-head arrays[, Rows of the whole arrays])


class Rows(NamedTuple):
    """One kv head's `(seq, dim)` rows of a `(batch, kv_heads, seq, dim)` array, read a
    slice at a time: `rows(start, size)`. The loop over heads hands kernels these instead
    of the head's slice where the array is large and read once (a long KV cache): slicing
    the head out first would copy all of it."""

    x: Array
    b: Array | None = None  # None: `x` is already the head's `(seq, dim)`
    h: Array | None = None

    def __call__(self, start: Array | int, size: int) -> Array:
        if self.b is None or self.h is None:
            return jax.lax.dynamic_slice_in_dim(self.x, start, size, axis=0)
        dim = self.x.shape[-1]
        # One index dtype for all four (under jax_enable_x64 a Python int is int64).
        index = tuple(jnp.asarray(i, jnp.int32) for i in (self.b, self.h, start, 0))
        return jax.lax.dynamic_slice(self.x, index, (1, 1, size, dim))[0, 0]

    @property
    def seq(self) -> int:
        return self.x.shape[-2]


def per_head(
    fn: HeadKernel, operands: Operands, arrays: tuple[Array, ...], *, parallel: bool,
    whole: tuple[Array, ...] = (), tangents: Operands | None = None,
) -> Any:
    """Map `fn(head, per_head_arrays)` over the `(batch, kv_heads)` axes of `arrays`
    (all have them first); results are stacked back on those axes. The per-head operands
    (and their `tangents`) have those axes too, or size 1 where they broadcast; the
    `SHARED` ones reach every head whole. Arrays in `whole` reach `fn` as a third
    argument, one `Rows` each, instead of being sliced per head.

    `parallel` (`KernelConfig.parallel_heads`, `policy.heads_in_parallel`): `vmap`, else
    a `lax.map` loop (one CPU device: 2-d block matmuls, the fastest form there).
    """
    batch, kv_heads = arrays[0].shape[:2]
    groups = arrays[0].shape[2] if arrays[0].ndim == 5 else 1
    sliced, shared = per_head_part(operands)
    d_sliced, d_shared = per_head_part(Operands() if tangents is None else tangents)

    def one(b: Array, h: Array, xs: tuple[Array, ...], ops_bh: Operands,
            d_ops_bh: Operands) -> Any:
        head = Head(combine(ops_bh, shared), flat_head_index(b, h, kv_heads, groups),
                    None if tangents is None else combine(d_ops_bh, d_shared))
        if not whole:
            return fn(head, xs)
        if len(xs) > len(arrays):  # vmapped: the whole arrays came sliced per head
            return fn(head, xs[: len(arrays)], tuple(Rows(x) for x in xs[len(arrays):]))
        return fn(head, xs, tuple(Rows(x, b, h) for x in whole))

    if parallel:
        return _vmapped(one, (sliced, d_sliced), arrays + whole)
    flat = tuple(x.reshape(batch * kv_heads, *x.shape[2:]) for x in arrays)

    def take(m: Array, b: Array, h: Array) -> Array:
        m = m[b] if m.shape[0] != 1 else m[0]
        return m[h] if m.shape[0] != 1 else m[0]

    def looped(args):
        n, xs = args
        b, h = n // kv_heads, n % kv_heads
        ops_bh, d_ops_bh = jax.tree.map(lambda m: take(m, b, h), (sliced, d_sliced))
        return one(b, h, xs, ops_bh, d_ops_bh)

    out = jax.lax.map(looped, (jnp.arange(batch * kv_heads, dtype=jnp.int32), flat))
    return jax.tree.map(lambda y: y.reshape(batch, kv_heads, *y.shape[1:]), out)


def _vmapped(one: Callable[..., Any], per_head_ops: Any, arrays: tuple[Array, ...]) -> Any:
    """`per_head` as two nested `vmap`s; operands with a size-1 leading axis are the same
    for every index (squeezed, not mapped over)."""
    batch, kv_heads = arrays[0].shape[:2]

    def split(tree: Any) -> tuple[Any, Any]:
        mapped = jax.tree.map(lambda m: None if m.shape[0] == 1 else m, tree)
        common = jax.tree.map(lambda m: m[0] if m.shape[0] == 1 else None, tree)
        return mapped, common

    def merge(mapped: Any, common: Any) -> Any:
        return jax.tree.map(lambda a, b: a if a is not None else b, mapped, common,
                            is_leaf=lambda x: x is None)

    def one_batch(b, xs, ops_b):
        mapped, common = split(ops_b)
        return jax.vmap(lambda h, xs, m: one(b, h, xs, *merge(m, common)))(
            jnp.arange(kv_heads, dtype=jnp.int32), xs, mapped
        )

    mapped, common = split(per_head_ops)
    return jax.vmap(lambda b, xs, m: one_batch(b, xs, merge(m, common)))(
        jnp.arange(batch, dtype=jnp.int32), arrays, mapped
    )
