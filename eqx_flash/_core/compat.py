"""The few JAX APIs whose spelling changed between the oldest supported jax (0.7.0) and the
newest; everything else the package uses is common to all of them.

| here | newest jax | jax 0.7.x |
| --- | --- | --- |
| `pcast_varying(x, axes)` | `lax.pcast(x, axes, to="varying")` | `lax.pvary(x, axes)` |
| `varying_axes(x)` | `jax.typeof(x).manual_axis_type.varying` | `jax.typeof(x).vma` |
| `varying_struct(shape, dtype, axes)` | `ShapeDtypeStruct(manual_axis_type=)` | `(vma=)` |
| `set_current_trace` | `jax.extend.core.set_current_trace` | `jax._src.core`'s |
| `register_dce_rule(p, rule)` | rules take `(used, live_ins, eqn)` (0.12) | `(used, eqn)` |

`jax.shard_map(..., check_vma=)`, `jax.typeof`, `jax.lax.axis_size` and `jax.tree.*`
exist under these names from jax 0.6.1 on, so they are used directly. The floor is 0.7.0
because on 0.6.x `zeros_like` drops the varying mesh axes, so the kernels' accumulators
break `shard_map(check_vma=True)` (see the README's "Supported versions").
"""

from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.extend.core
from jax.interpreters import partial_eval as pe
from jaxtyping import Array

if hasattr(jax.extend.core, "set_current_trace"):
    set_current_trace = jax.extend.core.set_current_trace
else:  # jax 0.7: not yet exported (the same function)
    from jax._src.core import set_current_trace  # noqa: F401


def pcast_varying(x: Array, axes: tuple[Hashable, ...]) -> Array:
    """Mark `x` as varying over the manual mesh axes `axes` (inside `shard_map` with
    `check_vma=True`), as `lax.pcast(x, axes, to="varying")` does on new jax."""
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axes, to="varying")
    # Older jax: the same operation under its former name (gone from new jax).
    return jax.lax.pvary(x, axes)  # pyright: ignore[reportAttributeAccessIssue]


def varying_axes(x: Array) -> frozenset[Hashable]:
    """The manual mesh axes `x` varies over inside `shard_map` with `check_vma=True`
    (empty outside `shard_map` or with `check_vma=False`)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))  # older jax: the same set, named `vma`


def varying_struct(shape: tuple[int, ...], dtype, axes: frozenset[Hashable]
                   ) -> jax.ShapeDtypeStruct:
    """`jax.ShapeDtypeStruct(shape, dtype)` varying over the manual mesh axes `axes` (a
    `pallas_call`'s output inside `shard_map` with `check_vma=True` must say how it
    varies); a plain one when `axes` is empty."""
    if not axes:
        return jax.ShapeDtypeStruct(shape, dtype)
    like = jax.typeof(pcast_varying(jax.numpy.zeros((), dtype), tuple(sorted(axes, key=str))))
    manual = getattr(like, "manual_axis_type", None)
    if manual is not None:
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=manual)
    return jax.ShapeDtypeStruct(shape, dtype, vma=like.vma)  # pyright: ignore


def register_dce_rule(primitive: Any, rule: Callable[[list[bool], Any], Any]) -> None:
    """Register `rule(used_outputs, eqn) -> (used_inputs, new_eqn | None)` as
    `primitive`'s dead-code rule; jax 0.12 passes which inputs are live before the eqn
    (the package's primitives have no effects, so their rules do not read it)."""
    pe.dce_rules[primitive] = lambda used, *args: rule(used, args[-1])


def unsharded(x: Array) -> bool:
    """Whether `x`'s type carries no mesh: no varying manual axes (`shard_map`) and no
    sharding of its own (`jax.sharding.use_mesh` / `jax.set_mesh`)."""
    if varying_axes(x):
        return False
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    return mesh is None or bool(getattr(mesh, "empty", True))
