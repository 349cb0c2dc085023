"""`FlashMultiheadAttention`: a drop-in replacement for `eqx.nn.MultiheadAttention` with
memory linear in the sequence, grouped-query attention and KV-cache decoding."""

import typing
import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._core.checking import checked
from .._core.options import make_options
from .._core.types import (
    AlibiSlopes,
    Bias,
    BlockSize,
    Flag,
    KernelsName,
    KeyPositions,
    Lengths,
    MaskMod,
    OptionalReal,
    QueryPositions,
    RealNumber,
    ScoreMod,
    WindowLike,
)
from .._mods.block_mask import BlockMask
from .cache import KVCache
from .cache_decoding import decode_with_cache
from .module_call import (
    ONE_EXAMPLE,
    DecodeProcessHeads,
    Mask,
    ProcessHeads,
    attend_heads,
    check_dropout_p,
    dropout_rate,
    normalise_window,
    per_call_arrays,
    process,
    project,
    static_options,
)


@typing.final
class FlashMultiheadAttention(eqx.Module):
    """Multi-head attention with the fields, initialisation and call signature of
    `eqx.nn.MultiheadAttention`, computed blockwise with memory linear in the sequence
    length, plus grouped-query attention (`num_kv_heads`), causal/sliding-window masks
    and logit soft-capping.

    With the same weights it matches `eqx.nn.MultiheadAttention` to float32 round-off,
    except for a query with no key to attend (all masked): Equinox averages the values,
    this module uses 0 for that head before the output projection.
    """

    query_proj: eqx.nn.Linear
    key_proj: eqx.nn.Linear
    value_proj: eqx.nn.Linear
    output_proj: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    query_size: int = eqx.field(static=True)
    key_size: int = eqx.field(static=True)
    value_size: int = eqx.field(static=True)
    output_size: int = eqx.field(static=True)
    qk_size: int = eqx.field(static=True)
    vo_size: int = eqx.field(static=True)
    use_query_bias: bool = eqx.field(static=True)
    use_key_bias: bool = eqx.field(static=True)
    use_value_bias: bool = eqx.field(static=True)
    use_output_bias: bool = eqx.field(static=True)
    causal: bool = eqx.field(static=True)
    window: WindowLike = eqx.field(static=True)
    softcap: float | None = eqx.field(static=True)
    block_q: int | None = eqx.field(static=True)
    block_k: int | None = eqx.field(static=True)
    kernels: str | None = eqx.field(static=True)
    # Not static: an `eqx.Module` modification trains with the model (see FlashAttention).
    score_mod: ScoreMod | None
    mask_mod: MaskMod | None
    # Learnable attention sinks, one logit per query head (`use_sinks=True`), else None.
    sinks: Float[Array, " num_heads"] | None

    def __init__(
        self,
        num_heads: int,
        query_size: int,
        key_size: int | None = None,
        value_size: int | None = None,
        output_size: int | None = None,
        qk_size: int | None = None,
        vo_size: int | None = None,
        use_query_bias: bool = False,
        use_key_bias: bool = False,
        use_value_bias: bool = False,
        use_output_bias: bool = False,
        dropout_p: RealNumber = 0.0,
        inference: bool = False,
        dtype: Any = None,
        *,
        num_kv_heads: int | None = None,
        causal: Flag = False,
        window: WindowLike = None,
        softcap: OptionalReal = None,
        block_q: BlockSize = None,
        block_k: BlockSize = None,
        kernels: KernelsName = None,
        score_mod: ScoreMod | None = None,
        mask_mod: MaskMod | None = None,
        use_sinks: bool = False,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        The positional arguments and `key` are those of `eqx.nn.MultiheadAttention`; with
        the same `key` (and `num_kv_heads == num_heads`) the initial weights are
        identical.

        - `num_heads`: number of query heads.
        - `query_size`, `key_size`, `value_size`, `output_size`: channels of the inputs
            and the output (all but `query_size` default to `query_size`).
        - `qk_size`, `vo_size`: channels per head (default `query_size // num_heads`).
        - `use_query_bias`, `use_key_bias`, `use_value_bias`, `use_output_bias`: biases.
        - `dropout_p`: dropout probability on the attention weights.
        - `inference`: if `True`, no dropout (see `eqx.nn.inference_mode`).
        - `dtype`: parameter dtype (default float32, or float64 in x64 mode).
        - `num_kv_heads`: key/value heads (default `num_heads`); must divide
            `num_heads`. Fewer gives grouped-query attention, 1 multi-query.
        - `causal`, `window`, `softcap`, `block_q`, `block_k`, `kernels`: as in
            `flash_attention`.
        - `score_mod`, `mask_mod`: as in `flash_attention`, on the projected heads (`batch`
            is 0, `head` the query head); an `eqx.Module` such as `RelativePositionBias`
            trains with the layer. Replaceable per call.
        - `use_sinks`: if `True`, a learnable `sinks` field `(num_heads,)`, initialised to
            0: each head's logit in every row's softmax denominator (as `flash_attention`'s
            `sinks`), used by `__call__` and `decode`.
        - `key`: PRNG key for the initialisation.
        """
        if not isinstance(use_sinks, bool):
            raise TypeError(f"use_sinks must be a bool; got use_sinks={use_sinks!r}")
        # Checked before any size is derived or any Linear is built with a bad size.
        _check_head_counts(num_heads, num_heads if num_kv_heads is None else num_kv_heads)
        _check_sizes(query_size=query_size, key_size=key_size, value_size=value_size,
                     output_size=output_size, qk_size=qk_size, vo_size=vo_size)
        # Exactly eqx.nn.MultiheadAttention's key use, so weights agree for the same key.
        qkey, kkey, vkey, okey = jax.random.split(key, 4)
        key_size = query_size if key_size is None else key_size
        value_size = query_size if value_size is None else value_size
        qk_size = query_size // num_heads if qk_size is None else qk_size
        vo_size = query_size // num_heads if vo_size is None else vo_size
        output_size = query_size if output_size is None else output_size
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        _check_sizes(qk_size=qk_size, vo_size=vo_size)  # the derived defaults may be 0

        self.query_proj = eqx.nn.Linear(
            query_size, num_heads * qk_size, use_bias=use_query_bias, dtype=dtype, key=qkey
        )
        self.key_proj = eqx.nn.Linear(
            key_size, num_kv_heads * qk_size, use_bias=use_key_bias, dtype=dtype, key=kkey
        )
        self.value_proj = eqx.nn.Linear(
            value_size, num_kv_heads * vo_size, use_bias=use_value_bias, dtype=dtype, key=vkey
        )
        self.output_proj = eqx.nn.Linear(
            num_heads * vo_size, output_size, use_bias=use_output_bias, dtype=dtype, key=okey
        )
        self.dropout = eqx.nn.Dropout(dropout_p, inference=inference)

        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.query_size = query_size
        self.key_size = key_size
        self.value_size = value_size
        self.output_size = output_size
        self.qk_size = qk_size
        self.vo_size = vo_size
        self.use_query_bias = use_query_bias
        self.use_key_bias = use_key_bias
        self.use_value_bias = use_value_bias
        self.use_output_bias = use_output_bias
        self.causal = causal
        self.window = normalise_window(window)
        self.softcap = softcap
        self.block_q = block_q
        self.block_k = block_k
        self.kernels = kernels
        self.score_mod = score_mod
        self.mask_mod = mask_mod
        self.sinks = jnp.zeros(num_heads, self.query_proj.weight.dtype) if use_sinks else None

    def __check_init__(self):
        _check_head_counts(self.num_heads, self.num_kv_heads)
        _check_sizes(**{name: getattr(self, name) for name in (
            "query_size", "key_size", "value_size", "output_size", "qk_size", "vo_size")})
        make_options(**static_options(self))
        check_dropout_p("dropout_p", self.dropout.p)

    @classmethod
    def from_eqx(
        cls, mha: eqx.nn.MultiheadAttention, **flash_options: Any
    ) -> "FlashMultiheadAttention":
        """Convert an `eqx.nn.MultiheadAttention`, keeping its weights and dropout.

        **Arguments:**

        - `mha`: the module to convert.
        - `**flash_options`: any of `causal`, `window`, `softcap`, `block_q`, `block_k`,
            `kernels`, `score_mod`, `mask_mod`, `use_sinks` (sinks initialised to 0).

        **Returns:**

        A `FlashMultiheadAttention` sharing `mha`'s projections and dropout.
        """
        allowed = {"causal", "window", "softcap", "block_q", "block_k", "score_mod",
                   "mask_mod", "use_sinks"}
        unknown = set(flash_options) - allowed
        if unknown:
            raise TypeError(
                f"from_eqx got unexpected options {sorted(unknown)}; allowed: {sorted(allowed)}"
            )
        # The modifications may hold arrays: put them in after the abstract build.
        mods = (flash_options.pop("score_mod", None), flash_options.pop("mask_mod", None))
        # Build the shell abstractly (no random init), then put mha's own leaves in it.
        shell = eqx.filter_eval_shape(
            cls,
            mha.num_heads,
            mha.query_size,
            mha.key_size,
            mha.value_size,
            mha.output_size,
            mha.qk_size,
            mha.vo_size,
            mha.use_query_bias,
            mha.use_key_bias,
            mha.use_value_bias,
            mha.use_output_bias,
            dtype=mha.query_proj.weight.dtype,
            key=jax.random.key(0),
            **flash_options,
        )
        sinks = None if shell.sinks is None else jnp.zeros(shell.sinks.shape,
                                                            shell.sinks.dtype)
        return eqx.tree_at(
            lambda m: (m.query_proj, m.key_proj, m.value_proj, m.output_proj, m.dropout,
                       m.score_mod, m.mask_mod, m.sinks),
            shell,
            (mha.query_proj, mha.key_proj, mha.value_proj, mha.output_proj, mha.dropout,
             *mods, sinks),
            is_leaf=lambda x: x is None,
        )

    @checked(one_example=ONE_EXAMPLE)
    def __call__(
        self,
        query: Float[Array, "seq_q query_size"],
        key_: Float[Array, "seq_k key_size"],
        value: Float[Array, "seq_k value_size"],
        mask: Mask | None = None,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
        deterministic: bool | None = None,
        process_heads: ProcessHeads | None = None,
        q_lengths: Lengths | None = None,
        kv_lengths: Lengths | None = None,
        q_positions: QueryPositions | None = None,
        kv_positions: KeyPositions | None = None,
        bias: Bias | None = None,
        alibi_slopes: AlibiSlopes | None = None,
        score_mod: ScoreMod | None = None,
        mask_mod: MaskMod | None = None,
        block_mask: BlockMask | None = None,
        return_max_scores: bool = False,
    ) -> Float[Array, "seq_q output_size"] | tuple[Float[Array, "seq_q output_size"],
                                                   Float[Array, "num_heads seq_q"]]:
        """**Arguments:**

        - `query`: `(seq_q, query_size)`.
        - `key_`: `(seq_k, key_size)`.
        - `value`: `(seq_k, value_size)`.
        - `mask`: `True` attends: a key-padding mask `(seq_k,)`, or as in Equinox
            `(seq_q, seq_k)` or per head `(num_heads, seq_q, seq_k)`.
        - `key`: PRNG key for dropout (needed unless dropout is off).
        - `inference`: overrides `self.dropout.inference` for this call.
        - `deterministic`: deprecated alias of `inference`, accepted (with a warning) as
            `eqx.nn.MultiheadAttention` accepts it.
        - `process_heads`: as in Equinox, a function of the projected heads
            `(seq_q, num_heads, qk_size)`, `(seq_k, num_kv_heads, qk_size)`,
            `(seq_k, num_kv_heads, vo_size)` returning new heads of the same shapes
            (e.g. rotary embeddings).
        - `q_lengths`, `kv_lengths`, `bias`, `alibi_slopes`: as in `flash_attention`, for
            this one example: the lengths are integer scalars (`vmap` them with the batch),
            `bias` broadcasts to `(num_heads, seq_q, seq_k)`, `alibi_slopes` is
            `(num_heads,)`. A query row at or past `q_lengths` attends to nothing, so its
            output is the output projection of zeros.
        - `q_positions`, `kv_positions`: `(seq_q,)`, `(seq_k,)`, absolute positions as
            in `flash_attention`: the layer's causal mask, window and `alibi_slopes`
            measured on them (packed sequences, chunked prefill).
        - `score_mod`, `mask_mod`: for this call instead of the layer's.
        - `block_mask`: `make_block_mask(mask_mod, (), num_heads, seq_q, seq_k, block_q,
            block_k, kv_heads=num_kv_heads)` of the `mask_mod` in use.
        - `return_max_scores`: also return each head's per-row largest attended score
            `(num_heads, seq_q)` (no gradient), the statistic QK-clip/MuonClip rescales
            `query_proj` and `key_proj` by.

        **Returns:**

        `(seq_q, output_size)`, then the max scores if asked.
        """
        if deterministic is not None:
            inference = deterministic
            warnings.warn(
                "FlashMultiheadAttention()(deterministic=...) is deprecated in favour of "
                "FlashMultiheadAttention()(inference=...)",
                stacklevel=2,
            )
        for name, x, size in (("query", query, self.query_size), ("key_", key_, self.key_size),
                              ("value", value, self.value_size)):
            if x.shape[-1] != size:
                raise ValueError(
                    f"{name} must have shape (seq, {size}) for this module; got {name}.shape="
                    f"{x.shape}"
                )
        with jax.named_scope("eqx_flash.FlashMultiheadAttention"):
            q = project(self.query_proj, query, self.num_heads)
            k = project(self.key_proj, key_, self.num_kv_heads)
            v = project(self.value_proj, value, self.num_kv_heads)
            if process_heads is not None:
                q, k, v = process(process_heads, q, k, v)
            inference = self.dropout.inference if inference is None else inference
            rate = dropout_rate("dropout.p", self.dropout.p, inference, key)
            result = attend_heads(
                jnp.swapaxes(q, 0, 1), jnp.swapaxes(k, 0, 1), jnp.swapaxes(v, 0, 1), mask,
                static_options(self), rate, key,
                per_call_arrays(self, locals() | {"sinks": self.sinks}),
                return_max_scores,
            )
            heads, max_scores = result if isinstance(result, tuple) else (result, None)
            attn = jnp.swapaxes(heads, 0, 1).reshape(query.shape[0], -1)
            out = jax.vmap(self.output_proj)(attn)
            return out if max_scores is None else (out, max_scores)

    def init_cache(
        self, max_len: int, *, window: int | None = None, dtype: Any = None
    ) -> KVCache:
        """An empty `KVCache` for this layer's `decode`.

        **Arguments:**

        - `max_len`: tokens the cache can hold (linear mode).
        - `window`: a rolling buffer of this many entries instead (for a causal model
            with `window=(window - 1, 0)` or narrower).
        - `dtype`: of the buffers (default: the key projection's dtype). A lower
            precision (`jnp.bfloat16`) halves the cache's memory: `decode` writes the new
            keys and values in it and casts the queries to it for the attention call
            (which accumulates in float32), returning the output in the layer's dtype.

        **Returns:**

        `KVCache.empty(num_kv_heads, max_len, qk_size, vo_size, dtype, window=window)`.
        """
        dtype = self.key_proj.weight.dtype if dtype is None else dtype
        return KVCache.empty(self.num_kv_heads, max_len, self.qk_size, self.vo_size, dtype,
                             window=window)

    @checked(one_example=ONE_EXAMPLE)
    def decode(
        self,
        x: Float[Array, "n query_size"],
        cache: KVCache,
        *,
        process_heads: DecodeProcessHeads | None = None,
    ) -> tuple[Float[Array, "n output_size"], KVCache]:
        """Self-attention of `n` new tokens against the cached ones, returning the updated
        cache: a whole prompt (prefill) or one token (a step), by the same call. With
        `causal=True` it gives the rows of `self(x_all, x_all, x_all)` for the new tokens,
        exactly. No dropout (inference).

        **Arguments:**

        - `x`: the new tokens `(n, query_size)`, at positions `cache.length + arange(n)`.
        - `cache`: from `init_cache` (or the previous `decode`).
        - `process_heads`: `f(q, k, v, positions)` returning new `(q, k, v)` of the same
            shapes, with `q` `(n, num_heads, qk_size)`, `k` `(n, num_kv_heads, qk_size)`,
            `v` `(n, num_kv_heads, vo_size)` and `positions` `(n,)` int32, e.g. `rotary`
            at the tokens' absolute positions.

        The layer's `score_mod` and `mask_mod` are called with absolute positions too:
        `q_idx` is the token's position in the sequence and `kv_idx` the cached key's,
        as the full-sequence call would call them.

        **Returns:**

        `(out, cache)`: `(n, output_size)` and the cache holding the new tokens too.

        **Raises:**

        `ValueError` if the cache does not fit the layer, or is rolling while the layer's
        window is not causal or reaches further back than the buffer.
        """
        return decode_with_cache(self, x, cache, process_heads)


def _check_head_counts(num_heads: Any, num_kv_heads: Any) -> None:
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int; got {name}={value!r}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_kv_heads must divide num_heads; got num_heads={num_heads}, "
            f"num_kv_heads={num_kv_heads}"
        )


def _check_sizes(**sizes: Any) -> None:
    """Sizes given (not None) must be positive ints."""
    for name, value in sizes.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int; got {name}={value!r}")
