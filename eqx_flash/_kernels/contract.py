"""What a kernel family provides, and what it may rely on.

A family is a set of blockwise kernels behind one name (`"xla"`: the pure-JAX loops of
`_kernels/xla/`), registered in `dispatch.FAMILIES` as a `KernelFamily`. `dispatch.choose`
picks a family for a call once, before tracing, and records it with everything else it
decided (block sizes, split-K, heads in parallel, compute dtype) in the static
`KernelConfig`; the derivative rules, the forward wiring, the ring and the sharded
strategies find the kernels again with `dispatch.family_of(cfg)`, so every piece of a
call runs the family that was chosen for it. A family may leave a piece out (`None`):
the call then pairs its pieces with the xla family's (a forward of its own with xla's
backward, say), which read the same arrays in the same conventions.

**Arrays.** Every kernel takes the padded internal layout of `_core.shapes`:

- `q` `(batch, kv_heads, groups, seq_q_pad, dim)`, `k` `(batch, kv_heads, seq_k_pad,
  dim)`, `v` `(batch, kv_heads, seq_k_pad, dim_v)`, all in one dtype (the caller casts
  them to `cfg.compute_dtype`; a float dtype, float64 included), with `(seq_q_pad,
  seq_k_pad) = cfg.padded_seq` (whole blocks of `cfg.block_q`, `cfg.block_k`). Rows at
  or past `cfg.seq_q` / `cfg.seq_k` are padding: a kernel masks padded keys by position
  and its results for padded queries are discarded. Query and key rows that can never
  attend (past the valid lengths, or masked by the key mask for every query of their kv
  head) were set to 0 by `_semantics.masking.valid_rows` — except under split-K, where
  the keys and values are not cleaned (a decoding step would spend more on the cleaning
  than on the attention), so a split-K forward must keep garbage (NaN) in unattended key
  rows out of every result.
- `ops`: the call's `Operands`, `GRID` fields padded along their sequence axes to the
  same lengths; `cfg.mods` holds the static part of a `score_mod`/`mask_mod` and
  `ops.block_flags` a `mask_mod`'s per-block summary. What each operand means is
  `_semantics` (`masking`, `score_terms`, `dropout`, `softmax`), evaluated on the values
  of one block (`_core.operands.block`), and which blocks are visited is the block plan
  (`schedule`): a family calls those, so that it computes what the others compute.
- Statistics are in `stat_dtype(q.dtype)` (float32; float64 for float64), and so are
  the accumulators; results in q's dtype are rounded once at the end.

**Forward** (`ForwardKernel`) → `(out, lse, max_score)`: `out` `(batch, kv_heads,
groups, seq_q_pad, dim_v)` in q's dtype; `lse` (natural log of the sum of `exp` of the
attended final scores) and `max_score` (the largest attended final score, the QK-clip
statistic) `(batch, kv_heads, groups, seq_q_pad)` in the statistics dtype. A row that
attends nothing gets `out = 0`, `lse = -inf`, `max_score = -inf`; a row that attends a
non-finite value (or score) gets NaN in all of `out` (`softmax.finish`). Sinks are not
the kernels' business (`softmax.with_sink` joins them after).

**Backward** (`BackwardKernel`) → `(dq, dk, dv, d_ops)`, the cotangents of q, k, v (in
their dtypes) and of the differentiable operands, given `lse` and `delta` from
`_semantics.softmax.backward_statistics` (the forward's lse with -inf made 0, and
`delta = rowsum(d_out * out) - d_lse` in the statistics dtype) and the cotangent `d_out`
of `out`. `wanted` is `differentiable_part(ops)` with a bool per leaf: only those
cotangents are computed, returned in their operands' shapes and dtypes (reduced where
the operand broadcasts, `_core.operands.reduce_to`), None elsewhere. A masked pair gives
exactly zero (a NaN value it does not attend reaches no gradient); a row that attends
nothing gives zero gradients.

**Tangent** (`TangentKernel`) → `(d_out, d_lse)` (q's dtype, statistics dtype), the
forward's outputs moved along tangents `dq`, `dk`, `dv` (None where zero: a family
skips what they would cost) and `d_ops` (tangents of the differentiable operands, None
where zero; a score_mod's arrays all together or not at all), given the forward's `out`
and `lse` (-inf kept). Rows that attend nothing get zero tangents.

**Forward and tangent** (`ForwardAndTangentKernel`) → `(out, lse, max_score, d_out,
d_lse)`: both in one pass (`jax.jvp` where nothing is transposed).

**Split-K forward**: a `ForwardKernel` for few queries against many keys, run where the
configuration says so (`KernelConfig.split_k`; its derivatives are the regular ones).

A family also says which calls it runs (`Covers`: the reason it does not, or None),
which of those the default choice should pass over (`PassesOver`: not yet run on the
family's device, or slower there than the xla family), and may resolve its own
configuration (`Configure`; None: xla's block policy).
"""

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax.numpy as jnp
from jaxtyping import Array

from .._core.config import KernelConfig
from .._core.operands import Operands
from .._core.options import AttentionOptions
from .._core.shapes import Shapes


class Call(NamedTuple):
    """A call as `dispatch.choose` sees it, before tracing: what a family's policy and
    its `Covers` may read."""

    options: AttentionOptions
    shapes: Shapes  # the problem the kernels see (for the ring: one chunk piece)
    dtype: jnp.dtype  # q's dtype, as the caller passed it
    ops: Operands  # unpadded, internal layout (their presence and shapes; no values)
    score_mod: Callable[..., Any] | None  # the user's `score_mod`, if given
    mask_mod: Callable[..., Any] | None  # the user's `mask_mod`, if given
    # A `block_mask`'s `(block_q, block_k)`, the blocks it summarises, where one was given.
    block_mask: tuple[int, int] | None = None
    # The kernels see pieces of a longer sequence (the ring's), whose indices a
    # score_mod/mask_mod must see as the whole sequence's (`ops.q_index`, at run time).
    pieces: bool = False


class Machine(NamedTuple):
    """The facts about the machine a choice reads, read once per call (`dispatch.machine`)
    so that every piece of the call agrees."""

    backend: str  # `jax.default_backend()`
    device_count: int  # `jax.device_count()`

    @property
    def single_cpu_device(self) -> bool:
        return self.device_count == 1 and self.backend == "cpu"


class ForwardKernel(Protocol):
    def __call__(self, cfg: KernelConfig, q: Array, k: Array, v: Array, ops: Operands, /
                 ) -> tuple[Array, Array, Array]: ...


class BackwardKernel(Protocol):
    def __call__(self, cfg: KernelConfig, q: Array, k: Array, v: Array, ops: Operands,
                 lse: Array, delta: Array, d_out: Array, wanted: Operands, /
                 ) -> tuple[Array, Array, Array, Operands]: ...


class TangentKernel(Protocol):
    def __call__(self, cfg: KernelConfig, q: Array, k: Array, v: Array, ops: Operands,
                 out: Array, lse: Array, dq: Array | None, dk: Array | None,
                 dv: Array | None, d_ops: Operands, /) -> tuple[Array, Array]: ...


class ForwardAndTangentKernel(Protocol):
    def __call__(self, cfg: KernelConfig, q: Array, k: Array, v: Array, ops: Operands,
                 dq: Array | None, dk: Array | None, dv: Array | None, d_ops: Operands, /
                 ) -> tuple[Array, Array, Array, Array, Array]: ...


class Covers(Protocol):
    """Whether a family runs a call configured as `cfg` (its own `Configure`'s result,
    `family` set): None if it does, else the reason it does not, for the error of an
    explicit request."""

    def __call__(self, cfg: KernelConfig, call: Call, /) -> str | None: ...


class PassesOver(Protocol):
    """Why `kernels=None` passes over a call the family covers (None: it does not)."""

    def __call__(self, call: Call, /) -> str | None: ...


class Configure(Protocol):
    """The `KernelConfig` of a call for a family: block sizes (an explicit `block_q`/
    `block_k` honoured, `_core.config.choose_block`), scale, split-K (only where
    `split_k` allows it), whether the heads run in parallel, the compute dtype."""

    def __call__(self, call: Call, machine: Machine, split_k: bool, /) -> KernelConfig: ...


class KernelFamily(NamedTuple):
    """One family's kernels as registered (`dispatch.FAMILIES`). A piece left None is
    the xla family's (`dispatch.family_of`)."""

    name: str
    covers: Covers
    forward: ForwardKernel
    backward: BackwardKernel | None = None
    tangent: TangentKernel | None = None
    forward_and_tangent: ForwardAndTangentKernel | None = None
    split_k_forward: ForwardKernel | None = None
    configure: Configure | None = None
    # Whether JAX can differentiate the kernels themselves (second order differentiates
    # the first-order kernels; `dispatch.differentiable` swaps in xla's where not).
    differentiable: bool = True
    # What the family covers but the default choice passes over (not yet run on its
    # device, or slower there): `kernels=None` passes such a call on, saying why; an
    # explicit request runs it.
    passes_over: PassesOver | None = None
    # Whether its kernels read a `mask_mod`'s block summary (`ops.block_flags`), which
    # is derived for them (a pass over every pair) where the call gives no `block_mask`.
    reads_block_flags: bool = True
    # Whether it reads a `block_mask` built at blocks that divide its own, coarsened
    # (`_mods.block_mask.coarsened`); else a `block_mask` must be built at its blocks.
    coarsens_block_mask: bool = False
    # Whether its grid is fixed when traced, so that a block summary known then
    # (`KernelConfig.block_summary`) shrinks it.
    plans_when_traced: bool = False


class Kernels(NamedTuple):
    """The kernels a call runs (`dispatch.family_of`): its family's pieces, the xla
    family's where it has none."""

    forward: ForwardKernel
    split_k_forward: ForwardKernel
    backward: BackwardKernel
    tangent: TangentKernel
    forward_and_tangent: ForwardAndTangentKernel
