"""Test utilities for attention code: Hypothesis strategies and an exactness checker.

```python
from hypothesis import given
from eqx_flash.testing import attention_inputs, check_attention

@given(attention_inputs(causal=False))
def test_my_attention(inputs):
    check_attention(my_attention, inputs)
```

`attention_inputs` needs the optional dependency `hypothesis` (`pip install
eqx_flash[testing]`); it is imported when the strategy is built, so `import eqx_flash` and
`check_attention` never need it.
"""

import dataclasses
import functools
import inspect
import math
import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, DTypeLike, Float, Int

from ._api.reference import plain_attention
from ._api.sanity import split_outputs
from ._api.sanity import value_and_grad_difference as value_and_grad_difference
from ._mods.block_mask import make_block_mask
from ._mods.tracing import StaticValue

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

__all__ = [
    "AttentionInputs",
    "BlockSparse",
    "Dilated",
    "Documents",
    "HeadScaling",
    "PrefixLM",
    "RelativeBiasTable",
    "Tolerance",
    "TOLERANCES",
    "attention_inputs",
    "check_attention",
    "value_and_grad_difference",
]

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


# --- score_mod and mask_mod families (PyTrees, so check_attention differentiates leaves) --


class RelativeBiasTable(eqx.Module):
    """score_mod: a learned bias per query head and relative position `i - j`."""

    table: Float[Array, "heads distances"]  # distances = seq_q + seq_k - 1
    seq_k: int = eqx.field(static=True)

    def __call__(self, s, b, h, i, j):
        return s + self.table[h, i - j + self.seq_k - 1].astype(s.dtype)


class HeadScaling(eqx.Module):
    """score_mod: each query head's logits times its own (learned) factor."""

    scales: Float[Array, " heads"]

    def __call__(self, s, b, h, i, j):
        return s * self.scales[h].astype(s.dtype)


class PrefixLM(eqx.Module):
    """mask_mod: keys in the prefix, and causal (bottom-right) after it."""

    prefix: int = eqx.field(static=True)
    offset: int = eqx.field(static=True)  # seq_k - seq_q

    def __call__(self, b, h, i, j):
        return (j < self.prefix) | (j <= i + self.offset)


class Documents(eqx.Module):
    """mask_mod: a query attends to the keys of its own document (ids per batch element,
    `batch` being the flat batch index)."""

    q_docs: Int[Array, "batch seq_q"]
    kv_docs: Int[Array, "batch seq_k"]

    def __call__(self, b, h, i, j):
        return self.q_docs[b, i] == self.kv_docs[b, j]


class Dilated(eqx.Module):
    """mask_mod: every `dilation`-th key around the aligned position."""

    dilation: int = eqx.field(static=True)
    offset: int = eqx.field(static=True)

    def __call__(self, b, h, i, j):
        return (i + self.offset - j) % self.dilation == 0


class BlockSparse(eqx.Module):
    """mask_mod: a random pattern of `block x block` tiles."""

    tiles: Bool[Array, "tiles_q tiles_k"]
    block: int = eqx.field(static=True)

    def __call__(self, b, h, i, j):
        return self.tiles[i // self.block, j // self.block]


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
    tiles = rng.random((-(-seq_q // block), -(-seq_k // block))) < 0.3
    return BlockSparse(jnp.asarray(tiles), block)


# --- the strategy -----------------------------------------------------------------------


def _maybe(draw, flag: bool | None) -> bool:
    from hypothesis import strategies as st

    return flag if flag is not None else draw(st.booleans())


def _default_dtypes() -> tuple[Any, ...]:
    base = (jnp.float32, jnp.bfloat16, jnp.float16)
    return (*base, jnp.float64) if jax.config.read("jax_enable_x64") else base


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
    lengths: bool | None = False,
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
    - `lengths`: `q_lengths`/`kv_lengths` `(*batch,)` in `[0, seq]` (right padding), each
        given or not; off by default (`False`), since attention functions other than
        eqx_flash's may not take them; `None` draws, `True` always.
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


# --- the checker ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """`|got - expected| <= atol * size + rtol * |expected|` elementwise, where `size` is 1
    for `out` and `lse` and the largest `|expected|` of the tensor for gradients (whose
    magnitude grows with the sequence lengths)."""

    out: tuple[float, float]
    lse: tuple[float, float]
    grad: tuple[float, float]


# (atol, rtol) per input dtype, calibrated on CPU: over 40 drawn problems the worst error of
# flash_attention against plain_attention was at most a third of these (out in bfloat16 and
# float16; a twentieth for gradients). lse is float32 for every input dtype and the logits
# are exact products of the inputs accumulated in float32, so its tolerance stays tight.
# On GPU, float32 matmuls default to TF32: pass `tolerance=` or raise the matmul precision.
TOLERANCES: dict[Any, Tolerance] = {
    jnp.dtype(jnp.float64): Tolerance(out=(1e-10, 1e-10), lse=(1e-10, 1e-10), grad=(1e-9, 1e-9)),
    jnp.dtype(jnp.float32): Tolerance(out=(2e-5, 2e-5), lse=(2e-5, 2e-5), grad=(1e-4, 1e-4)),
    jnp.dtype(jnp.float16): Tolerance(out=(2e-3, 2e-3), lse=(1e-4, 1e-4), grad=(5e-3, 5e-3)),
    jnp.dtype(jnp.bfloat16): Tolerance(out=(2e-2, 2e-2), lse=(1e-4, 1e-4), grad=(4e-2, 4e-2)),
}


# Floating array arguments whose gradients `check_attention` compares too (for a
# `score_mod`, the floating arrays of the PyTree).
DIFFERENTIABLE = ("bias", "alibi_slopes", "score_mod")
# PyTree arguments: their arrays are traced (`score_mod`'s floating ones differentiated),
# the rest is static.
MODIFICATIONS = ("score_mod", "mask_mod", "block_mask")


def _split_kwargs(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], tuple]:
    """`(arrays, static)`: array arguments (and the arrays of PyTree arguments, by name)
    and the rest as a hashable tuple."""
    arrays, static = {}, []
    for name, value in kwargs.items():
        if isinstance(value, jax.Array | np.ndarray):
            arrays[name] = value
        elif name in MODIFICATIONS and value is not None:
            keep = eqx.is_inexact_array if name in DIFFERENTIABLE else eqx.is_array
            dynamic, rest = eqx.partition(value, keep)
            arrays[name] = dynamic
            static.append((name, StaticValue(rest)))
        else:
            static.append((name, value))
    return arrays, tuple(static)


def _join(static, arrays: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments again from `_split_kwargs`' halves."""
    kwargs = dict(arrays)
    for name, value in static:
        kwargs[name] = (eqx.combine(arrays[name], value.value)
                        if isinstance(value, StaticValue) else value)
    return kwargs


def _named_grads(name: str, grad: Any) -> dict[str, Array]:
    """`{"dname": grad}`, or one entry per array leaf of a PyTree cotangent."""
    if isinstance(grad, jax.Array):
        return {f"d{name}": grad}
    leaves = jax.tree_util.tree_flatten_with_path(grad)[0]
    return {f"d{name}{jax.tree_util.keystr(path)}": g for path, g in leaves}


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind is p.VAR_KEYWORD or p.name == name for p in params)


def _evaluate(fn, static, q, k, v, arrays, weights, grads: bool):
    """`out`, `lse` (or None) and, with `grads`, the gradients with respect to q, k, v
    and every floating array argument (a bias, ALiBi slopes; `DIFFERENTIABLE`) of
    `sum(w * out) + sum(u * lse over its finite entries)` for `weights = (w, u)`."""
    fixed = {n: x for n, x in arrays.items() if n not in DIFFERENTIABLE}
    free = {n: x for n, x in arrays.items() if n in DIFFERENTIABLE}

    def call(q, k, v, free):
        return split_outputs(fn(q, k, v, **_join(static, {**fixed, **free})))

    w, u = weights
    if not grads:
        return (*call(q, k, v, free), None)
    (out, lse), vjp = jax.vjp(call, q, k, v, free)
    if out.shape != w.shape or (lse is not None and lse.shape != u.shape):
        return out, lse, None  # reported as a shape mismatch
    d_lse = None if lse is None else jnp.where(jnp.isfinite(lse), u, 0.0).astype(lse.dtype)
    dq, dk, dv, d_free = vjp((w.astype(out.dtype), d_lse))
    named = {k: g for n, grad in d_free.items() for k, g in _named_grads(n, grad).items()}
    return out, lse, {"dq": dq, "dk": dk, "dv": dv, **named}


_evaluate_jit = jax.jit(_evaluate, static_argnums=(0, 1, 7))


def _evaluate_jvp(fn, static, q, k, v, arrays, tangents):
    """Tangents of `out` and `lse` (or None) along `tangents = (dq, dk, dv, d_free)`,
    `d_free` the tangents of the floating array arguments (`DIFFERENTIABLE`) by name."""
    *d_qkv, d_free = tangents
    fixed = {n: x for n, x in arrays.items() if n not in d_free}

    def call(q, k, v, free):
        return split_outputs(fn(q, k, v, **_join(static, {**fixed, **free})))

    free = {n: arrays[n] for n in d_free}
    _, (d_out, d_lse) = jax.jvp(call, (q, k, v, free), (*d_qkv, d_free))
    return d_out, d_lse


_evaluate_jvp_jit = jax.jit(_evaluate_jvp, static_argnums=(0, 1))


def _run_jvp(fn, kwargs: Mapping[str, Any], q, k, v, tangents, jit: bool):
    kwargs = {
        name: value
        for name, value in kwargs.items()
        if name not in ("block_q", "block_k") or _accepts(fn, name)
    }
    arrays, static = _split_kwargs(kwargs)
    if not jit:
        return _evaluate_jvp(fn, static, q, k, v, arrays, tangents)
    try:
        hash((fn, static))
    except TypeError:
        return jax.jit(functools.partial(_evaluate_jvp, fn, static))(
            q, k, v, arrays, tangents
        )
    return _evaluate_jvp_jit(fn, static, q, k, v, arrays, tangents)


def _tangents(inputs: "AttentionInputs", seed: int) -> tuple[Any, ...]:
    """Random tangents of q, k, v and (by name) of the floating array arguments
    (`DIFFERENTIABLE`), scaled like them (so the logits move by O(1))."""
    rng = np.random.default_rng(seed + 1)

    def like(x):
        x32 = np.asarray(jnp.asarray(x).astype(jnp.float32))
        t = rng.standard_normal(x.shape, np.float32) * max(float(np.std(x32)), 1e-3)
        return jnp.asarray(t.astype(jnp.dtype(x.dtype)))

    d_qkv = like(inputs.q), like(inputs.k), like(inputs.v)
    arrays, _ = _split_kwargs(inputs.kwargs)
    free = {n: jax.tree.map(like, x) for n, x in arrays.items() if n in DIFFERENTIABLE}
    return (*d_qkv, free)


def _run(fn, kwargs: Mapping[str, Any], q, k, v, weights, grads: bool, jit: bool):
    kwargs = {
        name: value
        for name, value in kwargs.items()
        if name not in ("block_q", "block_k") or _accepts(fn, name)
    }
    arrays, static = _split_kwargs(kwargs)
    if not jit:
        return _evaluate(fn, static, q, k, v, arrays, weights, grads)
    try:
        hash((fn, static))
    except TypeError:  # unhashable settings: compile this once, uncached
        return jax.jit(functools.partial(_evaluate, fn, static), static_argnums=(5,))(
            q, k, v, arrays, weights, grads
        )
    return _evaluate_jit(fn, static, q, k, v, arrays, weights, grads)


def _weights(inputs: "AttentionInputs", seed: int) -> tuple[Array, Array]:
    # Made with NumPy outside the traced function: jax.random would add a threefry
    # program to every compilation.
    rng = np.random.default_rng(seed)
    lse_shape = inputs.q.shape[:-1]
    w = rng.standard_normal((*lse_shape, inputs.v.shape[-1]), np.float32)
    return jnp.asarray(w), jnp.asarray(rng.standard_normal(lse_shape, np.float32))


def _compare(
    name: str, got: Any, expected: Any, tol: tuple[float, float], per_tensor: bool,
    floor: float = 0.0,
) -> str | None:
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), dtype=np.float64)
    expected = np.asarray(jnp.asarray(expected).astype(jnp.float32), dtype=np.float64)
    if got.shape != expected.shape:
        return f"{name}: shape {got.shape}, expected {expected.shape}"
    if got.size == 0:
        return None
    neg_inf = np.isneginf(expected)
    wrong_inf = neg_inf != np.isneginf(got)
    if wrong_inf.any():
        where = tuple(int(i) for i in np.argwhere(wrong_inf)[0])
        return (
            f"{name}: -inf at {int(np.isneginf(got).sum())} entries, expected exactly at "
            f"{int(neg_inf.sum())}; first mismatch at {where}: got {got[where]!r}, "
            f"expected {expected[where]!r}"
        )
    atol, rtol = tol
    size = float(np.max(np.abs(np.where(neg_inf, 0.0, expected)))) if per_tensor else 1.0
    # A gradient that is zero in exact arithmetic (e.g. dq, dk with a single key) is only
    # round-off in both: measure it against the largest gradient of the problem instead.
    size = max(size, floor)
    limit = atol * max(size, 1e-30 if per_tensor else 1.0) + rtol * np.abs(expected)
    with np.errstate(invalid="ignore"):
        diff = np.where(neg_inf, 0.0, np.abs(got - expected))
        bad = ~(diff <= limit)  # NaN counts as bad
    if not bad.any():
        return None
    excess = np.where(bad, np.nan_to_num(diff / limit, nan=np.inf, posinf=np.inf), -1.0)
    where = tuple(int(i) for i in np.unravel_index(np.argmax(excess), excess.shape))
    scale_text = f" * max|expected|={size:.3g}" if per_tensor else ""
    return (
        f"{name}: {int(bad.sum())} of {bad.size} entries out of tolerance; worst at {where}: "
        f"got {got[where]:.6g}, expected {expected[where]:.6g}, |diff| {diff[where]:.3g} > "
        f"{limit[where]:.3g} (atol {atol:g}{scale_text} + rtol {rtol:g} * |expected|)"
    )


def check_attention(
    fn: Callable[..., Any],
    inputs: AttentionInputs,
    *,
    reference: Callable[..., Any] = plain_attention,
    grads: bool = True,
    jvp: bool = False,
    jit: bool = True,
    tolerance: Tolerance | None = None,
    seed: int = 0,
) -> None:
    """Assert that `fn` computes the same attention as `reference` on `inputs`.

    Calls `fn(inputs.q, inputs.k, inputs.v, **inputs.kwargs)` and the reference the same
    way (`block_q`/`block_k` are passed only to functions that accept them). Each returns
    `(out, lse, ...)` or just `out`. Compares `out`; `lse`, which must be `-inf` exactly
    where the reference's is; and, with `grads`, the gradients with respect to `q`, `k`, `v`
    of a fixed random linear function of `out` and of the finite entries of `lse`; and, with
    `jvp`, the forward-mode tangents (`jax.jvp`) of `out` and `lse` along fixed random
    tangents of `q`, `k`, `v` and of the floating array arguments (a bias, ALiBi slopes,
    a score_mod's arrays) (judged like gradients, and never NaN).

    **Arguments:**

    - `fn`: the attention function under test.
    - `inputs`: one problem, usually drawn from `attention_inputs`.
    - `reference`: the oracle; default `plain_attention`.
    - `grads`: also compare gradients.
    - `jvp`: also compare forward-mode tangents of `out` and `lse` (`jax.jvp`).
    - `jit`: run both functions under `jax.jit` (non-array keyword arguments static),
        which compiles much faster than running op by op; `False` for functions that
        cannot be traced.
    - `tolerance`: overrides the per-dtype table `TOLERANCES` (chosen by `q`'s dtype).
    - `seed`: seed of the random linear function the gradients are taken of.

    **Raises:**

    `AssertionError` listing, for each quantity out of tolerance, how many entries, the
    worst one (index, both values, the difference and the tolerance), and the inputs.
    """
    tol = tolerance if tolerance is not None else TOLERANCES[jnp.dtype(inputs.q.dtype)]
    q, k, v = inputs.q, inputs.k, inputs.v
    weights = _weights(inputs, seed)
    out, lse, grad = _run(fn, inputs.kwargs, q, k, v, weights, grads, jit)
    if lse is None:  # `fn` returns only `out`: leave lse out of the linear function too
        weights = (weights[0], jnp.zeros_like(weights[1]))
    ref_out, ref_lse, ref_grad = _run(reference, inputs.kwargs, q, k, v, weights, grads, jit)
    problems = []
    if jnp.dtype(out.dtype) != jnp.dtype(ref_out.dtype):
        problems.append(f"out: dtype {out.dtype}, expected {ref_out.dtype}")
    problems.append(_compare("out", out, ref_out, tol.out, per_tensor=False))
    if lse is not None and ref_lse is not None:
        problems.append(_compare("lse", lse, ref_lse, tol.lse, per_tensor=False))
    if grad is not None and ref_grad is not None:
        qkv_grads = [ref_grad[n] for n in ("dq", "dk", "dv")]
        grad_scale = max(float(jnp.max(jnp.abs(r.astype(jnp.float32)))) for r in qkv_grads)
        for name, r in ref_grad.items():
            if name not in grad:
                problems.append(f"{name}: not computed (the function ignores it?)")
                continue
            floor = 0.1 * grad_scale if name in ("dq", "dk", "dv") else 0.0
            problems.append(
                _compare(name, grad.get(name), r, tol.grad, per_tensor=True, floor=floor)
            )
    if jvp:
        tangents = _tangents(inputs, seed)
        d_out, d_lse = _run_jvp(fn, inputs.kwargs, q, k, v, tangents, jit)
        ref_d_out, ref_d_lse = _run_jvp(reference, inputs.kwargs, q, k, v, tangents, jit)
        pairs = [("d_out", d_out, ref_d_out)]
        if d_lse is not None and ref_d_lse is not None:
            pairs.append(("d_lse", d_lse, ref_d_lse))
        scale = max(float(jnp.max(jnp.abs(r.astype(jnp.float32)))) for _, _, r in pairs)
        for name, got, expected in pairs:
            problems.append(
                _compare(name, got, expected, tol.grad, per_tensor=True, floor=0.1 * scale)
            )
    problems = [p for p in problems if p is not None]
    if problems:
        report = "\n".join(f"  {p}" for p in problems)
        raise AssertionError(f"attention differs from the reference on {inputs!r}:\n{report}")
