"""One `pallas_call` over a block plan, as every kernel of this family makes it.

The grid is `(batch, kv head, outer block, step)`; the plan's tables (`kv_block` or
`q_block`, and `flag`) and the operands' scalar tables are prefetched into SMEM, the
operands' block arrays follow the kernel's own inputs, the outputs vary over the mesh
axes the inputs vary over (inside a user's `shard_map` with `check_vma=True` a
`pallas_call` must be told), and the scoped VMEM limit is raised to what the blocks need.
`split_refs` undoes that order inside a kernel.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array

from ..._core.compat import varying_axes, varying_struct
from ._operands import BlockOperands
from ._plan import Plan

# The default scoped VMEM limit is smaller than large blocks need; v5e has 128 MiB.
_MIN_VMEM, _MAX_VMEM = 32 * 2**20, 100 * 2**20


def planned_call(kernel: Callable[..., None], *, plan: Plan, operands: BlockOperands,
                 grid: tuple[int, ...], in_specs: Sequence[Any], out_specs: Sequence[Any],
                 outputs: Sequence[tuple[tuple[int, ...], Any]], scratch: Sequence[Any],
                 semantics: tuple[Any, ...], vmem_bytes: int, name: str, interpret: bool
                 ) -> Callable[..., list[Array]]:
    """`pallas_call(kernel)` for `plan`'s grid, taking the kernel's inputs and returning
    its outputs (`outputs`: their shapes and dtypes); `vmem_bytes`: one step's estimate,
    doubled for room."""

    def call(*inputs: Array) -> list[Array]:
        arrays = (*inputs, *operands.block_arrays, *operands.scalar_tables)
        axes = frozenset().union(*(varying_axes(x) for x in arrays))
        limit = int(min(max(2 * vmem_bytes, _MIN_VMEM), _MAX_VMEM))
        results = pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=2 + len(operands.scalar_tables),
                grid=grid,
                in_specs=list(in_specs),
                out_specs=list(out_specs),
                scratch_shapes=list(scratch),
            ),
            out_shape=[varying_struct(shape, dtype, axes) for shape, dtype in outputs],
            compiler_params=pltpu.CompilerParams(dimension_semantics=semantics,
                                                 vmem_limit_bytes=limit),
            interpret=interpret,
            name=name,
        )(jnp.asarray(plan.kv_block), jnp.asarray(plan.flag), *operands.scalar_tables,
          *inputs, *operands.block_arrays)
        return list(results)

    return call


def split_refs(refs: Sequence[Any], operands: BlockOperands, inputs: int
               ) -> tuple[Sequence[Any], Sequence[Any], Sequence[Any], Sequence[Any]]:
    """A kernel's refs after the plan's two tables, in `planned_call`'s order: `(scalar
    tables, its `inputs` input refs, the operands' block refs, outputs and scratch)`."""
    n_tables, n_blocks = len(operands.scalar_tables), len(operands.block_arrays)
    tables, refs = refs[:n_tables], refs[n_tables:]
    return tables, refs[:inputs], refs[inputs:inputs + n_blocks], refs[inputs + n_blocks:]


