"""jaxtyping aliases shared across the package: the one place that names the axes.

A name binds once per checked call, so the same name on two arguments is a shape check
between them. The public axes are:

- `*batch`: any leading axes before the heads axis (none too);
- `heads`, `kv_heads`: query heads and key/value heads (`kv_heads` divides `heads`);
- `seq_q`, `seq_k`: query and key sequence lengths;
- `dim`, `dim_v`: the query/key head dim and the value head dim.

q may also be a bare `(seq_q, dim)` matrix with no leading axes at all, so each of q, k,
v, out and lse is a union of that form and the batched one. jaxtyping rolls back the
axes bound by a failed alternative, so names still bind consistently across arguments.
What a shape string cannot say (`kv_heads` divides `heads`; q and k have the same
number of axes; mask leading axes broadcast against q's) is checked in `_api.binder`,
which also runs when jaxtyping's checks are switched off.

Some arguments are checked at the signature more loosely than they are accepted, so that
an explicit check's message (naming the argument, with the same words at every entry
point) is the one users see: the static options admit anything there, the lengths and
positions any dtype. Their annotation carries what is accepted as `Documented` metadata,
which the API reference shows (`docs/signatures.py`) and type checkers see.
"""

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias

import numpy as np
from jaxtyping import Array, Bool, Float, Integer, Shaped


@dataclasses.dataclass(frozen=True)
class Documented:
    """`Annotated` metadata: the type an argument is accepted as, where the annotation
    checked at call time admits more (beartype ignores metadata of this kind)."""

    type: Any

# Public entry points accept NumPy arrays as well as JAX arrays (converted with
# `jnp.asarray`); they are what users have at hand in notebooks and data loaders.
# Python scalars and lists are not accepted: they carry no shape to check (except the
# scalar lengths, `Lengths`).
AnyArray: TypeAlias = Array | np.ndarray

Query: TypeAlias = (
    Float[AnyArray, "*batch heads seq_q dim"] | Float[AnyArray, "seq_q dim"]
)
Key: TypeAlias = (
    Float[AnyArray, "*batch kv_heads seq_k dim"] | Float[AnyArray, "seq_k dim"]
)
Value: TypeAlias = (
    Float[AnyArray, "*batch kv_heads seq_k dim_v"] | Float[AnyArray, "seq_k dim_v"]
)

# Masks and ids: the trailing axes are named; how the leading axes broadcast against
# q's (the heads axis may be left out) is checked by `_core.shapes.mask_to_internal`.
# Boolean, or integer where non-zero attends; a float mask is an error.
KeyMask: TypeAlias = Bool[AnyArray, "... seq_k"] | Integer[AnyArray, "... seq_k"]
PairMask: TypeAlias = (
    Bool[AnyArray, "... #seq_q #seq_k"] | Integer[AnyArray, "... #seq_q #seq_k"]
)
# Valid lengths `(*batch,)`: any dtype here, so that `_api.binder` names the
# argument in its message for a non-integer one. A scalar length (one per call, as an
# unbatched call or a module takes) may be a Python or NumPy number too: it has no
# shape to check.
_LengthsChecked: TypeAlias = Shaped[AnyArray, "..."] | int | float | np.number | np.bool_
Lengths: TypeAlias = Annotated[_LengthsChecked, Documented(Integer[Array, "*batch"] | int)]
QuerySegmentIds: TypeAlias = Integer[AnyArray, "... seq_q"]
# Score terms: a float bias broadcastable to `(*batch, heads, seq_q, seq_k)` and ALiBi
# slopes `(*batch, heads)`; how their leading axes broadcast is checked in `_api.binder`.
Bias: TypeAlias = Float[AnyArray, "... #seq_q #seq_k"]
# On the ring (`ring_flash_attention`, local shards), a device's query rows against all
# keys: its last axis is the global seq_k, not the local shard's.
RingBias: TypeAlias = Float[AnyArray, "... #seq_q #global_seq_k"]
AlibiSlopes: TypeAlias = Float[AnyArray, "..."]
Sinks: TypeAlias = Float[AnyArray, "..."]
KeySegmentIds: TypeAlias = Integer[AnyArray, "... seq_k"]
# Absolute positions `(*batch, [heads,] seq)`: any dtype here, so that `_api.binder`
# names the argument in its message for a non-integer one.
QueryPositions: TypeAlias = Annotated[Shaped[AnyArray, "... seq_q"],
                                      Documented(Integer[Array, "... seq_q"])]
KeyPositions: TypeAlias = Annotated[Shaped[AnyArray, "... seq_k"],
                                    Documented(Integer[Array, "... seq_k"])]
# `score_mod(score, batch, head, q_idx, kv_idx) -> score` and `mask_mod(batch, head,
# q_idx, kv_idx) -> bool` (`_mods`): any callable, a PyTree such as an `eqx.Module` too.
ScoreMod: TypeAlias = Callable[..., Any]
MaskMod: TypeAlias = Callable[..., Any]

Output: TypeAlias = (
    Float[Array, "*batch heads seq_q dim_v"] | Float[Array, "seq_q dim_v"]
)
LSE: TypeAlias = Float[Array, "*batch heads seq_q"] | Float[Array, " seq_q"]
# `return_max_scores=True`: the largest attended score of each row, shaped like the lse.
MaxScores: TypeAlias = LSE
# `(out, lse)` or `(out, lse, max_scores)`: checked exactly at run time; type checkers see
# a tuple of arrays, so that both `out, lse = ...` and `out, lse, m = ...` type-check.
# The API reference shows what type checkers see; the docstrings give the shapes.
if TYPE_CHECKING:
    Attended: TypeAlias = tuple[Array, ...]
else:
    Attended = Annotated[tuple[Output, LSE] | tuple[Output, LSE, MaxScores],
                         Documented(tuple[Array, ...])]

# The static options. Type checkers and the API reference see their real types; at run
# time they admit anything, because `_core.options.make_options` checks them, with one message
# per bad value that every entry point shares (a beartype error would otherwise pre-empt
# it with another message).
_Flag = bool
_RealNumber = float  # an int too (PEP 484's numeric tower; make_options takes both)
_OptionalReal = float | None
# The window's sides: an int `w` for `(w, w)`, or `(left, right)`; None is unbounded.
_WindowLike = int | tuple[int | None, int | None] | None
_BlockSize = int | None
_KernelsName = Literal["xla", "pallas_tpu"] | None
if TYPE_CHECKING:
    Flag: TypeAlias = _Flag
    RealNumber: TypeAlias = _RealNumber
    OptionalReal: TypeAlias = _OptionalReal
    WindowLike: TypeAlias = _WindowLike
    BlockSize: TypeAlias = _BlockSize
    KernelsName: TypeAlias = _KernelsName
else:
    Flag = Annotated[Any, Documented(_Flag)]
    RealNumber = Annotated[Any, Documented(_RealNumber)]
    OptionalReal = Annotated[Any, Documented(_OptionalReal)]
    WindowLike = Annotated[Any, Documented(_WindowLike)]
    BlockSize = Annotated[Any, Documented(_BlockSize)]
    KernelsName = Annotated[Any, Documented(_KernelsName)]
