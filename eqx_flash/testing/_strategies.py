"""`attention_inputs`: the Hypothesis strategy of attention problems, and the
`AttentionInputs` it draws."""

import dataclasses
import math
import types
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, DTypeLike

from .._core.shapes import ceil_div
from .._mods.block_mask import make_block_mask

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy
from ._families import BlockSparse, Dilated, Documents, HeadScaling, PrefixLM, RelativeBiasTable

# Few distinct sizes keep the number of compiled programs small. Lengths that are not
# multiples of the block sizes, 1, and lengths just over a block boundary are all here.
SEQ_LENGTHS = (1, 7, 16, 33, 64, 100, 130)
DIMS = (8, 16)
BATCH_SHAPES = ((), (2,), (2, 1))
HEADS = ((1, 1), (2, 2), (2, 1), (4, 2), (4, 1))  # (heads, kv_heads): MHA, MQA, GQA
BLOCK_SIZES = (8, 16, 32, None)
WINDOW_SIDES = (None, 0, 3, 17)
SOFTCAPS = (2.0, 5.0)
SCALES = (0.05, 0.5, 1.0)
# Logits are drawn with about this standard deviation: the softmax is peaked (a max of
# ~5 over 100 keys) but far from one-hot, so errors in any weight show in the output.
LOGIT_STD = 2.0


def _short(x: Any) -> str:
    if isinstance(x, jax.Array | np.ndarray):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return f"key{list(x.shape)}"
        return f"{x.dtype}{list(x.shape)}"
    return repr(x)


@dataclasses.dataclass(frozen=True, repr=False)
class AttentionInputs:
    """One attention problem: call `fn(inputs.q, inputs.k, inputs.v, **inputs.kwargs)`.

    **Fields:**

    - `q`: `(*batch, heads, seq_q, dim)`.
    - `k`: `(*batch, kv_heads, seq_k, dim)`.
    - `v`: `(*batch, kv_heads, seq_k, dim_v)`.
    - `kwargs`: read-only mapping of keyword arguments for `flash_attention` (`mask`,
        `attn_mask`, `causal`, `window`, segment ids, `scale`, `softcap`, block sizes, ...).
        Build a variant with `dataclasses.replace(inputs, kwargs={**inputs.kwargs, ...})`.

    Its `repr` shows shapes and dtypes, not values, so Hypothesis reports stay readable.
    """

    q: Array
    k: Array
    v: Array
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "kwargs", types.MappingProxyType(dict(self.kwargs)))

    def __repr__(self) -> str:
        kwargs = ", ".join(f"{name}={_short(value)}" for name, value in self.kwargs.items())
        return (
            f"AttentionInputs(q={_short(self.q)}, k={_short(self.k)}, v={_short(self.v)}, "
            f"kwargs=dict({kwargs}))"
        )


def _draw_score_mod(draw, rng, n_heads: int, seq_q: int, seq_k: int) -> Any:
    from hypothesis import strategies as st

    if draw(st.booleans()):
        table = 0.5 * rng.standard_normal((n_heads, seq_q + seq_k - 1), np.float32)
        return RelativeBiasTable(jnp.asarray(table), seq_k)
    return HeadScaling(jnp.asarray(1.0 + 0.3 * rng.standard_normal(n_heads, np.float32)))


def _draw_mask_mod(draw, rng, batch: int, seq_q: int, seq_k: int) -> Any:
    from hypothesis import strategies as st

    family = draw(st.sampled_from(("prefix_lm", "documents", "dilated", "block_sparse")))
    offset = seq_k - seq_q
    if family == "prefix_lm":
        return PrefixLM(int(rng.integers(0, seq_k + 1)), offset)
    if family == "documents":
        def ids(seq):
            return jnp.asarray(np.sort(rng.integers(0, 3, (batch, seq), dtype=np.int32), -1))

        return Documents(ids(seq_q), ids(seq_k))
    if family == "dilated":
        return Dilated(int(rng.integers(2, 4)), offset)
    block = int(draw(st.sampled_from((4, 8))))
    tiles = rng.random((ceil_div(seq_q, block), ceil_div(seq_k, block))) < 0.3
    return BlockSparse(jnp.asarray(tiles), block)


def _maybe(draw, flag: bool | None) -> bool:
    from hypothesis import strategies as st

    return flag if flag is not None else draw(st.booleans())


def _default_dtypes() -> tuple[Any, ...]:
    base = (jnp.float32, jnp.bfloat16, jnp.float16)
    return (*base, jnp.float64) if jax.config.read("jax_enable_x64") else base


POSITION_PATTERNS = ("offset", "restarting", "random")


def _draw_positions(draw, rng, lead: Any, seq_q: int, seq_k: int,
                    kwargs: dict[str, Any]) -> dict[str, Any]:
    # (`lead: Any`: beartype checks a `tuple[int, ...]` by sampling with the global
    # `random` module, which Hypothesis strategies must not touch.)
    """`q_positions`, `kv_positions` `(*lead, seq)` in a drawn pattern (`attention_inputs`)."""
    from hypothesis import strategies as st

    pattern = draw(st.sampled_from(POSITION_PATTERNS))
    q_index = np.broadcast_to(np.arange(seq_q, dtype=np.int32), (*lead, seq_q))
    k_index = np.broadcast_to(np.arange(seq_k, dtype=np.int32), (*lead, seq_k))
    if pattern == "offset":  # a chunk of queries somewhere among the keys
        offset = draw(st.integers(-seq_q, seq_k))
        q_pos, k_pos = q_index + offset, k_index
    elif pattern == "restarting":  # packed documents: positions start over at each id
        ids = kwargs.get("q_segment_ids"), kwargs.get("kv_segment_ids")

        def restart(index: np.ndarray, seq: int, given: Any) -> np.ndarray:
            if given is None or np.shape(given)[:-1] != lead:
                starts = np.sort(rng.integers(0, seq, (*lead, 2)), axis=-1)
                doc = (index[..., None] >= starts[..., None, :]).sum(-1)
            else:
                doc = np.asarray(given)
            first = np.where(doc[..., 1:] != doc[..., :-1], index[..., 1:], 0)
            first = np.maximum.accumulate(np.concatenate(
                [np.zeros((*lead, 1), np.int32), first], axis=-1), axis=-1)
            return (index - first).astype(np.int32)

        q_pos = restart(q_index, seq_q, ids[0])
        k_pos = restart(k_index, seq_k, ids[1])
    else:  # unsorted: blocks hold scattered positions
        top = max(seq_q, seq_k)
        q_pos = rng.integers(0, top, (*lead, seq_q), dtype=np.int32)
        k_pos = rng.integers(0, top, (*lead, seq_k), dtype=np.int32)
    return {"q_positions": jnp.asarray(q_pos), "kv_positions": jnp.asarray(k_pos)}


def attention_inputs(
    *,
    dtypes: Sequence[DTypeLike] | None = None,
    seq_lengths: Sequence[int] = SEQ_LENGTHS,
    max_seq: int | None = None,
    dims: Sequence[int] = DIMS,
    batch_shapes: Sequence[tuple[int, ...]] = BATCH_SHAPES,
    heads: Sequence[tuple[int, int]] = HEADS,
    block_sizes: Sequence[int | None] = BLOCK_SIZES,
    causal: bool | None = None,
    window: bool | None = None,
    mask: bool | None = None,
    attn_mask: bool | None = None,
    segment_ids: bool | None = None,
    softcap: bool | None = None,
    scale: bool | None = None,
    fully_masked_rows: bool | None = None,
    dropout: bool = False,
    bias: bool | None = False,
    alibi: bool | None = False,
    sinks: bool | None = False,
    lengths: bool | None = False,
    positions: bool | None = False,
    score_mod: bool | None = False,
    mask_mod: bool | None = False,
) -> "SearchStrategy[AttentionInputs]":
    """A Hypothesis strategy of `AttentionInputs`: random attention problems.

    Sizes come from small sets so that few distinct programs are compiled. Arrays are
    made with a NumPy generator from a drawn integer seed; floating inputs are drawn in float32
    and cast, and scaled so that the softmax is neither uniform nor one-hot.

    **Arguments:**

    Each `bool | None` feature is drawn when `None`, always used when `True` and never
    when `False`.

    - `dtypes`: input dtypes; default float32, bfloat16, float16, and float64 when
        `jax_enable_x64` is on.
    - `seq_lengths`, `max_seq`: the lengths `seq_q` and `seq_k` are drawn from
        (independently, so both `seq_q < seq_k` and `seq_q > seq_k` occur), at most `max_seq`.
    - `dims`: head dims; `dim` and `dim_v` are drawn independently from it.
    - `batch_shapes`: the leading axes before the heads axis.
    - `heads`: `(heads, kv_heads)` pairs; `kv_heads < heads` is grouped-query attention.
    - `block_sizes`: `block_q` and `block_k` (`None`: the default) are drawn from it.
    - `causal`, `window`: causal attention; a `(left, right)` or symmetric window.
    - `mask`: a key-padding mask `(*batch, [heads,] seq_k)` (bool or integer).
    - `attn_mask`: a dense bool mask, `(seq_q, seq_k)` or `(*batch, heads, seq_q, seq_k)`.
    - `segment_ids`: `q_segment_ids`/`kv_segment_ids`, sorted (packed sequences).
    - `softcap`, `scale`: a logit soft cap small enough to matter; an explicit scale.
    - `fully_masked_rows`: mask out every key of some query rows on purpose (with `False`
        other features, such as `causal` with `seq_q > seq_k`, may still leave rows empty).
    - `dropout`: draw `dropout_rate` in `(0, 1)` and a `key` (off unless `True`).
    - `bias`, `alibi`: an additive `bias` in one of several broadcast shapes (full,
        shared over batch, over batch and heads, per key, per query, per head) and
        `alibi_slopes` `(heads,)` or `(*batch, heads)`; `None` draws them, and both are
        off by default so that functions without these arguments keep passing.
    - `sinks`: attention `sinks` `(heads,)` or `(*batch, heads)`, of the size of the
        logits (so they matter), sometimes `-inf` for a head; off by default (`False`).
    - `lengths`: `q_lengths`/`kv_lengths` `(*batch,)` in `[0, seq]` (right padding), each
        given or not; off by default (`False`), since attention functions other than
        eqx_flash's may not take them; `None` draws, `True` always.
    - `positions`: `q_positions`/`kv_positions`, `(*batch, seq)` or per head `(*batch,
        heads, seq)`, in one of a few patterns: a chunk of queries at an offset into the
        keys (chunked prefill), packed documents whose positions restart (drawn with
        `segment_ids` when those are given), and unsorted random positions; off by
        default (`False`).
    - `score_mod`: a `score_mod` PyTree from a few families: a relative-position bias
        table (`RelativeBiasTable`) or a per-head scaling (`HeadScaling`), whose arrays
        `check_attention` differentiates. Off by default (`False`).
    - `mask_mod`: a `mask_mod` from a few families: prefix-LM (`PrefixLM`), documents
        (`Documents`), dilated (`Dilated`), random block-sparse (`BlockSparse`); with
        drawn block sizes, sometimes its `block_mask` too. Off by default (`False`).

    **Returns:**

    A `SearchStrategy[AttentionInputs]`.
    """
    from hypothesis import strategies as st

    dtypes = tuple(_default_dtypes() if dtypes is None else dtypes)
    seq_choices = tuple(n for n in seq_lengths if max_seq is None or n <= max_seq)
    if not seq_choices:
        raise ValueError(f"no sequence length in {tuple(seq_lengths)} is <= {max_seq=}")
    for name, options in (
        ("dtypes", dtypes),
        ("dims", dims),
        ("batch_shapes", batch_shapes),
        ("heads", heads),
        ("block_sizes", block_sizes),
    ):
        if not options:
            raise ValueError(f"{name} must not be empty")
    if fully_masked_rows and mask is False and attn_mask is False:
        raise ValueError("fully_masked_rows=True needs mask or attn_mask to be allowed")

    @st.composite
    def strategy(draw) -> AttentionInputs:
        dtype = draw(st.sampled_from(dtypes))
        batch_shape = tuple(draw(st.sampled_from(tuple(batch_shapes))))
        n_heads, kv_heads = draw(st.sampled_from(tuple(heads)))
        seq_q = draw(st.sampled_from(seq_choices))
        seq_k = draw(st.sampled_from(seq_choices))
        dim = draw(st.sampled_from(tuple(dims)))
        dim_v = draw(st.sampled_from(tuple(dims)))
        seed = draw(st.integers(0, 2**32 - 1))
        # NumPy, not jax.random: eager jax.random compiles a program for every new shape.
        rng = np.random.default_rng(seed)
        lead, kv_lead = (*batch_shape, n_heads), (*batch_shape, kv_heads)
        kwargs: dict[str, Any] = {}

        # Masks first, so that fully masked rows can be forced into one of them.
        empty_rows = _maybe(draw, fully_masked_rows)
        use_mask = _maybe(draw, mask)
        use_attn_mask = _maybe(draw, attn_mask)
        if empty_rows and not (use_mask or use_attn_mask):
            if mask is False and attn_mask is False:
                empty_rows = False  # drawn, not requested: nothing to mask rows with
            elif mask is not False:
                use_mask = True
            else:
                use_attn_mask = True
        if use_mask:
            shape = (*lead, seq_k) if draw(st.booleans()) else (*batch_shape, seq_k)
            keep = draw(st.sampled_from((0.5, 0.9)))
            m = rng.random(shape) < keep
            if empty_rows and not use_attn_mask:
                m[(0,) * (m.ndim - 1)] = False
            if draw(st.integers(0, 3)) == 0:
                m = m.astype(np.int32)  # integer masks: non-zero attends
            kwargs["mask"] = jnp.asarray(m)
        if use_attn_mask:
            shape = (*lead, seq_q, seq_k) if draw(st.booleans()) else (seq_q, seq_k)
            m = rng.random(shape) < 0.7
            if empty_rows:
                m[..., draw(st.integers(0, seq_q - 1)), :] = False
            kwargs["attn_mask"] = jnp.asarray(m)
        if _maybe(draw, segment_ids):
            per_head = draw(st.booleans())
            for name, seq in (("q_segment_ids", seq_q), ("kv_segment_ids", seq_k)):
                shape = (*lead, seq) if per_head else (*batch_shape, seq)
                ids = np.sort(rng.integers(0, 3, shape, dtype=np.int32), axis=-1)
                kwargs[name] = jnp.asarray(ids)
        if _maybe(draw, causal):
            kwargs["causal"] = True
        if _maybe(draw, window):
            left = draw(st.sampled_from(WINDOW_SIDES))
            right = draw(st.sampled_from(WINDOW_SIDES))
            symmetric = left is not None and draw(st.booleans())
            kwargs["window"] = left if symmetric else (left, right)
        scale_value = draw(st.sampled_from(SCALES)) if _maybe(draw, scale) else None
        if scale_value is not None:
            kwargs["scale"] = scale_value
        if _maybe(draw, softcap):
            kwargs["softcap"] = draw(st.sampled_from(SOFTCAPS))
        for name in ("block_q", "block_k"):
            block = draw(st.sampled_from(tuple(block_sizes)))
            if block is not None:
                kwargs[name] = block
        if _maybe(draw, lengths):
            for name, seq in (("q_lengths", seq_q), ("kv_lengths", seq_k)):
                if draw(st.booleans()) or name == "kv_lengths" and "q_lengths" not in kwargs:
                    full = draw(st.booleans())  # some elements use the whole sequence
                    n = rng.integers(0, seq + 1, batch_shape, dtype=np.int32)
                    kwargs[name] = jnp.asarray(np.where(full, seq, n).astype(np.int32))
        if _maybe(draw, positions):
            kwargs.update(_draw_positions(draw, rng, lead if draw(st.booleans()) else
                                          batch_shape, seq_q, seq_k, kwargs))
        if dropout:
            kwargs["dropout_rate"] = draw(st.sampled_from((0.1, 0.5)))
            kwargs["key"] = jax.random.key(seed)
        if _maybe(draw, bias):
            shape = draw(st.sampled_from((
                (*lead, seq_q, seq_k), (n_heads, seq_q, seq_k), (seq_q, seq_k), (1, seq_k),
                (*batch_shape, 1, seq_q, 1), (*lead, 1, 1),
            )))
            kwargs["bias"] = jnp.asarray(rng.standard_normal(shape, np.float32))
        if _maybe(draw, alibi):
            shape = (n_heads,) if draw(st.booleans()) else lead
            kwargs["alibi_slopes"] = jnp.asarray(0.3 * rng.random(shape, np.float32))
        if _maybe(draw, sinks):
            shape = (n_heads,) if draw(st.booleans()) else lead
            values = 2.0 * rng.standard_normal(shape).astype(np.float32)
            if draw(st.booleans()):  # a head without a sink
                values.reshape(-1)[0] = -np.inf
            kwargs["sinks"] = jnp.asarray(values)
        if _maybe(draw, score_mod):
            kwargs["score_mod"] = _draw_score_mod(draw, rng, n_heads, seq_q, seq_k)
        if _maybe(draw, mask_mod):
            batch = math.prod(batch_shape)
            kwargs["mask_mod"] = _draw_mask_mod(draw, rng, batch, seq_q, seq_k)
            blocks = (kwargs.get("block_q"), kwargs.get("block_k"))
            if None not in blocks and draw(st.booleans()):
                kwargs["block_mask"] = make_block_mask(
                    kwargs["mask_mod"], batch_shape, 1, seq_q, seq_k, *blocks)

        # q.k has standard deviation |q_scale| * sqrt(dim) for unit normal entries.
        used_scale = 1 / math.sqrt(dim) if scale_value is None else scale_value
        q_scale = LOGIT_STD / (used_scale * math.sqrt(dim))
        q = q_scale * rng.standard_normal((*lead, seq_q, dim), np.float32)
        k = rng.standard_normal((*kv_lead, seq_k, dim), np.float32)
        v = rng.standard_normal((*kv_lead, seq_k, dim_v), np.float32)
        q, k, v = (jnp.asarray(x.astype(jnp.dtype(dtype))) for x in (q, k, v))
        return AttentionInputs(q, k, v, kwargs)

    return strategy()
