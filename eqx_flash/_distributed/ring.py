"""Context-parallel ring attention: the sequence is sharded over a mesh axis.

Each device keeps its query chunk and passes key/value chunks around the ring with
`lax.ppermute`; partial `(out, lse)` pairs merge through the log-sum-exp. The backward pass
is a ring too: dq stays home, dk/dv travel with their chunks and arrive home after a full
turn. Per device, memory is that of one chunk pair, O(seq / devices).

Where a chunk pair sits relative to the causal diagonal or a window depends on which
devices meet at a ring step, a run-time value, while the kernels take the alignment
statically (`KernelConfig.diagonal_offset`). So every (device, step) pair is classified
at trace time into skip / fully visible / one of a few masked variants, and `lax.switch`
picks the variant at run time.

A bias stays with its query rows, and ALiBi and `score_mod`/`mask_mod` read the pair's
global positions (`_ring_mods`).
"""

import dataclasses
import functools
from collections.abc import Hashable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from beartype import beartype
from jaxtyping import Array, jaxtyped

from .._api.binder import check_masks, check_qkv, check_score_mods
from .._autodiff.derivatives import reverse_only
from .._core.compat import pcast_varying, varying_axes
from .._core.config import KernelConfig, kernel_config, stat_dtype
from .._core.options import AttentionOptions, Window, make_options
from .._core.shapes import Shapes, merge_heads, split_heads
from .._core.types import (
    LSE,
    AlibiSlopes,
    BlockSize,
    Flag,
    Key,
    KeyMask,
    KeySegmentIds,
    MaskMod,
    OptionalReal,
    Output,
    Query,
    QuerySegmentIds,
    RingBias,
    ScoreMod,
    Value,
    WindowLike,
)
from .._distributed.ring_score_terms import (
    RingMods,
    bias_columns,
    column_block,
    pair_mods,
    positions,
    put_column_block,
)
from .._distributed.sequence_order import Layout, check_layout, chunk_index, subchunks
from .._kernels.backward import backward, prepare
from .._kernels.forward import forward
from .._kernels.schedule import block_schedule
from .._mods.block_mask import BlockMask
from .._mods.tracing import FlexArrays
from .._mods.tracing import prepare as prepare_mods
from .._semantics import softmax as _softmax
from .._semantics.masking import Masks
from .._semantics.score_terms import ScoreMods


@dataclasses.dataclass(frozen=True)
class _Ring:
    """Static description of one ring call. `base.seq_q`/`seq_k` are the lengths of one
    piece (the local shard divided by `subchunks(layout)`); `base.window` is global."""

    axis_name: Hashable
    num_devices: int
    layout: str
    base: KernelConfig

    @property
    def pieces(self) -> int:
        return subchunks(self.layout)


def _pair_config(ring: _Ring, a: int, qp: int, b: int, kp: int) -> KernelConfig | None:
    """Kernel config for query piece `qp` of device `a` against key piece `kp` of device `b`:
    None if no pair attends, an unmasked config if all do, else a positioned one."""
    n, base = ring.num_devices, ring.base
    cq, ck, win = base.seq_q, base.seq_k, base.window
    if ring.layout == "striped":
        # Device a holds global tokens a + n*r. In local indices the global window
        # becomes another window around the same diagonal (floor division is exact here).
        left = None if win.left is None else (win.left - (a - b)) // n
        right = None if win.right is None else (a - b + win.right) // n
        window, offset = Window(left, right), ck - cq
    else:
        total = n * ring.pieces
        gq = chunk_index(ring.layout, n, a, qp)
        gk = chunk_index(ring.layout, n, b, kp)
        window, offset = win, gq * cq - gk * ck + total * (ck - cq)
    one_block = block_schedule(cq, ck, cq, ck, window, offset)
    if len(one_block.full):
        return dataclasses.replace(base, window=Window(), diagonal_offset=None)
    if len(one_block.partial):
        return dataclasses.replace(base, window=window, diagonal_offset=offset)
    return None


@functools.lru_cache(maxsize=256)
def _plan(ring: _Ring) -> dict[tuple[int, int], tuple[tuple[KernelConfig | None, ...], np.ndarray]]:
    """Per (query piece, key piece): the distinct variants and a `[device, source]` table
    of which variant applies."""
    n = ring.num_devices
    plan = {}
    for qp in range(ring.pieces):
        for kp in range(ring.pieces):
            variants: list[KernelConfig | None] = []
            table = np.zeros((n, n), np.int32)
            for a in range(n):
                for b in range(n):
                    cfg = _pair_config(ring, a, qp, b, kp)
                    if cfg not in variants:
                        variants.append(cfg)
                    table[a, b] = variants.index(cfg)
            plan[(qp, kp)] = (tuple(variants), table)
    return plan


def _dispatch(branches, table: np.ndarray, me: Array, src: Array, *operands):
    if len(branches) == 1:
        return branches[0](*operands)
    return jax.lax.switch(jnp.asarray(table)[me, src], branches, *operands)


def _shift(tree, ring: _Ring):
    """Send everything one step along the ring (device j to j + 1)."""
    n = ring.num_devices
    perm = [(j, (j + 1) % n) for j in range(n)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, ring.axis_name, perm), tree)


def _varying_axes(tree) -> tuple:
    """Manual mesh axes any leaf varies over (inside `shard_map` with `check_vma=True`)."""
    axes = set()
    for x in jax.tree.leaves(tree):
        axes |= varying_axes(x)
    return tuple(sorted(axes, key=str))


def _vary(tree, like):
    """Give fresh accumulators (or replicated inputs) the varying manual axes of the
    inputs `like` that they lack, so that scan carries and switch branches type-check
    under shard_map's `check_vma=True`."""
    axes = _varying_axes(like)
    if not axes:
        return tree

    def cast(x):
        missing = tuple(a for a in axes if a not in varying_axes(x))
        return pcast_varying(x, missing) if missing else x

    return jax.tree.map(cast, tree)


def _key_masks(masks: Masks) -> tuple[Array | None, Array | None]:
    return masks.key_mask, masks.kv_segment_ids


def _pair_masks(q_masks: Masks, key_masks: tuple[Array | None, Array | None]) -> Masks:
    return Masks(
        key_mask=key_masks[0],
        q_segment_ids=q_masks.q_segment_ids,
        kv_segment_ids=key_masks[1] if q_masks.q_segment_ids is not None else None,
    )


def _forward_pair(cfg: KernelConfig | None, out, lse, q, k, v, masks, mods: ScoreMods,
                  flex: FlexArrays):
    """Attend one chunk pair and merge it into the running normalised `(out, lse)`."""
    if cfg is None:
        return out, lse
    return _softmax.merge(out, lse, *forward(cfg, q, k, v, mods, masks, None, flex))


def _add(grad, part):
    """`grad + part` over a pytree, in `grad`'s dtypes (None: not accumulated)."""
    if grad is None or part is None:
        return grad
    return jax.tree.map(lambda g, p: g + p.astype(g.dtype), grad, part)


def _backward_pair(cfg: KernelConfig | None, wanted: tuple[bool, bool], grads, q, k, v, lse,
                   delta, d_out, masks, mods: ScoreMods, flex: FlexArrays):
    """One chunk pair's share of the gradients `(dq, dk, dv, d_bias block, d_slopes,
    d_score)` (None where not wanted), given the merged call's `lse` and `delta`
    (`_backward.prepare`)."""
    if cfg is None:
        return grads
    d_q, d_k, d_v, d_mods, d_score = backward(cfg, q, k, v, mods, lse, delta, d_out, masks,
                                              None, flex, mods_wanted=wanted)
    parts = (d_q, d_k, d_v, d_mods.bias, d_mods.slopes, d_score)
    return tuple(_add(g, p) for g, p in zip(grads, parts, strict=True))


def _positions(ring: _Ring, me: Array, mods: RingMods):
    """For ALiBi and `score_mod`/`mask_mod`: a function of `(device, key piece)` giving
    the key piece's global positions, and this device's query positions per piece (Nones
    where neither is given)."""
    n, m, cfg = ring.num_devices, ring.pieces, ring.base
    if mods.slopes is None and cfg.flex is None:
        return lambda device, kp: None, (None,) * m
    pad_q = -(-cfg.seq_q // cfg.block_q) * cfg.block_q
    pad_k = -(-cfg.seq_k // cfg.block_k) * cfg.block_k

    def keys(device: Array, kp: int) -> Array:
        return positions(ring.layout, n, device, kp, cfg.seq_k, pad_k)

    queries = tuple(positions(ring.layout, n, me, qp, cfg.seq_q, pad_q) for qp in range(m))
    return keys, queries


def _ring_forward(ring: _Ring, q, k, v, mods: RingMods, masks, flex: FlexArrays):
    """`q`, `k`, `v`, `masks`: tuples over pieces of padded internal-layout arrays; `flex`
    the `score_mod`'s and `mask_mod`'s arrays but the differentiable `mods.score`."""
    n, m, plan = ring.num_devices, ring.pieces, _plan(ring)
    me = jax.lax.axis_index(ring.axis_name)
    pad_k = k[0].shape[2]
    key_positions, q_pos = _positions(ring, me, mods)
    flex = flex._replace(score=mods.score)
    stat = stat_dtype(q[0].dtype)
    out = tuple(jnp.zeros((*x.shape[:-1], v[0].shape[-1]), stat) for x in q)
    lse = tuple(jnp.full(x.shape[:-1], -jnp.inf, stat) for x in q)
    out, lse = _vary((out, lse), (q, k, v, masks))
    travelling = (k, v, tuple(_key_masks(x) for x in masks))

    def step(carry, i):
        out, lse, here = carry
        # Issue the transfer first so it can overlap with this step's compute.
        nxt = _shift(here, ring)
        k, v, key_masks = here
        src = (me - i) % n
        out, lse = list(out), list(lse)
        for qp in range(m):
            for kp in range(m):
                variants, table = plan[(qp, kp)]
                branches = [functools.partial(_forward_pair, cfg) for cfg in variants]
                pair_masks = _pair_masks(masks[qp], key_masks[kp])
                chunk = src * m + kp  # the key piece's chunk in ring order
                pair = pair_mods(mods, qp, chunk, pad_k, q_pos[qp], key_positions(src, kp))
                out[qp], lse[qp] = _dispatch(
                    branches, table, me, src, out[qp], lse[qp], q[qp], k[kp], v[kp],
                    pair_masks, pair, flex,
                )
        return (tuple(out), tuple(lse), nxt), None

    (out, lse, _), _ = jax.lax.scan(step, (out, lse, travelling), jnp.arange(n))
    return tuple(o.astype(x.dtype) for o, x in zip(out, q, strict=True)), lse


def _ring_backward(ring: _Ring, q, k, v, mods: RingMods, lse, delta, d_out, masks,
                   flex: FlexArrays, wanted: tuple[bool, bool]):
    """The mirror of `_ring_forward`: dq stays home, dk/dv travel with their chunk and are
    back on its owner after a full turn. `lse` and `delta` come from `_backward.prepare`.
    The score terms' cotangents stay home, as the terms do (`_ring_mods`); the slopes' and
    the score_mod's arrays' are this device's share (shard_map's transpose sums the shares
    of a replicated input).
    `wanted`: whether the bias's and the slopes' cotangents are needed."""
    n, m, plan = ring.num_devices, ring.pieces, _plan(ring)
    me = jax.lax.axis_index(ring.axis_name)
    stat = stat_dtype(q[0].dtype)
    pad_k = k[0].shape[2]
    key_positions, q_pos = _positions(ring, me, mods)
    flex = flex._replace(score=mods.score)
    d_q = tuple(jnp.zeros(x.shape, stat) for x in q)
    d_kv = (tuple(jnp.zeros(x.shape, stat) for x in k), tuple(jnp.zeros(x.shape, stat) for x in v))
    d_bias = tuple(None if b is None or not wanted[0] else jnp.zeros(b.shape, stat)
                   for b in mods.bias)
    d_slopes = None if mods.slopes is None or not wanted[1] else jnp.zeros(mods.slopes.shape,
                                                                          stat)
    d_score = jax.tree.map(lambda x: jnp.zeros(x.shape, stat), mods.score)
    d_q, d_kv, d_bias, d_slopes, d_score = _vary((d_q, d_kv, d_bias, d_slopes, d_score),
                                                 (q, k, v, mods, masks, lse, delta, d_out))
    travelling = (k, v, tuple(_key_masks(x) for x in masks))

    def step(carry, i):
        d_q, here, d_kv, d_bias, d_slopes, d_score = carry
        nxt = _shift(here, ring)
        k, v, key_masks = here
        src = (me - i) % n
        d_q, d_k, d_v, d_bias = list(d_q), list(d_kv[0]), list(d_kv[1]), list(d_bias)
        for qp in range(m):
            for kp in range(m):
                variants, table = plan[(qp, kp)]
                branches = [functools.partial(_backward_pair, cfg, wanted) for cfg in variants]
                pair_masks = _pair_masks(masks[qp], key_masks[kp])
                chunk = src * m + kp
                pair = pair_mods(mods, qp, chunk, pad_k, q_pos[qp], key_positions(src, kp))
                d_b = None if d_bias[qp] is None else column_block(d_bias[qp], chunk, pad_k)
                d_q[qp], d_k[kp], d_v[kp], d_b, d_slopes, d_score = _dispatch(
                    branches, table, me, src,
                    (d_q[qp], d_k[kp], d_v[kp], d_b, d_slopes, d_score),
                    q[qp], k[kp], v[kp], lse[qp], delta[qp], d_out[qp], pair_masks, pair, flex,
                )
                if d_b is not None:
                    d_bias[qp] = put_column_block(d_bias[qp], d_b, chunk, pad_k)
        # dk/dv follow their chunk; after n shifts they are back on its owner.
        d_kv = _shift((tuple(d_k), tuple(d_v)), ring)
        return (tuple(d_q), nxt, d_kv, tuple(d_bias), d_slopes, d_score), None

    (d_q, _, (d_k, d_v), d_bias, d_slopes, d_score), _ = jax.lax.scan(
        step, (d_q, travelling, d_kv, d_bias, d_slopes, d_score), jnp.arange(n)
    )

    def cast(grads, like):
        # Zeros for a term whose cotangent is not wanted.
        return tuple(None if x is None else jnp.zeros_like(x) if g is None else g.astype(x.dtype)
                     for g, x in zip(grads, like, strict=True))

    (d_slopes,) = cast((d_slopes,), (mods.slopes,))
    d_score = jax.tree.map(lambda g, x: g.astype(x.dtype), d_score, mods.score)
    d_mods = RingMods(cast(d_bias, mods.bias), d_slopes, d_score)
    return cast(d_q, q), cast(d_k, k), cast(d_v, v), d_mods


# `mods.score` is the score_mod's floating arrays (differentiable); `flex` its other arrays
# and the mask_mod's, with `flex.score` left None.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attention(ring: _Ring, q, k, v, mods: RingMods, masks, flex: FlexArrays):
    return _ring_forward(ring, q, k, v, mods, masks, flex)


def _ring_attention_fwd(ring, q, k, v, mods, masks, flex):
    out, lse = _ring_forward(ring, q, k, v, mods, masks, flex)
    return (out, lse), (q, k, v, mods, masks, flex, out, lse)


def _ring_attention_bwd(ring, residuals, cotangents, wanted=None):
    q, k, v, mods, masks, flex, out, lse = residuals
    d_out, d_lse = cotangents
    # Constant score terms (fixed ALiBi slopes) need no cotangent accumulated per block.
    mods_wanted = (True, True)
    if wanted is not None:
        terms = wanted[3]  # a RingMods of bools (None: the term is absent)
        mods_wanted = (any(jax.tree.leaves(terms.bias)), bool(terms.slopes))
    # delta once per call, for the merged out and lse; every ring step reads it.
    lse, delta = zip(*map(prepare, out, lse, d_out, d_lse), strict=True)
    d_q, d_k, d_v, d_mods = _ring_backward(ring, q, k, v, mods, lse, delta, d_out, masks,
                                           flex, mods_wanted)
    return d_q, d_k, d_v, d_mods, *jax.tree.map(lambda _: None, (masks, flex))


_ring_attention.defvjp(_ring_attention_fwd, _ring_attention_bwd)
_ring_attention_ad = reverse_only(
    _ring_attention,
    lambda ring, args, outs: (*args, *outs),  # _ring_attention_fwd's residuals
    _ring_attention_bwd,
    "forward-mode autodiff (jax.jvp, jax.linearize, jax.jacfwd) is not supported on the "
    "ring (ring_flash_attention / sharded_flash_attention); reverse mode is. For forward "
    "mode, use flash_attention (which supports it) without sequence sharding.",
    num_diff=4,
    bwd_skips_unwanted=True,
)


def _pieces(x: Array | None, axis: int, count: int, padded: int) -> tuple[Array | None, ...]:
    """Split `x` into `count` equal pieces along `axis`, each zero-padded to `padded`
    (axes of size 1 broadcast and stay whole)."""
    if x is None:
        return (None,) * count
    if x.shape[axis] == 1:
        return (x,) * count
    out = []
    for piece in jnp.split(x, count, axis=axis):
        widths = [(0, 0)] * x.ndim
        widths[axis % x.ndim] = (0, padded - piece.shape[axis])
        out.append(jnp.pad(piece, widths))
    return tuple(out)


@jaxtyped(typechecker=beartype)
def ring_flash_attention(
    q: Query,
    k: Key,
    v: Value,
    mask: KeyMask | None = None,
    *,
    axis_name: Hashable,
    causal: Flag = False,
    window: WindowLike = None,
    q_segment_ids: QuerySegmentIds | None = None,
    kv_segment_ids: KeySegmentIds | None = None,
    scale: OptionalReal = None,
    softcap: OptionalReal = None,
    block_q: BlockSize = None,
    block_k: BlockSize = None,
    layout: Layout = "contiguous",
    q_lengths: Any = None,
    kv_lengths: Any = None,
    bias: RingBias | None = None,
    alibi_slopes: AlibiSlopes | None = None,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    block_mask: BlockMask | None = None,
) -> tuple[Output, LSE]:
    """Flash attention over a sequence sharded along mesh axis `axis_name`.

    Call it inside `jax.shard_map`, on each device's shard: the sequence axis (−2) of q,
    k, v and the last axis of `mask` and the segment ids are split over `axis_name`, all
    other axes as you like (data or tensor parallel over other mesh axes). Key/value
    chunks travel round the ring with `lax.ppermute`; the backward pass is a ring too.

    **Arguments:**

    - `q`, `k`, `v`, `mask`, `causal`, `window`, `q_segment_ids`, `kv_segment_ids`,
        `scale`, `softcap`: as in `flash_attention`, but each device passes its local
        shard. Causal and window are bottom-right aligned on the *global* sequence.
    - `bias`: as in `flash_attention`, for this device's queries against *all* keys:
        broadcastable to `(*batch, heads, local seq_q, global seq_k)`, the key columns
        in ring order (`to_ring_layout(bias, axis=-1)`, the order of the key shards
        along the ring). Each device keeps its rows, `seq_q * seq_k / devices` entries,
        and slices the columns of the key chunk visiting it; nothing extra travels.
        Differentiable (its cotangent stays on the device).
    - `alibi_slopes`: as in `flash_attention`, at *global* positions (bottom-right
        aligned on the global sequence, whatever the layout); differentiable, each
        device's share of the slopes' cotangent summed by `shard_map`'s transpose.
    - `score_mod`, `mask_mod`: as in `flash_attention`, with `q_idx`/`kv_idx` the
        *global* positions (whatever the layout); `batch` and `head` index this
        device's shard of the batch and heads axes. Gradients reach the score_mod's
        arrays, each device's share summed by `shard_map`'s transpose. Inside
        `shard_map(..., check_vma=False)` only (else `NotImplementedError`).
    - `axis_name`: the mesh axis the sequence is sharded over.
    - `block_q`, `block_k`: kernel block sizes within one chunk.
    - `layout`: how the global sequence was cut into the shards. `"contiguous"`: device
        `i` holds the `i`-th slice. `"zigzag"`: the sequence is cut into `2n` chunks and
        device `i` holds chunks `i` and `2n-1-i` (balances causal work). `"striped"`:
        device `i` holds tokens `i, i+n, i+2n, ...`. `to_ring_layout` arranges a global
        array so that plain contiguous sharding gives each device its part.

    **Returns:**

    The local shard of `(out, lse)`, as `flash_attention` returns them.

    Dropout and dense `attn_mask` are not supported on the ring, nor are `q_lengths` and
    `kv_lengths` on the shards (an error says so): `sharded_flash_attention` takes them on
    global arrays, or pass them as segment ids. `block_mask` raises `NotImplementedError`
    (pass the `mask_mod` alone).
    """
    refuse_on_ring(
        "ring_flash_attention", "block_mask", block_mask,
        "pass the mask_mod alone (evaluated on every block pair the ring visits, blocks it "
        "empties skipped), or express the mask with causal=, window= or segment ids",
    )
    for name, value in (("q_lengths", q_lengths), ("kv_lengths", kv_lengths)):
        if value is not None:
            raise NotImplementedError(
                f"ring_flash_attention does not take {name} (each device holds a shard of "
                "the sequence): use sharded_flash_attention(..., q_lengths=, kv_lengths=) on "
                "the global arrays, or mark the padding with q_segment_ids/kv_segment_ids"
            )
    options = make_options(
        causal=causal, window=window, scale=scale, softcap=softcap, block_q=block_q,
        block_k=block_k,
    )
    return ring_attention(
        q, k, v, mask, q_segment_ids, kv_segment_ids, bias, alibi_slopes, score_mod, mask_mod,
        axis_name=axis_name, layout=layout, options=options,
    )


def refuse_on_ring(entry: str, name: str, value: Any, instead: str) -> None:
    """`NotImplementedError` for an argument the ring does not run, saying what to do."""
    if value is not None:
        raise NotImplementedError(f"{entry} does not support {name}: {instead}")


def ring_attention(
    q: Any, k: Any, v: Any, mask: Any, q_segment_ids: Any, kv_segment_ids: Any, bias: Any,
    alibi_slopes: Any, score_mod: Any = None, mask_mod: Any = None, *, axis_name: Hashable,
    layout: str, options: AttentionOptions,
) -> tuple[Array, Array]:
    """`ring_flash_attention` with validated options (`sharded_flash_attention` calls it
    inside its `shard_map`)."""
    check_layout(layout)
    q, k, v, shapes = check_qkv(q, k, v)
    masks = check_masks(shapes, mask, None, q_segment_ids, kv_segment_ids)
    try:
        n = jax.lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"ring_flash_attention must run inside jax.shard_map over a mesh with axis "
            f"axis_name={axis_name!r}; for global arrays use sharded_flash_attention"
        ) from None
    m = subchunks(layout)
    for name, seq in (("seq_q", shapes.seq_q), ("seq_k", shapes.seq_k)):
        if seq % m:
            raise ValueError(
                f"layout={layout!r} splits each shard into {m} pieces; the local {name}={seq} "
                f"must be divisible by {m}"
            )
    # The bias holds this device's rows against every key (`_ring_mods`).
    mods = check_score_mods(dataclasses.replace(shapes, seq_k=n * shapes.seq_k), bias,
                            alibi_slopes)
    piece = dataclasses.replace(shapes, seq_q=shapes.seq_q // m, seq_k=shapes.seq_k // m)
    if (score_mod is not None or mask_mod is not None) and _varying_axes((q, k, v)):
        # The kernels replay a traced score_mod/mask_mod, whose operations would mix
        # varying positions with invariant values, which check_vma=True refuses.
        raise NotImplementedError(
            "ring_flash_attention takes score_mod/mask_mod only inside "
            "jax.shard_map(..., check_vma=False); alibi_slopes= and bias= work either way"
        )
    base = kernel_config(options, piece)
    flex_cfg, flex = prepare_mods(score_mod, mask_mod, shapes.heads, shapes.groups,
                                  base.block_q, base.block_k, stat_dtype(q.dtype))
    # ALiBi aligns the global positions on the global sequence (`_ring_mods`).
    base = dataclasses.replace(base, flex=flex_cfg,
                               alibi_offset=n * (shapes.seq_k - shapes.seq_q))
    ring = _Ring(axis_name=axis_name, num_devices=n, layout=layout, base=base)
    return _ring_internal(ring, q, k, v, mods, masks, flex, shapes)


def _ring_internal(ring: _Ring, q, k, v, mods: ScoreMods, masks: Masks, flex: FlexArrays,
                   shapes: Shapes):
    cfg, m = ring.base, ring.pieces
    pad_q = -(-cfg.seq_q // cfg.block_q) * cfg.block_q
    pad_k = -(-cfg.seq_k // cfg.block_k) * cfg.block_k
    q, k, v = split_heads(q, k, v, shapes)
    qs, ks, vs = _pieces(q, 3, m, pad_q), _pieces(k, 2, m, pad_k), _pieces(v, 2, m, pad_k)
    key_mask = _pieces(masks.key_mask, -1, m, pad_k)
    q_ids = _pieces(masks.q_segment_ids, -2, m, pad_q)
    kv_ids = _pieces(masks.kv_segment_ids, -1, m, pad_k)
    piece_masks = tuple(
        Masks(key_mask=key_mask[i], q_segment_ids=q_ids[i], kv_segment_ids=kv_ids[i])
        for i in range(m)
    )
    bias = bias_columns(mods.bias, ring.num_devices * m, pad_k)
    ring_mods = RingMods(_pieces(bias, -2, m, pad_q), mods.slopes, flex.score)
    # Replicated terms (slopes) vary like q under check_vma=True: the transpose of that
    # cast sums the devices' shares of their cotangents.
    ring_mods = _vary(ring_mods, (qs, ks, vs))
    out, lse = cast(tuple[Any, Any], _ring_attention_ad(
        ring, qs, ks, vs, ring_mods, piece_masks, flex._replace(score=None)))
    out = jnp.concatenate([o[..., : cfg.seq_q, :] for o in out], axis=3)
    lse = jnp.concatenate([x[..., : cfg.seq_q] for x in lse], axis=3)
    return merge_heads(out, lse, shapes)
