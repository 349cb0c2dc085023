"""One `pallas_call` over a block plan, as every kernel of this family makes it.

The grid is `(batch, kv head, step)`, a step per block pair of the plan (`_plan`); the
plan's tables (each step's outer block, inner block and code) and the operands' scalar
tables are prefetched into SMEM, the
operands' block arrays follow the kernel's own inputs, the outputs vary over the mesh
axes the inputs vary over (inside a user's `shard_map` with `check_vma=True` a
`pallas_call` must be told), and the scoped VMEM limit is raised to what the blocks need.
`split_refs` undoes that order inside a kernel.
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array

from ..._core.compat import pcast_varying, varying_axes, varying_struct
from ._operands import BlockOperands
from ._plan import FIRST, FLAG, LAST, Layout, Plan
from ._unread_outputs import call_writing_read_results

# The default scoped VMEM limit is smaller than large blocks need; v5e has 128 MiB.
_MIN_VMEM, _MAX_VMEM = 32 * 2**20, 100 * 2**20


def planned_call(kernel: Callable[..., None], *, plan: Plan, operands: BlockOperands,
                 blocks: tuple[int, int], heads: tuple[int, int], in_specs: Sequence[Any],
                 out_specs: Sequence[Any], outputs: Sequence[tuple[tuple[int, ...], Any]],
                 scratch: Sequence[Any], vmem_bytes: int,
                 name: str, interpret: bool, zeroed: Sequence[int] = (),
                 optional: Sequence[int] = (), batch_inner: bool = False
                 ) -> Callable[..., list[Array]]:
    """`pallas_call(kernel)` over `plan`'s steps for each of `heads = (batch, kv heads)`
    (the steps in order: they carry an outer block's running state), taking the kernel's
    inputs (`in_specs`;
    the operands' blocks of `blocks = (block_q, block_k)` follow) and returning its
    outputs (`outputs`: their shapes and dtypes); `vmem_bytes`: one step's estimate
    without the operands', doubled for room. The outputs numbered in `zeroed` start as
    zeros (blocks no step writes stay 0): each is aliased to a zero input the kernel
    sees, untouched in HBM, right after the operands' block refs. The outputs numbered in
    `optional` are written only where a compiled program reads them (`_unread_outputs`):
    the kernel is then called with `written`, a bool per output, and gets refs for those
    it marks; the call returns every output (the unwritten ones are never read).

    `batch_inner`: the grid is `(1, kv heads, steps × batch)` instead, each step of the
    plan run for every batch element in turn (`read_step(..., batches=batch)` undoes it;
    the index maps still see `(batch, kv head, step)`), so an output block that does not
    vary over the batch stays in VMEM while the batch sums into it. The plan must be the
    same for every batch element."""
    n_tables = 3 + len(operands.scalar_tables)
    batch, kv_heads = heads
    if batch_inner:
        assert plan.layout.lead_b == 1, "a plan that varies over the batch"
        grid = (1, kv_heads, batch * plan.layout.steps)
        fold = functools.partial(_batch_inner, batch)
    else:
        grid = (*heads, plan.layout.steps)
        fold = lambda spec: spec  # noqa: E731

    def run(*arrays: Array, written: tuple[bool, ...]) -> list[Array]:
        kept = [n for n, w in enumerate(written) if w]
        axes = frozenset().union(*(varying_axes(x) for x in arrays))
        step_bytes = vmem_bytes + operands.vmem_bytes(*blocks)
        limit = int(min(max(2 * step_bytes, _MIN_VMEM), _MAX_VMEM))
        zeros = [jnp.zeros(*outputs[n]) for n in zeroed]
        if axes:
            zeros = [pcast_varying(z, tuple(axes)) for z in zeros]
        first = len(arrays)
        body = functools.partial(kernel, written=written) if optional else kernel
        results = pl.pallas_call(
            body,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=n_tables,
                grid=grid,
                in_specs=[*map(fold, in_specs),
                          *map(fold, operands.block_specs(*blocks, plan.layout.at)),
                          *(pl.BlockSpec(memory_space=pl.ANY) for _ in zeros)],
                out_specs=[fold(out_specs[n]) for n in kept],
                scratch_shapes=list(scratch),
            ),
            out_shape=[varying_struct(*outputs[n], axes) for n in kept],
            input_output_aliases={first + i: kept.index(n)
                                  for i, n in enumerate(zeroed)},
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "arbitrary"),
                vmem_limit_bytes=limit),
            interpret=interpret,
            name=name,
        )(*arrays, *zeros)
        return list(results)

    def call(*inputs: Array) -> list[Array]:
        arrays = (*plan.tables(), *operands.scalar_tables, *inputs, *operands.block_arrays)
        return call_writing_read_results(run, arrays, len(outputs), optional)

    return call


def _batch_inner(batch: int, spec: Any) -> Any:
    """`spec` on `planned_call`'s batch-inner grid: its index map gets `(batch element,
    kv head, step)` back from `(0, kv head, step × batch + batch element)`."""
    index_map = spec.index_map

    def folded(_, hi, t, *tables):
        bi, step = _unfolded(t, batch)
        return index_map(bi, hi, step, *tables)

    return dataclasses.replace(spec, index_map=folded)


def _unfolded(t: Array, batch: int) -> tuple[Array, Array]:
    """The batch element and the plan's step of a batch-inner grid's step `t`. (`lax.rem`
    and `lax.div`, not `%` and `//`: for these non-negative ints they agree, and `//`'s
    sign correction needs the chip's generation to lower, which a CPU host has not.)"""
    return jax.lax.rem(t, batch), jax.lax.div(t, batch)


class Step(NamedTuple):
    """One grid step of a plan, as a kernel reads it (`read_step`)."""

    batch: Array  # the grid's batch element and kv head
    head: Array
    outer: Array  # the outer and the inner block of the pair
    inner: Array
    flag: Array  # 0 none, 1 partial, 2 whole (`_plan`)
    first: Array  # the first step of its outer block: initialise its running state
    last: Array  # the last: write it out
    t: Array  # the step's index along the grid


def read_step(layout: Layout, outer_ref, inner_ref, code_ref, batches: int = 0) -> Step:
    """The current grid step of a plan of `layout` (the kernel's three table refs);
    `batches`: the batch size of a batch-inner grid (`planned_call`), 0 for none."""
    bi, hi, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    if batches:
        bi, t = _unfolded(t, batches)
    at = layout.at(bi, hi, t)
    code = code_ref[at]
    return Step(bi, hi, outer_ref[at], inner_ref[at], code & FLAG, (code & FIRST) != 0,
                (code & LAST) != 0, t)


def by_flag(flag: Array, masks_data: bool, step: Callable[[Any], None]) -> None:
    """`step(positional)` on the steps with a block: 2 whole by position, 1 partial (see
    `_plan`); with masks known only at run time (`masks_data`: evaluated anyway), one
    variant that reads the flag."""
    if masks_data:
        pl.when(flag != 0)(lambda: step(flag == 1))
    else:
        pl.when(flag == 2)(lambda: step(False))
        pl.when(flag == 1)(lambda: step(True))


def written_refs(refs: Sequence[Any], written: Sequence[bool]
                 ) -> tuple[list[Any], list[Any]]:
    """A kernel's output refs, one per output with None for those `written` leaves out
    (`planned_call`'s `optional`), and the refs after them (its scratch)."""
    it = iter(refs)
    return [next(it) if w else None for w in written], list(it)


def split_refs(refs: Sequence[Any], operands: BlockOperands, inputs: int
               ) -> tuple[Sequence[Any], Sequence[Any], Sequence[Any], Sequence[Any]]:
    """A kernel's refs after the plan's three tables, in `planned_call`'s order: `(scalar
    tables, its `inputs` input refs, the operands' block refs, outputs and scratch)`."""
    n_tables, n_blocks = len(operands.scalar_tables), len(operands.block_arrays)
    tables, refs = refs[:n_tables], refs[n_tables:]
    return tables, refs[:inputs], refs[inputs:inputs + n_blocks], refs[inputs + n_blocks:]


