"""A `RelativeScoreMod` in the Pallas kernels: `score + bias(head, kv_idx - q_idx)` as a
Toeplitz term per tile, read from one vector per query head.

The bias depends on the key-minus-query offset alone, so it is evaluated once per call,
by plain JAX outside the kernels (`vectors`: table lookups and all), on every offset
the padded sequences have. A tile whose rows start at position `row0` and whose columns
start at `col0` then needs the window of `rows + cols` offsets that starts at `col0 -
row0 - rows`, and its term is the Toeplitz matrix `T[r, c] = w[c - r + rows]` of that
window. Rows are queries in the forward, dq and tangent kernels (columns minus rows is
`kv_idx - q_idx`) and keys in the dk/dv kernel, which reads the vector of the negated
offsets (`Vector.sign`), so both build the same way.

Where they fit in VMEM (`MAX_DIAGONAL_BYTES`), the kernels get the vector's 128
diagonals, `F[r, y] = v[y - r]` (`diagonals`, built outside): rows `128 a + r` of a tile
are then `F[r, start + rows - 128 a + c]`, a load at a whole-vreg lane offset
(`from_diagonals`), with no rotation in the kernel. Past that, they get the vector on
eight sublanes and build the term from lane rotations by static amounts (`toeplitz`:
eight rows of the window each rotated by its row, 16 such groups rotated by 8 more each
make `F`'s 128 rows, sliced the same way), about 24 vreg rotations per 128 lanes of the
window. The adjoint, the dk/dv kernel's gradient of the vector, goes the same way back:
each tile adds its cotangent into the diagonals' cotangent of its step's window
(`add_to_diagonals`, static lane offsets, no rotation), and once per step that is summed
along the diagonals (`sum_diagonals`: the rotations undone) into the step's window
cotangent; one scatter outside adds the windows into the vector's cotangent. Every
tile dimension is a multiple of 128 (`MULTIPLE`: the family pads the query blocks up to
one), so every window starts on a whole vreg.
"""

import dataclasses
import functools
import operator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array

from ..._core.config import KernelConfig
from ..._core.operands import Operands
from ..._mods.position_bias import RelativeScoreMod

MULTIPLE = 128  # every tile's rows and columns (and so every window's start)
_SUBLANES = 8
# A kernel holds a kv head's vectors whole in VMEM (double-buffered): past this, longer
# sequences run on the pure-JAX kernels (`family.covers`).
MAX_VECTOR_BYTES = 32 * 2**20
# A kernel's vectors as their 128 diagonals (`diagonals`) up to this much VMEM
# (double-buffered, all of a kernel's vectors together); past it, on eight sublanes.
MAX_DIAGONAL_BYTES = 32 * 2**20


def vector_bytes(cfg: KernelConfig, groups: int) -> int:
    """The VMEM one kernel's vector takes, double-buffered."""
    seq_q, seq_k = cfg.padded_seq
    return 2 * 4 * groups * _SUBLANES * (seq_q + seq_k)


def diagonal_bytes(cfg: KernelConfig, groups: int, count: int) -> int:
    """The VMEM `count` vectors take as diagonals, double-buffered."""
    return vector_bytes(cfg, groups) * (MULTIPLE // _SUBLANES) * count


def module_type(cfg: KernelConfig) -> bool:
    """Whether the call's `score_mod` is a `RelativeScoreMod` the kernels build as a term
    (its static half, as `_mods.tracing.split_mod` keeps it)."""
    mods = cfg.mods
    if mods is None or mods.score is None or mods.score.traced:
        return False
    return isinstance(mods.score.static.value, RelativeScoreMod)


def _module(cfg: KernelConfig, arrays: Any, consts: Any) -> RelativeScoreMod:
    assert cfg.mods is not None and cfg.mods.score is not None
    return eqx.combine(arrays, consts, cfg.mods.score.static.value)


@dataclasses.dataclass(frozen=True)
class Vector:
    """Where offsets sit in a kernel's vector: entry `t` holds the bias at offset
    `sign * (t - origin)` (columns minus rows, then in the sequences' own direction);
    `origin` is the rows' padded length, so every window starts at an index >= 0, and
    `length` the two padded lengths together, so every window ends inside."""

    sign: int
    origin: int
    length: int

    @staticmethod
    def of(cfg: KernelConfig, transposed: bool) -> "Vector":
        seq_q, seq_k = cfg.padded_seq
        return Vector(-1 if transposed else 1, seq_k if transposed else seq_q, seq_q + seq_k)

    def offsets(self) -> Array:
        return self.sign * (jnp.arange(self.length, dtype=jnp.int32) - self.origin)

    def start(self, row0: Any, col0: Any, rows: int) -> Any:
        """The window of a tile whose rows start at `row0` and columns at `col0`."""
        return col0 - row0 - rows + self.origin


def _seen_offsets(ops: Operands, local: Array) -> Array:
    """The offsets `kv_idx - q_idx` the module sees at the local offsets `local`: the
    same, or on the ring's pieces their global indices' (`ops.q_index`/`kv_index`,
    each a piece's positions, which step evenly: by one, or by the ring's size when
    striped)."""
    if ops.q_index is None or ops.kv_index is None:
        return local
    q_index, kv_index = ops.q_index.reshape(-1), ops.kv_index.reshape(-1)
    step = kv_index[1] - kv_index[0] if kv_index.shape[0] > 1 else 1
    return step * local + (kv_index[0] - q_index[0])


def _values(cfg: KernelConfig, module: RelativeScoreMod, heads: int, groups: int,
            where: Vector, ops: Operands) -> Array:
    """`(kv heads * groups, length)` float32: each query head's bias on every offset of
    `where` (as the module sees it, `_seen_offsets`). Offsets only padding reaches are
    0: a bias that is not finite there (a lookup past its table) must not reach the
    padded rows' gradients."""
    offsets = where.offsets()
    seen = _seen_offsets(ops, offsets)

    def row(head: Array) -> Array:
        return jnp.broadcast_to(module.bias(head, seen), (where.length,))

    # One head at a time, recomputed in the transpose: a lookup's gather indices for all
    # heads at once, `(heads, length, 2)` int32 (or kept as the residuals of each head's),
    # are padded to 128 lanes on a TPU (256 MiB at 16 heads and 16k + 16k tokens).
    bias = jax.lax.map(jax.checkpoint(row),
                       jnp.arange(heads * groups, dtype=jnp.int32)).astype(jnp.float32)
    reached = (offsets > -cfg.seq_q) & (offsets < cfg.seq_k)
    return jnp.where(reached, bias, 0.0)


def vectors(cfg: KernelConfig, ops: Operands, heads: tuple[int, ...], transposed: bool,
            d_ops: Operands | None = None) -> dict[str, Array]:
    """The kernels' vectors for `heads = (batch, kv heads, groups)`: `"relative"` and,
    with the arrays' tangents in `d_ops`, `"relative_tangent"` (its jvp); empty without
    a `RelativeScoreMod`. Each is `(1, kv heads, groups, 128, length)`, its diagonals
    (`diagonals`), where they fit in `MAX_DIAGONAL_BYTES`, else `(..., 8, length)`, the
    vector on every sublane."""
    if not module_type(cfg):
        return {}
    where = Vector.of(cfg, transposed)
    _, h, g = heads

    def values(arrays: Any) -> Array:
        return _values(cfg, _module(cfg, arrays, ops.score_mod_consts), h, g, where, ops)

    if d_ops is None or d_ops.score_mod_arrays is None:
        named = {"relative": values(ops.score_mod_arrays)}
    else:
        value, tangent = jax.jvp(values, (ops.score_mod_arrays,), (d_ops.score_mod_arrays,))
        named = {"relative": value, "relative_tangent": tangent}
    as_diagonals = diagonal_bytes(cfg, g, len(named)) <= MAX_DIAGONAL_BYTES
    rows = MULTIPLE if as_diagonals else _SUBLANES
    return {name: (diagonals(x) if as_diagonals else jnp.broadcast_to(
        x[:, None, :], (h * g, rows, where.length))).reshape(1, h, g, rows, where.length)
            for name, x in named.items()}


def diagonals(vectors: Array) -> Array:
    """`(..., 128, length)`: each vector `(..., length)` rotated by `r` in row `r`,
    `F[r, y] = v[y - r]` (wrapping where `y < r`, never read)."""
    length = vectors.shape[-1]
    # Static slices of the vector written twice, not a gather: a gather's index array,
    # `(128, length, 1)` int32, is padded to 128 lanes on a TPU (2 GiB at 16k + 16k).
    twice = jnp.concatenate([vectors, vectors], axis=-1)
    return jnp.stack([twice[..., length - r:2 * length - r] for r in range(MULTIPLE)],
                     axis=-2)


def _scattered(windows: Array, starts: Array, length: int) -> Array:
    """`(h * g, length)`: per-step windows `(b, h, steps, g, 1, width)` added at their
    `starts`. Every window starts on a whole vreg: scattered 128 entries per index (an
    XLA scatter of single entries runs one update at a time on a TPU)."""
    b, h, steps, g, _, width = windows.shape
    n = width // MULTIPLE
    first = jnp.broadcast_to(starts, (b, h, steps)) // MULTIPLE
    chunk = first[:, :, :, None, None] + jnp.arange(n, dtype=jnp.int32)[None, None, None, None]
    heads = (jnp.arange(h)[:, None] * g + jnp.arange(g)[None, :])  # (h, g)
    shape = (b, h, steps, g, n)
    d_vector = jnp.zeros((h * g, length // MULTIPLE, MULTIPLE), jnp.float32).at[
        jnp.broadcast_to(heads[None, :, None, :, None], shape),
        jnp.broadcast_to(chunk, shape)].add(windows.reshape(*shape, MULTIPLE))
    return d_vector.reshape(h * g, length)


def arrays_cotangent(cfg: KernelConfig, ops: Operands, wanted: Any, windows: Array,
                     starts: Array) -> Any:
    """The cotangent of the module's arrays marked in `wanted` (None elsewhere, as the
    xla family returns them) from the dk/dv kernel's per-step window cotangents
    `windows` `(b, h, steps, g, 1, width)`, each starting at `starts` `(b|1, h|1,
    steps)` of the transposed kernels' vector."""
    where = Vector.of(cfg, transposed=True)
    _, h, _, g, _, _ = windows.shape
    d_vector = _scattered(windows, starts, where.length)
    free, frozen = eqx.partition(ops.score_mod_arrays, wanted)

    def values(free: Any) -> Array:
        module = _module(cfg, eqx.combine(free, frozen), ops.score_mod_consts)
        return _values(cfg, module, h, g, where, ops)

    _, vjp = jax.vjp(values, free)
    return vjp(d_vector)[0]


def window(ref: Any, group: int, start: Any, width: int) -> Array:
    """`width` entries of query head `group`'s vector from `start` (a multiple of
    `MULTIPLE`), `(8, width)`."""
    return ref[group, :, pl.ds(pl.multiple_of(start, MULTIPLE), width)]


def term(ref: Any, group: int, start: Any, rows: int, cols: int) -> Array:
    """The Toeplitz term `(rows, cols)` of query head `group`'s window from `start`: read
    from its diagonals where `ref` holds them (`(g, 128, length)`), else built."""
    if ref.shape[-2] == MULTIPLE:
        return from_diagonals(ref, group, start, rows, cols)
    return toeplitz(window(ref, group, start, rows + cols), rows, cols)


def from_diagonals(ref: Any, group: int, start: Any, rows: int, cols: int) -> Array:
    """`T[128 a + r, c] = F[r, start + rows - 128 a + c]` (`diagonals`): a load per 128
    rows at a whole-vreg lane offset."""
    assert rows % MULTIPLE == 0, rows
    return jnp.concatenate([
        ref[group, :, pl.ds(pl.multiple_of(start + rows - MULTIPLE * a, MULTIPLE), cols)]
        for a in range(rows // MULTIPLE)], axis=0)


def add_to_diagonals(acc_ref: Any, group: int, at: int, ds: Array) -> None:
    """The adjoint of a tile's term (read from the diagonals or built): its cotangent
    `ds` `(rows, cols)` added into the cotangent of the diagonals of a window starting
    `at` (static) into `acc_ref` `(g, 128, width)`, each 128 rows at their lane offset:
    no rotation (`sum_diagonals` takes the sum to the window once per step)."""
    rows, cols = ds.shape
    assert rows % MULTIPLE == 0 and cols % MULTIPLE == 0, ds.shape
    for a in range(rows // MULTIPLE):
        lanes = slice(at + rows - MULTIPLE * a, at + rows - MULTIPLE * a + cols)
        acc_ref[group, :, lanes] += ds[MULTIPLE * a:MULTIPLE * (a + 1)]


def sum_diagonals(acc_ref: Any, group: int) -> Array:
    """The window's cotangent `(1, width)` from its diagonals' `acc_ref[group]`
    (`F[r, y] = w[y - r]`, so `dw[x] = sum_r dF[r, x + r]`; lanes below 128 of `dF`
    hold nothing, so the rotations' wrap adds nothing)."""
    eight = _total([_roll(acc_ref[group, i * _SUBLANES:(i + 1) * _SUBLANES, :],
                          -_SUBLANES * i) for i in range(MULTIPLE // _SUBLANES)])
    shifted = _total([_roll(jnp.where(_row_is(eight.shape, s), eight, 0.0), -s)
                      for s in range(_SUBLANES)])
    return jnp.sum(shifted, axis=0, keepdims=True)


def _roll(x: Array, shift: int) -> Array:
    shift %= x.shape[-1]
    return x if shift == 0 else pltpu.roll(x, shift, x.ndim - 1)


def _total(parts: list[Array]) -> Array:
    return functools.reduce(operator.add, parts)


def _row_is(shape: tuple[int, ...], row: int) -> Array:
    return jax.lax.broadcasted_iota(jnp.int32, shape, 0) == row


def _diagonals(w: Array) -> Array:
    """`F[r, y] = w[y - r]` for the 128 rows `r` and every lane `y >= r` of the window `w`
    `(8, width)` (its eight rows equal): eight rows each rotated by its row, then 16 such
    groups rotated by 8 more each. Lanes below the row wrap around and are never read."""
    eight = _total([jnp.where(_row_is(w.shape, s), _roll(w, s), 0.0)
                    for s in range(_SUBLANES)])
    return jnp.concatenate([_roll(eight, _SUBLANES * i)
                            for i in range(MULTIPLE // _SUBLANES)], axis=0)


def toeplitz(w: Array, rows: int, cols: int) -> Array:
    """`T[r, c] = w[c - r + rows]`, `(rows, cols)`, from a window `w` `(8, rows + cols)`
    (its eight rows equal). Rows `128 a + r` are `_diagonals(w)[r, c + rows - 128 a]`: a
    slice of it at a whole-vreg lane offset, so no rotation past the first 128 rows."""
    width = w.shape[-1]
    assert rows % MULTIPLE == 0 and width == rows + cols, (rows, cols, w.shape)
    first = _diagonals(w)
    return jnp.concatenate([first[:, rows - MULTIPLE * a:rows - MULTIPLE * a + cols]
                            for a in range(rows // MULTIPLE)], axis=0)
