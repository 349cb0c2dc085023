"""What both modules do when called: read their static options, decide the dropout rate,
gather the per-call arrays and hand unbatched heads to `flash_attention`.

The modules check their configuration once, in `__check_init__`, and leave every per-call
shape check to `flash_attention` (`_api.binder`).
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .._api.flash import flash_attention
from .._core.operands import public_arguments
from .._core.options import KERNEL_OPTIONS, check_rate

# What a module's shape error says when an array has more axes than one example's.
ONE_EXAMPLE = "one example — use jax.vmap for a batch"

# `(seq_k,)` key padding, `(seq_q, seq_k)` shared by all heads, or one per head.
Mask = Bool[Array, "seq_k"] | Bool[Array, "seq_q seq_k"] | Bool[Array, "heads seq_q seq_k"]

ProcessHeads = Callable[
    [
        Float[Array, "seq_q heads dim"],
        Float[Array, "seq_k kv_heads dim"],
        Float[Array, "seq_k kv_heads dim_v"],
    ],
    tuple[
        Float[Array, "seq_q heads dim"],
        Float[Array, "seq_k kv_heads dim"],
        Float[Array, "seq_k kv_heads dim_v"],
    ],
]

DecodeProcessHeads = Callable[
    [
        Float[Array, "n heads dim"],
        Float[Array, "n kv_heads dim"],
        Float[Array, "n kv_heads dim_v"],
        Int[Array, " n"],
    ],
    tuple[
        Float[Array, "n heads dim"],
        Float[Array, "n kv_heads dim"],
        Float[Array, "n kv_heads dim_v"],
    ],
]


def static_options(module: eqx.Module) -> dict[str, Any]:
    """`flash_attention`'s static keywords, as `module`'s fields of the same names hold
    them (a module without a field leaves that option at its default)."""
    return {name: getattr(module, name) for name in KERNEL_OPTIONS if hasattr(module, name)}


def normalise_window(window: Any) -> Any:
    # A list would make the static field unhashable; keep the user's form otherwise.
    return tuple(window) if isinstance(window, list) else window


def check_dropout_p(name: str, p: Any) -> None:
    """At construction: a number in `[0, 1)`, or an array (checked when called, where
    `eqx.tree_at` may have put it)."""
    if not isinstance(p, jax.Array):
        check_rate(name, p)


def dropout_rate(name: str, p: Any, inference: bool, key: PRNGKeyArray | None) -> float:
    """The rate to apply, following `eqx.nn.Dropout`: none in inference mode or at p = 0.
    `p` decides the compiled kernels, so it must be concrete here (`check_rate` says so,
    naming `name`, when it is traced)."""
    if inference:
        return 0.0
    rate = check_rate(name, p)
    if rate == 0.0:
        return 0.0
    if key is None:
        # RuntimeError, as eqx.nn.Dropout raises, so the module stays a drop-in.
        raise RuntimeError(
            "dropout needs a PRNG key when not in inference mode: pass key=..., "
            "or switch dropout off with inference=True / eqx.nn.inference_mode"
        )
    return rate


def per_call_arrays(module: Any, arguments: dict[str, Any]) -> dict[str, Any]:
    """`flash_attention`'s per-call keywords among a module call's `arguments` (its
    `locals()`): the arrays it names as `Operands` arguments (lengths, positions, score
    terms, sinks; the Equinox-style `mask` is the caller's own), the `block_mask`, and
    the `score_mod`/`mask_mod` given then, else the module's."""
    arrays = {name: arguments[name] for name in public_arguments()
              if name in arguments and name != "mask"}
    mods = {name: getattr(module, name) if arguments.get(name) is None else arguments[name]
            for name in ("score_mod", "mask_mod")}
    return dict(arrays, block_mask=arguments.get("block_mask"), **mods)


def attend_heads(
    q: Array, k: Array, v: Array, mask: Array | None, options: dict[str, Any],
    rate: float, key: PRNGKeyArray | None, per_call: dict[str, Any],
    return_max_scores: bool = False,
) -> Array | tuple[Array, Array]:
    """Unbatched `(heads, seq_q, dim)` attention with an Equinox-style mask; `options`
    are `flash_attention`'s static keywords (`static_options`) and `per_call` its array
    keywords given at call time (`per_call_arrays`). With `return_max_scores`, `(out,
    max_scores)`."""
    key_mask = attn_mask = None
    if mask is not None:
        if mask.ndim == 1:
            key_mask = mask
        else:
            attn_mask = mask
    out, _, *max_scores = flash_attention(
        q, k, v, key_mask, attn_mask=attn_mask, dropout_rate=rate,
        key=key if rate else None, return_max_scores=return_max_scores, **options,
        **per_call,
    )
    return (out, max_scores[0]) if return_max_scores else out


def project(proj: eqx.nn.Linear, x: Array, heads: int) -> Array:
    """`(seq, channels)` → `(seq, heads, channels // heads)`."""
    # The head size spelt out: a -1 cannot be resolved for zero tokens.
    out = jax.vmap(proj)(x)
    return out.reshape(x.shape[0], heads, out.shape[-1] // heads)


def process(process_heads: Callable[..., Any], q: Array, k: Array, v: Array, *extra: Any
            ) -> tuple[Array, Array, Array]:
    """`process_heads(q, k, v, *extra)`, which must keep the heads' shapes."""
    shapes = (q.shape, k.shape, v.shape)
    q, k, v = process_heads(q, k, v, *extra)
    if (q.shape, k.shape, v.shape) != shapes:
        raise ValueError(
            "process_heads must not change the shape of the heads; got "
            f"{(q.shape, k.shape, v.shape)} from {shapes}"
        )
    return q, k, v
