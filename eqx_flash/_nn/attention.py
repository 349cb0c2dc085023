"""`FlashAttention`: exact attention as a parameter-free Equinox module."""

import typing

import equinox as eqx
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
    Sinks,
    WindowLike,
)
from .._mods.block_mask import BlockMask
from .module_call import (
    ONE_EXAMPLE,
    Mask,
    attend_heads,
    check_dropout_p,
    dropout_rate,
    normalise_window,
    per_call_arrays,
    static_options,
)


@typing.final
class FlashAttention(eqx.Module):
    """Exact attention as a parameter-free module, with dropout on the attention weights.

    Works on one example: `jax.vmap` it over a batch. Behaves as `flash_attention`
    (which see for the meaning of each option); `dropout_p` and `inference` behave as in
    `eqx.nn.Dropout`, so `eqx.nn.inference_mode` switches dropout off.
    """

    causal: bool = eqx.field(static=True)
    window: WindowLike = eqx.field(static=True)
    softcap: float | None = eqx.field(static=True)
    scale: float | None = eqx.field(static=True)
    block_q: int | None = eqx.field(static=True)
    block_k: int | None = eqx.field(static=True)
    kernels: str | None = eqx.field(static=True)
    # Not static, as in eqx.nn.Dropout: eqx.nn.inference_mode replaces `inference`.
    dropout_p: float
    inference: bool
    # Not static: an `eqx.Module` modification (`RelativePositionBias`) trains with the
    # model; a plain function is a non-array leaf (static under `eqx.filter_jit`).
    score_mod: ScoreMod | None
    mask_mod: MaskMod | None

    def __init__(
        self,
        *,
        causal: Flag = False,
        window: WindowLike = None,
        softcap: OptionalReal = None,
        scale: OptionalReal = None,
        block_q: BlockSize = None,
        block_k: BlockSize = None,
        kernels: KernelsName = None,
        dropout_p: RealNumber = 0.0,
        inference: bool = False,
        score_mod: ScoreMod | None = None,
        mask_mod: MaskMod | None = None,
    ):
        """**Arguments:**

        - `causal`: query `i` attends to keys `j <= i + seq_k - seq_q` (bottom-right).
        - `window`: `(left, right)` or `w` for `(w, w)`, a sliding window around the
            aligned position; `None` is unbounded.
        - `softcap`: if given, logits become `softcap * tanh(logits / softcap)`.
        - `scale`: logit scale, default `1/sqrt(dim)`.
        - `block_q`, `block_k`: block sizes (default: tuned for the machine).
        - `kernels`: the kernel family, as in `flash_attention` (None: chosen per call).
        - `dropout_p`: dropout probability on the attention weights, in `[0, 1)`.
        - `inference`: if `True`, no dropout. Overridable per call.
        - `score_mod`, `mask_mod`: as in `flash_attention` (the module works on one
            example, so `batch` is 0); an `eqx.Module` such as `RelativePositionBias`
            trains with the model. Replaceable per call.
        """
        self.score_mod = score_mod
        self.mask_mod = mask_mod
        self.causal = causal
        self.window = normalise_window(window)
        self.softcap = softcap
        self.scale = scale
        self.block_q = block_q
        self.block_k = block_k
        self.kernels = kernels
        self.dropout_p = dropout_p
        self.inference = inference

    def __check_init__(self):
        make_options(**static_options(self))
        check_dropout_p("dropout_p", self.dropout_p)

    @checked(one_example=ONE_EXAMPLE)
    def __call__(
        self,
        q: Float[Array, "heads seq_q dim"],
        k: Float[Array, "kv_heads seq_k dim"],
        v: Float[Array, "kv_heads seq_k dim_v"],
        mask: Mask | None = None,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
        q_lengths: Lengths | None = None,
        kv_lengths: Lengths | None = None,
        q_positions: QueryPositions | None = None,
        kv_positions: KeyPositions | None = None,
        bias: Bias | None = None,
        alibi_slopes: AlibiSlopes | None = None,
        sinks: Sinks | None = None,
        score_mod: ScoreMod | None = None,
        mask_mod: MaskMod | None = None,
        block_mask: BlockMask | None = None,
        return_max_scores: bool = False,
    ) -> Float[Array, "heads seq_q dim_v"] | tuple[Float[Array, "heads seq_q dim_v"],
                                                   Float[Array, "heads seq_q"]]:
        """**Arguments:**

        - `q`: queries `(heads, seq_q, dim)`.
        - `k`: keys `(kv_heads, seq_k, dim)`; `kv_heads` divides `heads` (GQA/MQA).
        - `v`: values `(kv_heads, seq_k, dim_v)`.
        - `mask`: `True` attends: a key-padding mask `(seq_k,)`, or `(seq_q, seq_k)`, or
            per head `(heads, seq_q, seq_k)`.
        - `key`: PRNG key for dropout (needed unless dropout is off).
        - `inference`: overrides `self.inference` for this call.
        - `q_lengths`, `kv_lengths`, `bias`, `alibi_slopes`: as in `flash_attention`, for
            this one example: the lengths are integer scalars (`vmap` them with the batch),
            `bias` broadcasts to `(heads, seq_q, seq_k)`, `alibi_slopes` is `(heads,)`.
        - `q_positions`, `kv_positions`: `(seq_q,)`, `(seq_k,)` (or per head), absolute
            positions as in `flash_attention`: causal, the window and ALiBi measured on
            them (packed sequences, chunked prefill).
        - `sinks`: broadcastable to `(heads,)` (a scalar: one sink for every head), as in
            `flash_attention` (a trained sink is a parameter of the enclosing model,
            passed here each call).
        - `score_mod`, `mask_mod`: for this call instead of the module's.
        - `block_mask`: `make_block_mask(mask_mod, (), heads, seq_q, seq_k, block_q,
            block_k)` of the `mask_mod` in use, for this example's sizes.
        - `return_max_scores`: also return each row's largest attended score `(heads,
            seq_q)`, as `flash_attention(..., return_max_scores=True)` (no gradient).

        **Returns:**

        `(heads, seq_q, dim_v)` in q's dtype (then the max scores, if asked). A query
        that may attend to no key gets 0.
        """
        inference = self.inference if inference is None else inference
        rate = dropout_rate("dropout_p", self.dropout_p, inference, key)
        return attend_heads(
            q, k, v, mask, static_options(self), rate, key,
            per_call_arrays(self, locals()),
            return_max_scores,
        )
