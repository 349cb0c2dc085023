"""Context-parallel ring attention: the sequence is sharded over a mesh axis.

Each device keeps its query chunk and passes key/value chunks around the ring with
`lax.ppermute`; partial `(out, lse)` pairs merge through the log-sum-exp. The backward pass
is a ring too: dq stays home, dk/dv travel with their chunks and arrive home after a full
turn. Per device, memory is that of one chunk pair, O(seq / devices).

Which variant of the kernels a (device, step) pair runs is planned statically
(`ring_plan`); which operands stay, travel or are sliced per step is read off their
shapes (`ring_operands`).
"""

import dataclasses
import functools
from collections.abc import Hashable
from typing import Any, cast

import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, jaxtyped

from .._api.binder import Bound, bind, refuse
from .._api.flash import call_of
from .._autodiff.custom_linear import custom_linear
from .._autodiff.derivatives import with_custom_derivatives
from .._core.config import KernelConfig, stat_dtype
from .._core.operands import (
    Operands,
    add_cotangents,
    combine,
    constant_part,
    differentiable_part,
    pad_sequence,
    replace,
    zeros_for,
)
from .._core.shapes import merge_heads, split_heads
from .._core.types import (
    AlibiSlopes,
    Attended,
    BlockSize,
    Flag,
    KernelsName,
    Key,
    KeyMask,
    KeyPositions,
    KeySegmentIds,
    MaskMod,
    OptionalReal,
    Query,
    QueryPositions,
    QuerySegmentIds,
    RingBias,
    ScoreMod,
    Sinks,
    Value,
    WindowLike,
)
from .._kernels.dispatch import choose, family_of, forward
from .._mods.block_mask import BlockMask
from .._mods.tracing import trace_mods
from .._semantics import softmax
from .._semantics.softmax import backward_statistics
from .ring_operands import (
    RingOperands,
    at_chunk,
    cut_for_ring,
    global_index,
    join_differentiable,
    pair_operands,
    put_at_chunk,
    split_differentiable,
)
from .ring_plan import Ring, dispatch, plan, shift, vary, varying_axes_of
from .sequence_order import Layout, check_layout, subchunks

# The forward kernel with the single-device derivative rules (the tangent kernel in
# forward mode): what the ring's forward-mode rule differentiates.
_differentiable_forward = with_custom_derivatives(forward)


def _pair_with_derivatives(cfg: KernelConfig, q, k, v, ops: Operands):
    return _differentiable_forward(cfg, q, k, v, differentiable_part(ops), constant_part(ops))


def _forward_pair(cfg: KernelConfig | None, attention, out, lse, top, q, k, v,
                  ops: Operands):
    """Attend one chunk pair with `attention` (a forward kernel) and merge it into the
    running normalised `(out, lse)` and the running max score `top`."""
    if cfg is None:
        return out, lse, top
    part_out, part_lse, part_top = attention(cfg, q, k, v, ops)
    return (*softmax.merge(out, lse, part_out, part_lse), jnp.maximum(top, part_top))


def _backward_pair(cfg: KernelConfig | None, wanted: Operands, grads, q, k, v, lse, delta,
                   d_out, ops: Operands):
    """One chunk pair's share of the gradients `(dq, dk, dv, d_home, d_common)`, given
    the merged call's `lse` and `delta` (`backward_statistics`)."""
    if cfg is None:
        return grads
    d_q, d_k, d_v, d_home, d_common = grads
    dq, dk, dv, d_ops = family_of(cfg).backward(cfg, q, k, v, ops, lse, delta, d_out, wanted)
    return (d_q + dq.astype(d_q.dtype), d_k + dk.astype(d_k.dtype), d_v + dv.astype(d_v.dtype),
            add_cotangents(d_home, d_ops), add_cotangents(d_common, d_ops))


def _indices(ring: Ring, me: Array):
    """The global indices of this device's query pieces, and a function of `(device, key
    piece)` giving a key piece's (`ring_operands.global_index`)."""
    n, cfg = ring.num_devices, ring.base
    pad_q, pad_k = cfg.padded_seq

    def keys(device: Array, kp: int) -> Array:
        return global_index(ring.layout, n, device, kp, cfg.seq_k, pad_k)

    return tuple(global_index(ring.layout, n, me, qp, cfg.seq_q, pad_q)
                 for qp in range(ring.pieces)), keys


def _ring_forward(ring: Ring, q, k, v, ops: RingOperands, attention=forward):
    """`q`, `k`, `v`: tuples over pieces of padded internal-layout arrays; `attention`
    the kernel each chunk pair runs."""
    n, m, variants_of = ring.num_devices, ring.pieces, plan(ring)
    me = jax.lax.axis_index(ring.axis_name)
    pad_k = k[0].shape[2]
    q_index, key_index = _indices(ring, me)
    stat = stat_dtype(q[0].dtype)
    out = tuple(jnp.zeros((*x.shape[:-1], v[0].shape[-1]), stat) for x in q)
    lse = tuple(jnp.full(x.shape[:-1], -jnp.inf, stat) for x in q)
    out, lse, top = vary((out, lse, lse), (q, k, v, ops))

    def step(carry, i):
        out, lse, top, here = carry
        # Issue the transfer first so it can overlap with this step's compute.
        nxt = shift(here, ring)
        k, v, travelling = here
        src = (me - i) % n
        out, lse, top = list(out), list(lse), list(top)
        for qp in range(m):
            for kp in range(m):
                variants, table = variants_of[(qp, kp)]
                branches = [functools.partial(_forward_pair, cfg, attention)
                            for cfg in variants]
                chunk = src * m + kp  # the key piece's chunk in ring order
                pair = pair_operands(ops.home[qp], travelling[kp], ops.common, chunk, pad_k,
                                     q_index[qp], key_index(src, kp))
                out[qp], lse[qp], top[qp] = dispatch(branches, table, me, src, out[qp],
                                                     lse[qp], top[qp], q[qp], k[kp], v[kp],
                                                     pair)
        return (tuple(out), tuple(lse), tuple(top), nxt), None

    (out, lse, top, _), _ = jax.lax.scan(
        step, (out, lse, lse, (k, v, ops.travelling)), jnp.arange(n))
    return tuple(o.astype(x.dtype) for o, x in zip(out, q, strict=True)), lse, top


def _ring_backward(ring: Ring, q, k, v, ops: RingOperands, lse, delta, d_out, wanted):
    """The mirror of `_ring_forward`: dq stays home, dk/dv travel with their chunk and are
    back on its owner after a full turn. `lse` and `delta` come from
    `backward_statistics`. The operands' cotangents stay where the operands do
    (`ring_operands`): the common ones are this device's share (shard_map's transpose
    sums the shares of a replicated input). `wanted` (flags shaped as the differentiable
    `(home, common)` operands) says which cotangents are needed."""
    n, m, variants_of = ring.num_devices, ring.pieces, plan(ring)
    me = jax.lax.axis_index(ring.axis_name)
    stat = stat_dtype(q[0].dtype)
    pad_k = k[0].shape[2]
    q_index, key_index = _indices(ring, me)
    home_wanted, common_wanted = wanted
    home_diff, common_diff = split_differentiable(ops)[0]
    d_q = tuple(jnp.zeros(x.shape, stat) for x in q)
    d_kv = (tuple(jnp.zeros(x.shape, stat) for x in k), tuple(jnp.zeros(x.shape, stat) for x in v))
    d_home = tuple(zeros_for(h, w, stat) for h, w in zip(home_diff, home_wanted, strict=True))
    d_common = zeros_for(common_diff, common_wanted, stat)
    d_q, d_kv, d_home, d_common = vary((d_q, d_kv, d_home, d_common),
                                       (q, k, v, ops, lse, delta, d_out))

    def step(carry, i):
        d_q, here, d_kv, d_home, d_common = carry
        nxt = shift(here, ring)
        k, v, travelling = here
        src = (me - i) % n
        d_q, d_k, d_v, d_home = list(d_q), list(d_kv[0]), list(d_kv[1]), list(d_home)
        for qp in range(m):
            pair_wanted = combine(home_wanted[qp], common_wanted)
            for kp in range(m):
                variants, table = variants_of[(qp, kp)]
                branches = [functools.partial(_backward_pair, cfg, pair_wanted)
                            for cfg in variants]
                chunk = src * m + kp
                pair = pair_operands(ops.home[qp], travelling[kp], ops.common, chunk, pad_k,
                                     q_index[qp], key_index(src, kp))
                grads = (d_q[qp], d_k[kp], d_v[kp], at_chunk(d_home[qp], chunk, pad_k),
                         d_common)
                d_q[qp], d_k[kp], d_v[kp], d_at, d_common = dispatch(
                    branches, table, me, src, grads, q[qp], k[kp], v[kp], lse[qp], delta[qp],
                    d_out[qp], pair)
                d_home[qp] = put_at_chunk(d_home[qp], d_at, chunk, pad_k)
        # dk/dv follow their chunk; after n shifts they are back on its owner.
        d_kv = shift((tuple(d_k), tuple(d_v)), ring)
        return (tuple(d_q), nxt, d_kv, tuple(d_home), d_common), None

    (d_q, _, (d_k, d_v), d_home, d_common), _ = jax.lax.scan(
        step, (d_q, (k, v, ops.travelling), d_kv, d_home, d_common), jnp.arange(n))

    def cast_like(grads, like):  # (None where a cotangent was not wanted)
        return jax.tree.map(lambda g, x: None if g is None else g.astype(x.dtype), grads,
                            like, is_leaf=lambda g: g is None)

    d_home = tuple(cast_like(g, h) for g, h in zip(d_home, home_diff, strict=True))
    return (*(cast_like(g, x) for g, x in ((d_q, q), (d_k, k), (d_v, v))), d_home,
            cast_like(d_common, common_diff))


def _ring_attention(ring: Ring, q, k, v, home_diff, common_diff, const: RingOperands):
    return _ring_forward(ring, q, k, v, join_differentiable(const, home_diff, common_diff))


def _ring_attention_tangent(ring, residuals, tangents):
    """Forward mode: the tangents of `(out, lse, max scores)`, by `jax.jvp` of the ring
    forward whose chunk pairs carry the single-device derivative rules: each pair's
    tangent comes from the tangent kernel, and the merges and transfers are
    differentiated as they are (a ring of tangent partials, in one more pass round the
    ring beside the primal's). Memory stays that of the forward ring, O(seq / devices).
    A second ring pass against the merged statistics measured the same time and memory
    (`benchmarks/ring_tangent_results.md`)."""
    q, k, v, home_diff, common_diff, const, *_ = residuals
    primals = (q, k, v, home_diff, common_diff)
    leaves, tree = jax.tree.flatten(primals)
    d_leaves = tree.flatten_up_to(tangents)
    which = [d is not None for d in d_leaves]

    def ring_of_marked(*marked):
        it = iter(marked)
        q, k, v, home, common = jax.tree.unflatten(
            tree, [next(it) if w else x for x, w in zip(leaves, which, strict=True)])
        ops = join_differentiable(const, home, common)
        out, lse, _ = _ring_forward(ring, q, k, v, ops, attention=_pair_with_derivatives)
        return out, lse

    marked = [x for x, w in zip(leaves, which, strict=True) if w]
    d_marked = [d for d in d_leaves if d is not None]
    d_out, d_lse = jax.jvp(ring_of_marked, tuple(marked), tuple(d_marked))[1]
    return d_out, d_lse, tuple(jnp.zeros_like(x) for x in d_lse)


def _ring_attention_bwd(ring, residuals, cotangents, wanted):
    q, k, v, home_diff, common_diff, const, out, lse, _ = residuals
    ops = join_differentiable(const, home_diff, common_diff)
    d_out, d_lse, _ = cotangents  # the max scores carry no derivative
    # delta once per call, for the merged out and lse; every ring step reads it.
    lse, delta = zip(*map(backward_statistics, out, lse, d_out, d_lse), strict=True)
    d_q, d_k, d_v, d_home, d_common = _ring_backward(ring, q, k, v, ops, lse, delta, d_out,
                                                     wanted[3:])
    return d_q, d_k, d_v, d_home, d_common


_ring_attention_ad = custom_linear(
    _ring_attention,
    lambda ring, args, outs: (*args, *outs),
    _ring_attention_bwd,
    _ring_attention_tangent,
    num_diff=5,
    second_order_message=(
        "eqx_flash: second-order derivatives (jax.grad of jax.grad, jax.hessian, "
        "jax.jvp of jax.grad, a loss on a jvp tangent) are not supported on the ring "
        "(ring_flash_attention / sharded_flash_attention), which has first-order "
        "forward and reverse mode. sharded_flash_attention(strategy='ulysses') and "
        "flash_attention support them."),
)


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
    q_positions: QueryPositions | None = None,
    kv_positions: KeyPositions | None = None,
    scale: OptionalReal = None,
    softcap: OptionalReal = None,
    block_q: BlockSize = None,
    block_k: BlockSize = None,
    kernels: KernelsName = None,
    layout: Layout = "contiguous",
    q_lengths: Any = None,
    kv_lengths: Any = None,
    bias: RingBias | None = None,
    alibi_slopes: AlibiSlopes | None = None,
    sinks: Sinks | None = None,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    block_mask: BlockMask | None = None,
    return_max_scores: Flag = False,
) -> Attended:
    """Flash attention over a sequence sharded along mesh axis `axis_name`.

    Call it inside `jax.shard_map`, on each device's shard: the sequence axis (−2) of q,
    k, v and the last axis of `mask` and the segment ids are split over `axis_name`, all
    other axes as you like (data or tensor parallel over other mesh axes). Key/value
    chunks travel round the ring with `lax.ppermute`; the backward pass is a ring too.

    **Arguments:**

    - `q`, `k`, `v`, `mask`, `causal`, `window`, `q_segment_ids`, `kv_segment_ids`,
        `scale`, `softcap`: as in `flash_attention`, but each device passes its local
        shard. Causal and window are bottom-right aligned on the *global* sequence.
    - `q_positions`, `kv_positions`: as in `flash_attention`, this device's shards (in
        ring order, as q and k): causal, the window and ALiBi are measured on them. The
        key positions travel round the ring with k and v; every chunk pair runs (no
        static skipping), and key blocks no query can see by position are skipped at
        run time.
    - `bias`: as in `flash_attention`, for this device's queries against *all* keys:
        broadcastable to `(*batch, heads, local seq_q, global seq_k)`, the key columns
        in ring order (`to_ring_layout(bias, axis=-1)`, the order of the key shards
        along the ring). Each device keeps its rows, `seq_q * seq_k / devices` entries,
        and slices the columns of the key chunk visiting it; nothing extra travels.
        Differentiable (its cotangent stays on the device).
    - `alibi_slopes`: as in `flash_attention`, at *global* positions (bottom-right
        aligned on the global sequence, whatever the layout); differentiable, each
        device's share of the slopes' cotangent summed by `shard_map`'s transpose.
    - `sinks`: as in `flash_attention` (the same on every device), counted once: it joins
        each row's result after the ring has merged every key shard.
    - `score_mod`, `mask_mod`: as in `flash_attention`, with `q_idx`/`kv_idx` the
        *global* positions (whatever the layout); `batch` and `head` index this
        device's shard of the batch and heads axes. Gradients reach the score_mod's
        arrays, each device's share summed by `shard_map`'s transpose. Inside
        `shard_map(..., check_vma=False)` only (else `NotImplementedError`).
    - `return_max_scores`: as in `flash_attention`: each local row's largest attended
        score over every key of the ring (a running max carried with the merge).
    - `axis_name`: the mesh axis the sequence is sharded over.
    - `block_q`, `block_k`: kernel block sizes within one chunk.
    - `kernels`: the kernel family of every chunk pair, as in `flash_attention`.
    - `layout`: how the global sequence was cut into the shards. `"contiguous"`: device
        `i` holds the `i`-th slice. `"zigzag"`: the sequence is cut into `2n` chunks and
        device `i` holds chunks `i` and `2n-1-i` (balances causal work). `"striped"`:
        device `i` holds tokens `i, i+n, i+2n, ...`. `to_ring_layout` arranges a global
        array so that plain contiguous sharding gives each device its part.

    **Returns:**

    The local shard of `(out, lse)` (and the max scores), as `flash_attention` returns
    them.

    Dropout and dense `attn_mask` are not supported on the ring, nor are `q_lengths` and
    `kv_lengths` on the shards (an error says so): `sharded_flash_attention` takes them on
    global arrays, or pass them as segment ids. `block_mask` raises `NotImplementedError`
    (pass the `mask_mod` alone).
    """
    arguments = locals()
    refuse("ring_flash_attention", arguments, {
        "block_mask": "pass the mask_mod alone (evaluated on every block pair the ring "
                      "visits, blocks it empties skipped), or express the mask with causal=, "
                      "window= or segment ids",
        **{name: "use sharded_flash_attention(..., q_lengths=, kv_lengths=) on the global "
                 "arrays (each device holds a shard of the sequence), or mark the padding "
                 "with q_segment_ids/kv_segment_ids" for name in ("q_lengths", "kv_lengths")},
    })
    check_layout(layout)
    del arguments["axis_name"], arguments["layout"]
    # The bias holds this device's rows against every key (`ring_operands`).
    bound = bind("ring_flash_attention", **arguments,
                 key_columns=lambda: ring_size(axis_name) * jnp.shape(k)[-2])
    n = ring_size(axis_name)
    if (score_mod is not None or mask_mod is not None) and varying_axes_of(
            (bound.q, bound.k, bound.v)):
        # The kernels replay a traced score_mod/mask_mod, whose operations would mix
        # varying positions with invariant values, which check_vma=True refuses.
        raise NotImplementedError(
            "ring_flash_attention takes score_mod/mask_mod only inside "
            "jax.shard_map(..., check_vma=False); alibi_slopes= and bias= work either way"
        )
    ring, mod_ops = ring_of(bound, axis_name, n, layout)
    q, k, v = split_heads(bound.q, bound.k, bound.v, bound.shapes)
    ops = combine(bound.operands, mod_ops)
    # The sink joins the merged result once, after the ring has seen every key.
    out, lse, top = ring_attention(ring, q, k, v, replace(ops, sinks=None))
    out, lse = softmax.with_sink(out, lse, None if ops.sinks is None else ops.sinks[..., 0])
    out, lse = merge_heads(out, lse, bound.shapes)
    return (out, lse, top.reshape(lse.shape)) if bound.return_max_scores else (out, lse)


def ring_size(axis_name: Hashable) -> int:
    """The size of mesh axis `axis_name` (inside `jax.shard_map`)."""
    try:
        return jax.lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"ring_flash_attention must run inside jax.shard_map over a mesh with axis "
            f"axis_name={axis_name!r}; for global arrays use sharded_flash_attention"
        ) from None


def ring_of(bound: Bound, axis_name: Hashable, n: int, layout: Layout, local: Any = None
            ) -> tuple[Ring, Operands]:
    """The static description of a ring call on `n` devices whose local shard has the
    shapes `local` (default: `bound`'s), and the operands holding the arrays its
    score_mod/mask_mod read (traced at the ring's block sizes)."""
    shapes, m = (bound.shapes if local is None else local), subchunks(layout)
    for name, seq in (("seq_q", shapes.seq_q), ("seq_k", shapes.seq_k)):
        if seq % m:
            raise ValueError(
                f"layout={layout!r} splits each shard into {m} pieces; the local {name}={seq} "
                f"must be divisible by {m}"
            )
    piece = dataclasses.replace(shapes, seq_q=shapes.seq_q // m, seq_k=shapes.seq_k // m)
    # The kernel choice, made once.
    base = choose(call_of(bound, piece)._replace(pieces=True), bound.options.kernels,
                  split_k=False)
    mods, mod_ops = trace_mods(bound.score_mod, bound.mask_mod, shapes.heads, shapes.groups,
                               base.block_q, base.block_k, stat_dtype(bound.q.dtype))
    # ALiBi aligns the global indices on the global sequence (`ring_operands`). Lengths
    # travel as segment ids (`sharded`), so nothing aligns on them at run time; the ring
    # computes in the inputs' dtype.
    base = dataclasses.replace(base, mods=mods, alibi_offset=n * (shapes.seq_k - shapes.seq_q),
                               positions=bound.operands.has_positions, lengths=False,
                               compute_dtype=None)
    return Ring(axis_name=axis_name, num_devices=n, layout=layout, base=base), mod_ops


def ring_attention(ring: Ring, q: Array, k: Array, v: Array, ops: Operands
                   ) -> tuple[Array, Array, Array]:
    """Ring attention on one device's shard in the internal layout (`_core.shapes`):
    `(out, lse, max_scores)` of its queries, internal too (the max over the whole ring).
    `ops` holds the "columns" operands (`ring_operands`) against every key of the ring."""
    cfg, m = ring.base, ring.pieces
    pad_q, pad_k = cfg.padded_seq
    qs = tuple(pad_sequence(x, 3, pad_q) for x in jnp.split(q, m, axis=3))
    ks = tuple(pad_sequence(x, 2, pad_k) for x in jnp.split(k, m, axis=2))
    vs = tuple(pad_sequence(x, 2, pad_k) for x in jnp.split(v, m, axis=2))
    ring_ops = cut_for_ring(ops, m, ring.num_devices * m, pad_q, pad_k)
    # Replicated operands (slopes) vary like q under check_vma=True: the transpose of that
    # cast sums the devices' shares of their cotangents.
    ring_ops = vary(ring_ops, (qs, ks, vs))
    (home_diff, common_diff), const = split_differentiable(ring_ops)
    out, lse, top = cast(tuple[Any, Any, Any], _ring_attention_ad(
        ring, qs, ks, vs, home_diff, common_diff, const))
    out = jnp.concatenate([o[..., : cfg.seq_q, :] for o in out], axis=3)
    lse, top = (jnp.concatenate([x[..., : cfg.seq_q] for x in t], axis=3) for t in (lse, top))
    return out, lse, jax.lax.stop_gradient(top)

