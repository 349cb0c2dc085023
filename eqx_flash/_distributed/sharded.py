"""Global-array entry point for ring attention.

`sharded_flash_attention` takes and returns global arrays: it reorders the sequence for
the chosen layout, runs `ring_flash_attention` under `jax.shard_map` over the sequence
mesh axis (batch and heads may be sharded over other axes at the same time), and
restores the order.
"""

import functools
import math
from collections.abc import Hashable

import equinox as eqx
import jax
import jax.numpy as jnp
from beartype import beartype
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, jaxtyped

from .._api.binder import check_lengths, check_masks, check_qkv, check_score_mods, is_concrete
from .._core.options import AttentionOptions, make_options
from .._core.types import (
    LSE,
    AlibiSlopes,
    Bias,
    BlockSize,
    Flag,
    Key,
    KeyMask,
    KeySegmentIds,
    Lengths,
    MaskMod,
    OptionalReal,
    Output,
    Query,
    QuerySegmentIds,
    ScoreMod,
    Value,
    WindowLike,
)
from .._distributed.ring import refuse_on_ring, ring_attention
from .._distributed.sequence_order import (
    Layout,
    check_layout,
    from_ring_layout,
    ring_order,
    to_ring_layout,
    zigzag_in_map,
)
from .._mods.block_mask import BlockMask
from .._semantics.masking import Masks


def _spec(ndim: int, placed: dict[int, Hashable | None]) -> PartitionSpec:
    axes: list[Hashable | None] = [None] * ndim
    for position, name in placed.items():
        axes[position] = name
    return PartitionSpec(*axes)


@jaxtyped(typechecker=beartype)
def sharded_flash_attention(
    q: Query,
    k: Key,
    v: Value,
    mask: KeyMask | None = None,
    *,
    mesh: Mesh,
    seq_axis: str,
    batch_axis: str | None = None,
    head_axis: str | None = None,
    layout: Layout | None = None,
    causal: Flag = False,
    window: WindowLike = None,
    q_segment_ids: QuerySegmentIds | None = None,
    kv_segment_ids: KeySegmentIds | None = None,
    q_lengths: Lengths | None = None,
    kv_lengths: Lengths | None = None,
    scale: OptionalReal = None,
    softcap: OptionalReal = None,
    block_q: BlockSize = None,
    block_k: BlockSize = None,
    bias: Bias | None = None,
    alibi_slopes: AlibiSlopes | None = None,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    block_mask: BlockMask | None = None,
) -> tuple[Output, LSE]:
    """`flash_attention` on global arrays, with the sequence sharded over `mesh`.

    **Arguments:**

    - `q`, `k`, `v`, `mask`, `causal`, `window`, `q_segment_ids`, `kv_segment_ids`,
        `scale`, `softcap`, `block_q`, `block_k`: as in `flash_attention` (global arrays).
    - `q_lengths`, `kv_lengths`: as in `flash_attention`, carried round the ring as
        segment ids (padding gets ids no valid row has, and is zeroed so that NaN there
        reaches nothing); blocks past the lengths are still computed. With `causal` or a
        `window`, `kv_lengths - q_lengths` must equal `seq_k - seq_q` (as for padded
        self-attention with equal lengths), since the ring aligns them on the global
        sequence: otherwise an error (`eqx.error_if` under `jax.jit`).
    - `bias`, `alibi_slopes`: as in `flash_attention` (global arrays; ALiBi at global
        positions), both differentiable. The bias is reordered with the sequence and
        sharded by query rows: each device holds its queries' rows against all keys,
        `seq_q * seq_k / devices` entries (`ring_flash_attention`).
    - `mesh`: a `jax.sharding.Mesh`.
    - `seq_axis`: mesh axis the sequence is split over (the ring).
    - `batch_axis`: optional mesh axis for the first leading axis of q, k, v (data
        parallel).
    - `head_axis`: optional mesh axis for the heads axis (tensor parallel); must divide
        the number of kv heads.
    - `layout`: sequence order on the ring (see `ring_flash_attention`). Default:
        `"zigzag"` for causal or windowed attention when the lengths allow (balanced
        work), else `"contiguous"`.

    **Returns:**

    `(out, lse)` as `flash_attention` returns them, as global arrays sharded like q.

    `score_mod`, `mask_mod` and `block_mask` raise `NotImplementedError`: use
    `alibi_slopes`/`bias` and causal/window/segment ids, or `ring_flash_attention` (which
    takes `score_mod`/`mask_mod`) inside your own `jax.shard_map`.
    """
    for name, value in (("score_mod", score_mod), ("mask_mod", mask_mod),
                        ("block_mask", block_mask)):
        refuse_on_ring(
            "sharded_flash_attention", name, value,
            "call ring_flash_attention inside your own jax.shard_map (it takes score_mod "
            "and mask_mod, at global positions), or use alibi_slopes=/bias= for score "
            "terms and causal=, window=, a key mask or segment ids for masks",
        )
    options = make_options(
        causal=causal, window=window, scale=scale, softcap=softcap, block_q=block_q,
        block_k=block_k,
    )
    if layout is not None:
        check_layout(layout)
    q, k, v, shapes = check_qkv(q, k, v)
    check_masks(shapes, mask, None, q_segment_ids, kv_segment_ids)  # clear shape errors
    check_score_mods(shapes, bias, alibi_slopes)
    if q_lengths is not None or kv_lengths is not None:
        q, k, v, q_segment_ids, kv_segment_ids = _lengths_as_segment_ids(
            shapes, options, q, k, v, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids
        )
    if seq_axis not in mesh.shape:
        raise ValueError(f"seq_axis={seq_axis!r} is not an axis of the mesh {dict(mesh.shape)}")
    n = mesh.shape[seq_axis]
    if layout is None:
        balanced = n > 1 and not options.window.is_unbounded
        fits = shapes.seq_q % (2 * n) == 0 and shapes.seq_k % (2 * n) == 0
        layout = "zigzag" if balanced and fits else "contiguous"
    for seq in (shapes.seq_q, shapes.seq_k):
        ring_order(seq, n, layout)  # raises on lengths the layout cannot split
    if batch_axis is not None and not shapes.batch_shape:
        raise ValueError(f"batch_axis={batch_axis!r} needs a batch axis; got q.shape={q.shape}")
    if head_axis is not None and not shapes.has_heads_axis:
        raise ValueError(f"head_axis={head_axis!r} needs a heads axis; got q.shape={q.shape}")
    extras = {}
    for name, x, seq in (
        ("mask", mask, shapes.seq_k),
        ("q_segment_ids", q_segment_ids, shapes.seq_q),
        ("kv_segment_ids", kv_segment_ids, shapes.seq_k),
    ):
        if x is None:
            continue
        x = jnp.asarray(x)
        # Broadcast to (*batch, [heads,] seq) so every mesh axis splits a real axis.
        with_heads = shapes.has_heads_axis and x.ndim == q.ndim - 1
        lead = shapes.lead_shape if with_heads else shapes.batch_shape
        extras[name] = jnp.broadcast_to(x, (*lead, seq))
    if bias is not None:
        # Leading axes filled out to q's, so that batch and heads shard by position.
        bias = jnp.asarray(bias)
        extras["bias"] = bias.reshape((1,) * (q.ndim - bias.ndim) + bias.shape)
    if alibi_slopes is not None:
        slopes = jnp.asarray(alibi_slopes)
        extras["alibi_slopes"] = (
            jnp.broadcast_to(slopes, shapes.lead_shape) if shapes.has_heads_axis else slopes
        )
    return _sharded(
        q, k, v, extras, mesh=mesh, seq_axis=seq_axis, batch_axis=batch_axis,
        head_axis=head_axis, layout=layout, options=options,
    )


# Segment ids of padding: no valid row has them, and a padded query's is not a padded key's.
PADDED_QUERY_ID = jnp.iinfo(jnp.int32).min
PADDED_KEY_ID = jnp.iinfo(jnp.int32).min + 1


def _lengths_as_segment_ids(shapes, options, q, k, v, q_lengths, kv_lengths, q_ids, kv_ids):
    """Valid lengths as segment ids the ring already carries, with the padded rows of q,
    k, v zeroed (`_masking.valid_rows`'s guarantee: NaN padding reaches nothing)."""
    masks = check_lengths(shapes, Masks(), q_lengths, kv_lengths)
    batch = shapes.batch_shape

    def per_element(length: Array | None, seq: int) -> Array:
        # (batch|1, 1, 1, 1, 1) -> (*batch,) (or () without batch axes)
        if length is None:
            return jnp.full(batch, seq, jnp.int32)
        return jnp.broadcast_to(length.reshape(-1), (math.prod(batch),)).reshape(batch)

    q_len = per_element(masks.q_lengths, shapes.seq_q)
    kv_len = per_element(masks.kv_lengths, shapes.seq_k)
    if not options.window.is_unbounded:  # causal too: the ring aligns on the global lengths
        offset = shapes.seq_k - shapes.seq_q
        message = (
            f"sharded_flash_attention with causal/window needs kv_lengths - q_lengths == "
            f"seq_k - seq_q = {offset} (the ring aligns the diagonal on the global sequence)"
        )
        bad = jnp.any(kv_len - q_len != offset)
        if not is_concrete(bad):
            q_len = eqx.error_if(q_len, bad, message)
        elif bool(bad):
            raise ValueError(message)
    q_valid = jnp.arange(shapes.seq_q) < q_len[..., None]  # (*batch, seq_q)
    k_valid = jnp.arange(shapes.seq_k) < kv_len[..., None]

    def rows(x: Array, valid: Array) -> Array:  # zero the padded rows of (*lead, seq, dim)
        if shapes.has_heads_axis:
            valid = valid[..., None, :]
        return jnp.where(valid[..., None], x, jnp.zeros((), x.dtype))

    def ids(given, valid: Array, padded: int) -> Array:
        if given is not None:
            given = jnp.asarray(given)
            if shapes.has_heads_axis and given.ndim == q.ndim - 1:
                valid = valid[..., None, :]
        base = jnp.zeros((), jnp.int32) if given is None else given.astype(jnp.int32)
        return jnp.where(valid, base, jnp.asarray(padded, jnp.int32))

    return (rows(q, q_valid), rows(k, k_valid), rows(v, k_valid),
            ids(q_ids, q_valid, PADDED_QUERY_ID), ids(kv_ids, k_valid, PADDED_KEY_ID))


# Extras not reordered along their last axis as the sequence is (`_sharded`).
_ARRANGED_OUTSIDE = ("bias", "alibi_slopes")


def _bias_spec(bias: Array, seq_axis: str, batch_axis: str | None, head_axis: str | None,
               with_heads: bool) -> PartitionSpec:
    """Bias (q's number of axes) sharded by query rows, and by batch and heads where it
    has those axes (size-1 axes broadcast, so they are replicated)."""
    placed: dict[int, Hashable | None] = {}
    if bias.shape[-2] != 1:
        placed[bias.ndim - 2] = seq_axis
    if batch_axis is not None and bias.shape[0] != 1:
        placed[0] = batch_axis
    if with_heads and head_axis is not None and bias.shape[-3] != 1:
        placed[bias.ndim - 3] = head_axis
    return _spec(bias.ndim, placed)


def _slopes_spec(slopes: Array, batch_axis: str | None, head_axis: str | None,
                 with_heads: bool) -> PartitionSpec:
    """ALiBi slopes `(*batch, heads)`, replicated along the ring."""
    placed: dict[int, Hashable | None] = {}
    if with_heads and batch_axis is not None and slopes.ndim > 1:
        placed[0] = batch_axis
    if with_heads and head_axis is not None:
        placed[slopes.ndim - 1] = head_axis
    return _spec(slopes.ndim, placed)


@functools.partial(
    jax.jit,
    static_argnames=("mesh", "seq_axis", "batch_axis", "head_axis", "layout", "options"),
)
def _sharded(
    q, k, v, extras, *, mesh, seq_axis, batch_axis, head_axis, layout,
    options: AttentionOptions,
):
    n = mesh.shape[seq_axis]

    def spec(x: Array, with_heads: bool) -> PartitionSpec:
        placed = {x.ndim - 1: seq_axis}
        if batch_axis is not None:
            placed[0] = batch_axis
        if with_heads and head_axis is not None:
            placed[x.ndim - 2] = head_axis
        return _spec(x.ndim, placed)

    qkv_specs = []
    for x in (q, k, v):
        placed = {x.ndim - 2: seq_axis}
        if batch_axis is not None:
            placed[0] = batch_axis
        if head_axis is not None:
            placed[x.ndim - 3] = head_axis
        qkv_specs.append(_spec(x.ndim, placed))
    extra_specs = {
        name: spec(x, with_heads=x.ndim == q.ndim - 1) for name, x in extras.items()
        if name not in ("bias", "alibi_slopes")
    }
    if "bias" in extras:
        extra_specs["bias"] = _bias_spec(extras["bias"], seq_axis, batch_axis, head_axis,
                                         with_heads=q.ndim > 2)
    if "alibi_slopes" in extras:
        extra_specs["alibi_slopes"] = _slopes_spec(extras["alibi_slopes"], batch_axis,
                                                   head_axis, with_heads=q.ndim > 2)
    lse_spec = PartitionSpec(*qkv_specs[0][:-1])

    # Zigzag is reached from contiguous shards by moving whole chunks between devices
    # inside the map (two ppermutes); striped needs a token-level shuffle, left to XLA.
    in_map = layout == "zigzag"

    def local(q, k, v, extras):
        if in_map:
            q, k, v = (zigzag_in_map(x, seq_axis, n, x.ndim - 2, inverse=False)
                       for x in (q, k, v))
            extras = {
                name: x if name in _ARRANGED_OUTSIDE else
                zigzag_in_map(x, seq_axis, n, x.ndim - 1, inverse=False)
                for name, x in extras.items()
            }
        out, lse = ring_attention(
            q, k, v, extras.get("mask"), extras.get("q_segment_ids"),
            extras.get("kv_segment_ids"), extras.get("bias"), extras.get("alibi_slopes"),
            axis_name=seq_axis, layout=layout, options=options,
        )
        if in_map:
            out = zigzag_in_map(out, seq_axis, n, out.ndim - 2, inverse=True)
            lse = zigzag_in_map(lse, seq_axis, n, lse.ndim - 1, inverse=True)
        return out, lse

    ring = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(*qkv_specs, extra_specs),
        out_specs=(qkv_specs[0], lse_spec),
        # The blockwise kernels create unsharded accumulators; see ring_flash_attention.
        check_vma=False,
    )

    def arrange(x: Array, axis: int) -> Array:
        return to_ring_layout(x, num_devices=n, layout=layout, axis=axis)

    if "bias" in extras:
        # Rows and columns in ring order, whatever the layout: the rows are sharded like
        # the queries and each device slices the columns of the visiting keys.
        bias = extras["bias"]
        for axis in (-2, -1):
            bias = bias if bias.shape[axis] == 1 else arrange(bias, axis)
        extras = {**extras, "bias": bias}
    if in_map:
        return ring(q, k, v, extras)

    q, k, v = arrange(q, -2), arrange(k, -2), arrange(v, -2)
    out, lse = ring(q, k, v, {name: x if name in _ARRANGED_OUTSIDE else arrange(x, -1)
                              for name, x in extras.items()})
    return (
        from_ring_layout(out, num_devices=n, layout=layout, axis=-2),
        from_ring_layout(lse, num_devices=n, layout=layout, axis=-1),
    )
