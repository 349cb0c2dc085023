"""The per-call arrays as the Pallas kernels read them, and the mask of one block.

TPU vector registers are `(8, 128)` tiles. A kernel's logits put one side's positions
along the sublanes (the tile's rows) and the other's along the lanes (its columns): the
forward and the dq kernel have queries as rows, `(g, bq, bk)`; the dk/dv kernel has keys
as rows, `(bk, bq)` per query head (`transposed`). An array of the row side is laid out
`(..., seq, 128)` (each position's value repeated along the lanes) and slices to a column
`(.., rows, 1)`; one of the column side `(..., seq / block, 8, block)` (repeated along the
sublanes; `lane_blocks`), slicing to a row `(.., 1, cols)` — as splash attention lays out
segment ids, but cut into whole blocks, so that a block narrower than 128 lanes (the
query blocks of the dk/dv kernel) is still a whole array's last dimension. Lengths
are scalars in SMEM, as is which key blocks hold a value that is not finite, and so are
ALiBi's slopes (as the coefficient each query head's distance is multiplied by): its
distance is computed in the kernel from the tile's indices or positions, no bias array.
Dropout's seed is one per query head (`_semantics.dropout.head_seed`), the rest of its
hash computed per tile (`keep_for_head`): the same pattern as the XLA kernels'.
Per-pair arrays (a bias, its tangent, an `attn_mask`; `_Pairs`) are read in blocks of
their own, size 1 along every axis they broadcast over, so a bias per key or per head
moves only what it holds; the dk/dv kernel reads them transposed from a copy laid out
once per call (`_pair_layout`), and a mask travels as int8. A `RelativeScoreMod`'s
vectors (`_relative`) are read whole per kv head, a window per tile.

The predicates are `_semantics.masking`'s own, evaluated on these block values, so the
Pallas kernels, the XLA kernels and the reference agree on what attends.
"""

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array

from ..._core.config import KernelConfig
from ..._core.operands import Operands
from ..._core.options import Window
from ..._semantics.dropout import flat_head_index, head_seed, keep_for_head
from ..._semantics.masking import length_mask, positional_mask, within_window
from ..._semantics.score_terms import alibi_distance
from . import _relative
from ._split_mods import (
    Split,
    analyse,
    boundary_values,
    floating,
    side_operands,
    tangent_operands,
)
from ._tile import and_masks, fold_heads
from ._tile_mods import ELEMENTWISE, TileMods

LANES, SUBLANES = 128, 8


@dataclasses.dataclass(frozen=True)
class _Side:
    """One per-query (`query`) or per-key array: which of its leading `(batch, kv_heads,
    groups)` axes are real (not broadcast), and whether its positions run along the
    tile's rows."""

    name: str
    query: bool
    rows: bool
    batch: bool
    heads: bool
    groups: int


@dataclasses.dataclass(frozen=True)
class _Pairs:
    """A per-pair array (a bias, its tangent, an `attn_mask`): which of its `(batch,
    kv_heads, groups, seq_q, seq_k)` axes are real (not broadcast). Its blocks are
    `(g|1, bq|1, bk|1)`, or transposed `(g|1, bk|1, bq|1)` for the dk/dv kernel (the
    array laid out `(.., seq_q / bq, seq_k, bq)` once in the wrapper: `_pair_layout`)."""

    name: str
    batch: bool
    heads: bool
    groups: int
    queries: bool
    keys: bool


@dataclasses.dataclass(frozen=True)
class BlockOperands:
    """What a kernel reads besides q, k, v: `block_arrays` (one per `_Side`, then one per
    `_Pairs`) and `scalar_tables` (SMEM, named by `table_names`), and how a block's mask
    and score term are made of them. `transposed`: keys along the tile's rows (the dk/dv
    kernel)."""

    sides: tuple[_Side, ...]
    block_arrays: tuple[Array, ...]
    scalar_tables: tuple[Array, ...]
    table_names: tuple[str, ...]
    transposed: bool
    has_lengths: bool
    has_positions: bool  # positions with a window: they mask
    masks_data: bool  # a mask known only at run time applies to every block
    # Where ALiBi's distances come from (None: no ALiBi): "indices" (the tile's own, with
    # `cfg.score_offset`), "global" (`q_index`/`kv_index`, the ring's, with it too) or
    # "positions" (`q_positions`/`kv_positions`, absolute).
    alibi: str | None = None
    # With "indices": every index is exact in float32 (the distance is taken there: no
    # conversion per pair), and whether every attended key is at or before its query's
    # aligned position (causal: the distance is `p - j`, no absolute value per pair).
    alibi_float: bool = False
    alibi_one_sided: bool = False
    dropout_rate: float = 0.0  # > 0: a table of per-head seeds ("dropout") applies
    pairs: tuple[_Pairs, ...] = ()
    bias_units: float = 1.0  # the bias in the logits' units before the cap
    # A `RelativeScoreMod`'s vectors (`_relative`), after the pairs' arrays: "relative"
    # and, in the tangent kernel, "relative_tangent"; `(1, kv heads, g, 8, length)`, or
    # their diagonals `(1, kv heads, g, 128, length)` where those fit.
    vectors: tuple[str, ...] = ()
    # The `score_mod` and `mask_mod` that read arrays, split (`_split_mods`): their
    # boundary values are sides named after them (None: the mod reads none, or is absent).
    splits: tuple[Split | None, Split | None] = (None, None)
    mod_tangents: bool = False  # the tangents of a split score_mod's floating values

    def block_specs(self, block_q: int, block_k: int, at: Callable[..., Any]
                    ) -> list[pl.BlockSpec]:
        """BlockSpecs for a grid `(batch, kv head, step)` whose first scalar tables are the
        plan's outer and inner blocks, flat, at `at(batch, kv head, step)`
        (`_plan.Layout.at`)."""
        return ([_spec(side, block_q, block_k, self.transposed, at) for side in self.sides]
                + [_pair_spec(p, block_q, block_k, self.transposed, at) for p in self.pairs]
                + [pl.BlockSpec((None, None, *x.shape[2:]),
                                lambda bi, hi, t, *tables: (0, hi, 0, 0, 0))
                   for x in self._vector_arrays])

    @property
    def _vector_arrays(self) -> tuple[Array, ...]:
        return self.block_arrays[len(self.block_arrays) - len(self.vectors):]

    def vmem_bytes(self, block_q: int, block_k: int) -> int:
        """The double-buffered VMEM of the per-pair blocks and the vectors (the one-sided
        blocks are small)."""
        pair_arrays = self.block_arrays[len(self.sides):len(self.sides) + len(self.pairs)]
        return sum(2 * x.dtype.itemsize * p.groups * (block_q if p.queries else 1)
                   * (block_k if p.keys else 1)
                   for p, x in zip(self.pairs, pair_arrays, strict=True)) + sum(
            2 * x.dtype.itemsize * math.prod(x.shape[2:]) for x in self._vector_arrays)

    def relative_term(self, cfg: KernelConfig, refs: Sequence[Any], name: str, row0: Any,
                      col0: Any, tile: tuple[int, int], groups: int,
                      group: int | None = None) -> Array | None:
        """A `RelativeScoreMod`'s term on the tile (`"relative"`, in the logits' units
        before the cap; `"relative_tangent"`, natural) whose rows start at position
        `row0` and columns at `col0`: `(groups * rows, cols)`, the query heads folded
        into the rows, or `tile` for one query head `group` (None without one)."""
        if name not in self.vectors:
            return None
        ref = refs[len(self.sides) + len(self.pairs) + self.vectors.index(name)]
        rows, cols = tile
        where = _relative.Vector.of(cfg, self.transposed)
        start = where.start(row0, col0, rows)
        units = self.bias_units if name == "relative" else 1.0

        def one(h: int) -> Array:
            t = _relative.term(ref, h, start, rows, cols)
            return t if units == 1.0 else t * jnp.float32(units)

        if group is not None:
            return one(group)
        return fold_heads([one(h) for h in range(groups)])

    def has(self, name: str) -> bool:
        return any(p.name == name for p in self.pairs)

    def _pair(self, refs: Sequence[Any], name: str, group: int | None, keys: Any,
              queries: Any) -> Array:
        """The block of per-pair array `name`, its `keys`/`queries` slice of the block:
        `(g|1, rows|1, cols|1)`, or `(bk|1, cols|1)` for one query head `group` when
        `transposed`."""
        n = next(i for i, p in enumerate(self.pairs) if p.name == name)
        pair, ref = self.pairs[n], refs[len(self.sides) + n]
        q_part = queries if pair.queries and queries is not None else slice(None)
        k_part = keys if pair.keys and keys is not None else slice(None)
        if self.transposed:
            assert group is not None
            return ref[group if pair.groups > 1 else 0, k_part, q_part]
        value = ref[:, q_part, k_part]
        return value if group is None else value[group if pair.groups > 1 else 0]

    def pair_term(self, refs: Sequence[Any], name: str, tile: tuple[int, ...],
                  group: int | None = None, keys: Any = None, queries: Any = None
                  ) -> Array | None:
        """A per-pair score term (`"bias"`, in the logits' units before the cap, or its
        tangent `"bias_tangent"`, natural) as float32 on the tile: `(g * rows, cols)` for
        the query heads folded into the rows of a `(g, rows, cols)` tile, or `tile` for
        one query head `group` (None without the term)."""
        if not self.has(name):
            return None
        x = self._pair(refs, name, group, keys, queries).astype(jnp.float32)
        if name == "bias" and self.bias_units != 1.0:
            x = x * jnp.float32(self.bias_units)
        if group is not None:
            return jnp.broadcast_to(x, tile)
        g, rows, cols = tile
        return jnp.broadcast_to(x, (g, rows, cols)).reshape(g * rows, cols)

    def table(self, tables: Sequence[Any], name: str) -> Any:
        return tables[self.table_names.index(name)]

    @property
    def checks_values(self) -> bool:
        return "bad_block" in self.table_names

    def _value(self, side: _Side, ref: Any, group: int | None, keys: Any, queries: Any
               ) -> Array:
        """The block of one array (its `keys`/`queries` slice of the block, if given),
        broadcastable to the tile: `(g|1, rows, 1)` or `(g|1, 1, cols)`, or without the
        group axis for one `group`."""
        part = (queries if side.query else keys) or slice(None)
        if group is not None:
            ref = ref.at[group if side.groups > 1 else 0]
            return ref[part, 0:1] if side.rows else ref[0:1, part]
        return ref[:, part, 0:1] if side.rows else ref[:, 0:1, part]

    def _values(self, refs: Sequence[Any], group: int | None, keys: Any = None,
                queries: Any = None) -> dict[str, Array]:
        return {side.name: self._value(side, ref, group, keys, queries)
                for side, ref in zip(self.sides, refs[:len(self.sides)], strict=True)}

    def _coordinates(self, tile: tuple[int, ...], q_start: Array, k_start: Array
                     ) -> tuple[Array, Array]:
        """The tile's query and key indices as a column and a row that broadcast (a
        compare per pair, not an iota and an add per pair)."""
        q_axis, k_axis = (len(tile) - 1, len(tile) - 2) if self.transposed else (
            len(tile) - 2, len(tile) - 1)
        q_pos = q_start + jax.lax.broadcasted_iota(
            jnp.int32, tuple(n if a == q_axis else 1 for a, n in enumerate(tile)), q_axis)
        k_pos = k_start + jax.lax.broadcasted_iota(
            jnp.int32, tuple(n if a == k_axis else 1 for a, n in enumerate(tile)), k_axis)
        return q_pos, k_pos

    def tile_mods(self, refs: Sequence[Any], keys: Any = None, queries: Any = None
                  ) -> TileMods | None:
        """The boundary values of the split mods on a tile (its `keys`/`queries` slices
        of the blocks), read per query head (None: no mod reads arrays)."""
        if self.splits == (None, None):
            return None
        by_name = dict(zip((side.name for side in self.sides), refs[:len(self.sides)],
                           strict=True))
        sides = {side.name: side for side in self.sides}

        def read(group: int) -> Callable[[str], Array]:
            return lambda name: self._value(sides[name], by_name[name], group, keys,
                                            queries)

        return TileMods(*self.splits, read, self.mod_tangents)

    def global_indices(self, refs: Sequence[Any], group: int | None = None, keys: Any = None,
                       queries: Any = None) -> tuple[Array, Array] | None:
        """The tile's query and key indices in the whole sequence where the kernels see a
        piece of it (the ring's `q_index`/`kv_index`, broadcastable to the tile as
        `_value` gives them); None where the tile's own indices are the sequence's."""
        if not any(side.name == "q_index" for side in self.sides):
            return None
        values = self._values(refs, group, keys, queries)
        return values["q_index"], values["kv_index"]

    def alibi_distance(self, cfg: KernelConfig, refs: Sequence[Any], q_start: Array,
                       k_start: Array, tile: tuple[int, ...], group: int | None = None,
                       keys: Any = None, queries: Any = None) -> Array:
        """ALiBi's distance on the tile (float32, broadcastable to it), as
        `_semantics.score_terms.alibi_positions` places it: `mask`'s arguments."""
        if self.alibi == "positions":
            values = self._values(refs, group, keys, queries)
            i, j = values["q_positions"], values["kv_positions"]
            # `alibi_distance` without offset, exact past int32 through uint32; Mosaic
            # converts only signed integers to floats, so the wrapped ones are moved up.
            d = jnp.where(i >= j, i - j, j - i).astype(jnp.float32)
            return jnp.where(d < 0, d + jnp.float32(2.0**32), d)
        if self.alibi == "global":
            values = self._values(refs, group, keys, queries)
            i, j = values["q_index"], values["kv_index"]
        else:
            i, j = self._coordinates(tile, q_start, k_start)
            if self.alibi_float:  # `alibi_distance`, in float32 (exact: see the field)
                d = (i + cfg.score_offset).astype(jnp.float32) - j.astype(jnp.float32)
                return d if self.alibi_one_sided else jnp.abs(d)
        return alibi_distance(i, j, cfg.score_offset).astype(jnp.float32)

    def alibi_coefficients(self, tables: Sequence[Any], bi: Array, hi: Array,
                           heads: int | Array, groups: int, name: str = "alibi"
                           ) -> list[Array]:
        """The coefficient of each query head of kv head `(bi, hi)`: `-slope` in the
        units the logits are in before the cap (`name="alibi_tangent"`: the slopes'
        tangents, in natural units)."""
        table = self.table(tables, name)
        return [table[(bi * heads + hi) * groups + group] for group in range(groups)]

    def dropout(self, tables: Sequence[Any], bi: Array, hi: Array, heads: int | Array,
                groups: int, q_start: Array, k_start: Array, tile: tuple[int, ...],
                group: int | None = None) -> Array | None:
        """Dropout's multiplier `keep / (1 - rate)` on the tile (None without dropout):
        `(g * rows, cols)` for the query heads folded into the rows of a `(1, rows,
        cols)` tile, or `tile` for one query head `group` (`mask`'s tiles)."""
        if self.dropout_rate == 0.0:
            return None
        table = self.table(tables, "dropout")
        q_pos, k_pos = (jax.lax.bitcast_convert_type(x, jnp.uint32)
                        for x in self._coordinates(tile, q_start, k_start))
        scale = jnp.float32(1.0 / (1.0 - self.dropout_rate))

        def multiplier(n: int) -> Array:
            seed = jax.lax.bitcast_convert_type(
                jnp.full((1,) * len(tile), table[(bi * heads + hi) * groups + n]), jnp.uint32)
            keep = keep_for_head(seed, q_pos, k_pos, self.dropout_rate)
            return jnp.where(keep, scale, jnp.float32(0.0))

        if group is not None:
            return multiplier(group)
        return fold_heads([multiplier(n).reshape(tile[-2:]) for n in range(groups)])

    def bad_keys(self, refs: Sequence[Any], group: int | None = None, keys: Any = None,
                 name: str = "bad_key") -> Array:
        """The keys whose value row (`name="bad_tangent_key"`: value tangent row) is not
        finite, broadcastable to the tile."""
        return self._values(refs, group, keys)[name] != 0

    def block_has_bad_keys(self, tables: Sequence[Any], bi: Array, hi: Array, kb: Array,
                           heads: int | Array, num_k: int) -> Array:
        """Whether key block `kb` of head `(bi, hi)` holds a non-finite value row."""
        return self.table(tables, "bad_block")[(bi * heads + hi) * num_k + kb] != 0

    def mask(self, cfg: KernelConfig, refs: Sequence[Any], tables: Sequence[Any], bi: Array,
             q_start: Array, k_start: Array, tile: tuple[int, ...],
             positional: bool | Array, group: int | None = None, keys: Any = None,
             queries: Any = None) -> Array | None:
        """Which pairs of the tile attend, broadcastable to `tile` — `(1, bq, bk)`, or
        `(bk, bq)` for one query head `group` when `transposed` — (None: all); the tile
        starts at `(q_start, k_start)` and reads the `keys`/`queries` slice of the
        operands' blocks. `positional`: whether the causal/window/key-padding band
        applies (a Python bool, or a traced one when data masks are evaluated anyway)."""
        values = self._values(refs, group, keys, queries)
        q_pos, k_pos = self._coordinates(tile, q_start, k_start)
        mask = None

        no_key_padding = cfg.seq_k == cfg.padded_seq[1]
        if positional is not False and not (no_key_padding and cfg.band_window.is_unbounded):
            if no_key_padding:
                # The band alone (`positional_mask` without its vacuous `k_pos < seq_k`).
                band = within_window(None, k_pos, q_pos + cfg.offset, cfg.band_window)
            else:
                band = positional_mask(q_pos, k_pos, cfg.offset, cfg.seq_k, cfg.band_window)
            if positional is not True:
                band = band | jnp.logical_not(positional)
            mask = band
        if "key_mask" in values:
            mask = and_masks(mask, values["key_mask"] != 0)
        if self.has("pair_mask"):
            # Compared in int32 (its block may be int8) like every other mask, so that
            # Mosaic's layouts of the masks share a bit width (see `and_masks`).
            pair = self._pair(refs, "pair_mask", group, keys, queries)
            mask = and_masks(mask, pair.astype(jnp.int32) != 0)
        if "q_segment_ids" in values:
            mask = and_masks(mask, values["q_segment_ids"] == values["kv_segment_ids"])
        if self.has_positions:
            mask = and_masks(mask, within_window(None, values["kv_positions"],
                                            values["q_positions"], cfg.window))
        if self.has_lengths:
            q_len = self.table(tables, "q_lengths")[bi]
            kv_len = self.table(tables, "kv_lengths")[bi]
            # (`masking.length_window`: positions place the window themselves.)
            window = Window(None, None) if self.has_positions else cfg.window
            mask = and_masks(mask, length_mask(q_pos, k_pos, q_len, kv_len, window))
        if mask is not None:
            mask = jnp.broadcast_to(mask, jnp.broadcast_shapes(mask.shape, tile[-2:]))
        return mask


def _spec(side: _Side, block_q: int, block_k: int, transposed: bool,
          at: Callable[..., Any]) -> pl.BlockSpec:
    """Forward/dq grids step over key blocks (`plan[outer, step]`) for each query block;
    the dk/dv grid the other way round."""
    block = block_q if side.query else block_k
    shape = (None, None, side.groups, block, LANES) if side.rows else (
        None, None, side.groups, None, SUBLANES, block)
    moves = side.query == transposed  # this side's block follows the plan's table

    def index_map(bi, hi, t, outer, inner, code, *tables):
        index = (inner if moves else outer)[at(bi, hi, t)]
        lead = (bi if side.batch else 0, hi if side.heads else 0, 0)
        return (*lead, index, 0) if side.rows else (*lead, index, 0, 0)

    return pl.BlockSpec(shape, index_map)


def _pair_spec(pair: _Pairs, block_q: int, block_k: int, transposed: bool,
               at: Callable[..., Any]) -> pl.BlockSpec:
    """A per-pair array's block at the step's `(query block, key block)`: the plan's
    inner block is the key block (forward, dq) or the query block (dk/dv)."""
    bq, bk = (block_q if pair.queries else 1), (block_k if pair.keys else 1)

    def index_map(bi, hi, t, outer, inner, code, *tables):
        o, i = outer[at(bi, hi, t)], inner[at(bi, hi, t)]
        qb, kb = (i, o) if transposed else (o, i)
        lead = (bi if pair.batch else 0, hi if pair.heads else 0, 0)
        qi, ki = (qb if pair.queries else 0), (kb if pair.keys else 0)
        return (*lead, qi, ki, 0) if transposed else (*lead, qi, ki)

    if transposed:
        return pl.BlockSpec((None, None, pair.groups, None, bk, bq), index_map)
    return pl.BlockSpec((None, None, pair.groups, bq, bk), index_map)


def _pair_layout(name: str, x: Array, transposed: bool, block_q: int
                 ) -> tuple[_Pairs, Array]:
    """A GRID per-pair array `(b|1, h|1, g|1, seq_q|1, seq_k|1)` as its kernel reads it:
    as it is, or for the dk/dv kernel `(b|1, h|1, g|1, seq_q / bq | 1, seq_k|1, bq|1)`
    (each query block's columns along the lanes, a whole trailing dimension at any
    `bq`). A mask becomes int8 where its row blocks are whole int8 tiles, else int32."""
    pair = _Pairs(name, x.shape[0] > 1, x.shape[1] > 1, x.shape[2], x.shape[3] > 1,
                  x.shape[4] > 1)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        # A block's rows: keys (transposed, whole 128s) or queries.
        whole_tiles = transposed or not pair.queries or block_q % 32 == 0
        x = x.astype(jnp.bool_).astype(jnp.int8 if whole_tiles else jnp.int32)
    if transposed:
        *lead, seq_q, seq_k = x.shape
        bq = block_q if pair.queries else 1
        x = jnp.swapaxes(x.reshape(*lead, seq_q // bq, bq, seq_k), -1, -2)
    return pair, x


def lane_blocks(x: Array, block: int) -> Array:
    """`(..., seq)` as `(..., seq / block, 8, block)`: each block of positions along the
    lanes, repeated along the sublanes. A BlockSpec `(..., None, 8, block)` then reads
    whole trailing dimensions, which Mosaic takes at any `block` (a block of a longer
    lane axis must be a multiple of 128)."""
    *lead, seq = x.shape
    x = x.reshape(*lead, seq // block, 1, block)
    return jnp.broadcast_to(x, (*lead, seq // block, SUBLANES, block))


def _layout(name: str, x: Array, query: bool, transposed: bool, block: int
            ) -> tuple[_Side, Array]:
    """A GRID array, `(b|1, h|1, g|1, seq_q, 1)` for a query-side one or `(b|1, h|1, g|1,
    1, seq_k)` for a key-side one, in the layout of its side (module docstring); `block`:
    its side's block size."""
    rows = query != transposed
    side = _Side(name, query, rows, x.shape[0] > 1, x.shape[1] > 1, x.shape[2])
    seq = x.shape[3] if query else x.shape[4]
    lead = x.shape[:3]
    x = x.astype(jnp.int32).reshape(*lead, seq)
    if rows:
        return side, jnp.broadcast_to(x[..., None], (*lead, seq, LANES))
    return side, lane_blocks(x, block)


def masks_some_pairs(cfg: KernelConfig, ops: Operands, any_partial: bool) -> bool:
    """Whether a pair the plan visits may be masked (then the kernels keep a value that
    is not finite from reaching the queries that do not attend it): a plan with partial
    blocks, a mask known at run time, or a `mask_mod`."""
    return any_partial or ops.has_data_mask or ops.has_positions or _has_mask_mod(cfg)


def _has_mask_mod(cfg: KernelConfig) -> bool:
    return cfg.mods is not None and cfg.mods.mask is not None


def prepare(cfg: KernelConfig, ops: Operands, heads: tuple[int, ...], v: Array | None,
            transposed: bool = False, dv: Array | None = None,
            term_units: float = 1.0, d_ops: Operands | None = None) -> BlockOperands:
    """The kernels' view of `ops` (padded, internal layout) for q's leading axes `heads`
    (batch, kv heads, query heads per kv head).
    With values `v` (and value tangents `dv`), also which keys hold a non-finite value
    (and tangent): wanted where some block is masked. ALiBi's slopes become
    coefficients in `term_units` (the logits' units before the cap), as does a bias;
    the tangents in `d_ops` (of the slopes and of a bias) stay in natural units."""
    parts: list[tuple[_Side, Array]] = []

    def add(name: str, x: Array, query: bool) -> None:
        # A sequence of one position is not padded with the rest (`padded`: its axis
        # broadcasts); its blocks need the whole length.
        axis, length = (3, cfg.padded_seq[0]) if query else (4, cfg.padded_seq[1])
        if x.shape[axis] != length:
            x = jnp.broadcast_to(x, (*x.shape[:axis], length, *x.shape[axis + 1:]))
        parts.append(_layout(name, x, query, transposed, cfg.block_q if query else cfg.block_k))

    if ops.key_mask is not None:
        add("key_mask", ops.key_mask, False)
    if ops.q_segment_ids is not None:
        add("q_segment_ids", ops.q_segment_ids, True)
        add("kv_segment_ids", ops.kv_segment_ids, False)
    positions = ops.has_positions and not cfg.window.is_unbounded
    alibi = _alibi_source(ops)
    if positions or alibi == "positions":
        add("q_positions", ops.q_positions, True)
        add("kv_positions", ops.kv_positions, False)
    # The ring's global indices: ALiBi's distance and a score_mod / mask_mod read them.
    if ops.q_index is not None and (alibi == "global" or cfg.mods is not None):
        add("q_index", ops.q_index, True)
        add("kv_index", ops.kv_index, False)
    tables: dict[str, Array] = {}
    if alibi is not None:
        tables["alibi"] = _coefficients(ops.alibi_slopes, heads, -term_units)
        if d_ops is not None and d_ops.alibi_slopes is not None:
            tables["alibi_tangent"] = _coefficients(d_ops.alibi_slopes, heads, -1.0)
    if ops.has_lengths:
        q_len = ops.q_lengths if ops.q_lengths is not None else jnp.full((1,), cfg.seq_q)
        kv_len = ops.kv_lengths if ops.kv_lengths is not None else jnp.full((1,), cfg.seq_k)
        for name, x in (("q_lengths", q_len), ("kv_lengths", kv_len)):
            tables[name] = jnp.broadcast_to(x.reshape(-1).astype(jnp.int32), heads[:1])
    if cfg.dropout_rate > 0.0 and ops.dropout_seed is not None:
        b, h, g = heads
        per_head = flat_head_index(jnp.arange(b)[:, None], jnp.arange(h)[None, :], h, g)
        tables["dropout"] = jax.lax.bitcast_convert_type(
            head_seed(ops.dropout_seed, per_head.reshape(-1)), jnp.int32)
    pairs = [_pair_layout(name, x, transposed, cfg.block_q) for name, x in (
        ("pair_mask", ops.pair_mask), ("bias", ops.bias),
        ("bias_tangent", None if d_ops is None else d_ops.bias)) if x is not None]
    vectors = _relative.vectors(cfg, ops, heads, transposed, d_ops)
    masks_data = (bool(parts) or ops.has_lengths or ops.pair_mask is not None
                  or _has_mask_mod(cfg))
    # (A split mod's values after it: a score_mod's mask no pair.)
    splits = _split(cfg, ops, heads)
    tangents = False
    for split in splits:
        if split is None:
            continue
        values, d_values = _boundary(cfg, split, ops, heads, d_ops)
        for name, x, query in side_operands(split, values):
            add(name, x, query)
        for name, x, query in tangent_operands(split, d_values):
            add(name, x, query)
            tangents = True
    if v is not None:
        bad = jnp.logical_not(jnp.all(jnp.isfinite(v), axis=-1))  # (b, h, seq_k)
        add("bad_key", bad[:, :, None, None, :], False)
        if dv is not None:
            bad_tangent = jnp.logical_not(jnp.all(jnp.isfinite(dv), axis=-1))
            add("bad_tangent_key", bad_tangent[:, :, None, None, :], False)
            bad = bad | bad_tangent
        by_block = bad.reshape(*bad.shape[:2], -1, cfg.block_k).any(axis=-1)
        tables["bad_block"] = by_block.reshape(-1).astype(jnp.int32)  # (b * h * num_k,)
    return BlockOperands(
        tuple(side for side, _ in parts),
        tuple(x for _, x in parts + pairs) + tuple(vectors.values()),
        tuple(tables.values()), tuple(tables), transposed, ops.has_lengths, positions,
        masks_data, alibi,
        dropout_rate=cfg.dropout_rate if "dropout" in tables else 0.0,
        alibi_float=alibi == "indices" and max(cfg.padded_seq) + abs(cfg.score_offset) < 2**24,
        alibi_one_sided=(alibi == "indices" and cfg.band_window.right is not None
                         and cfg.band_window.right <= 0 and cfg.score_offset == cfg.offset),
        pairs=tuple(pair for pair, _ in pairs), bias_units=term_units,
        vectors=tuple(vectors), splits=splits, mod_tangents=tangents)


def _values_of(cfg: KernelConfig, split: Split, ops: Operands, heads: tuple[int, ...]
               ) -> Callable[[Any], list[Array]]:
    """A split mod's boundary values as a function of its arrays (`_mod_arrays`)."""
    return lambda arrays: boundary_values(split, arrays, heads, cfg.padded_seq,
                                          (cfg.block_q, cfg.block_k), jnp.float32,
                                          _global_indices(ops))


def _boundary(cfg: KernelConfig, split: Split, ops: Operands, heads: tuple[int, ...],
              d_ops: Operands | None) -> tuple[list[Array], dict[int, Array]]:
    """A split mod's boundary values and, with the tangents of a score_mod's arrays in
    `d_ops`, those of its floating ones (by index)."""
    values = _values_of(cfg, split, ops, heads)
    if split.name != "score_mod" or d_ops is None or d_ops.score_mod_arrays is None:
        return values(_mod_arrays(split.name, ops)), {}
    primal, tangents = jax.jvp(lambda a: values(eqx.combine(a, ops.score_mod_consts)),
                               (ops.score_mod_arrays,), (d_ops.score_mod_arrays,))
    return primal, {n: tangents[n] for n in floating(split)}


def mod_cotangent(cfg: KernelConfig, split: Split, ops: Operands, heads: tuple[int, ...],
                  wanted: Any, cotangents: dict[int, Array]) -> Any:
    """The cotangent of a split score_mod's arrays marked in `wanted` (None elsewhere)
    from those of its floating boundary values (by index, in `boundary_values`'
    layout, float32, over every group)."""
    free, frozen = eqx.partition(ops.score_mod_arrays, wanted)
    order = sorted(cotangents)
    values = _values_of(cfg, split, ops, heads)

    def chosen(free: Any) -> list[Array]:
        found = values(eqx.combine(free, frozen, ops.score_mod_consts))
        return [found[n] for n in order]

    primal, vjp = jax.vjp(chosen, free)
    return vjp([summed_to(cotangents[n], p.shape).astype(p.dtype)
                for n, p in zip(order, primal, strict=True)])[0]


def _global_indices(ops: Operands) -> tuple[Array, Array] | None:
    """The ring's pieces' indices in the whole sequence (None: the kernels' own)."""
    if ops.q_index is None or ops.kv_index is None:
        return None
    return ops.q_index, ops.kv_index


def summed_to(x: Array, shape: tuple[int, ...]) -> Array:
    """`x` summed over the axes where `shape` is 1 (a broadcast operand's cotangent)."""
    axes = tuple(a for a, n in enumerate(shape) if n == 1 and x.shape[a] != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _mod_arrays(name: str, ops: Operands) -> Any:
    """The arrays a `score_mod` or `mask_mod` reads, as `_mods.tracing` calls it."""
    if name == "score_mod":
        return eqx.combine(ops.score_mod_arrays, ops.score_mod_consts)
    return ops.mask_mod_arrays


def _split(cfg: KernelConfig, ops: Operands, heads: tuple[int, ...]
           ) -> tuple[Split | None, Split | None]:
    """The call's `score_mod` and `mask_mod` split where they read arrays (or apply
    what Mosaic does not lower to one side's positions): `family.covers` checked that
    they can be."""
    mods = cfg.mods
    if mods is None:
        return None, None
    found: list[Split | None] = []
    for name, fn in (("score_mod", mods.score), ("mask_mod", mods.mask)):
        if fn is None or (name == "score_mod" and _relative.module_type(cfg)):
            found.append(None)
            continue
        # (Traced on float32 scores: the family runs no float64.)
        split = analyse(name, fn, _mod_arrays(name, ops), heads[2], cfg.block_q, cfg.block_k,
                        jnp.float32, ELEMENTWISE)
        if isinstance(split, str):
            raise NotImplementedError(f"kernels='pallas_tpu' does not cover {split}")
        found.append(split if split.boundary or fn.traced else None)
    return found[0], found[1]


def _alibi_source(ops: Operands) -> str | None:
    if ops.alibi_slopes is None:
        return None
    if ops.has_positions:
        return "positions"
    return "global" if ops.q_index is not None else "indices"


def _coefficients(slopes: Array, heads: tuple[int, ...], units: float) -> Array:
    """`units * slopes`, `(b|1, h|1, g|1, 1, 1)`, as a flat float32 table over (batch,
    kv head, query head of the group)."""
    x = slopes.reshape(slopes.shape[:3]).astype(jnp.float32) * jnp.float32(units)
    return jnp.broadcast_to(x, heads).reshape(-1)
