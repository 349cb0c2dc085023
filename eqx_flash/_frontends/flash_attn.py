"""FlashAttention-2's Python entry points, `flash_attn_func` and `flash_attn_varlen_func`,
with its layout (`(batch, seqlen, heads, dim)`, or packed `(total, heads, dim)` with
cumulative sequence lengths) and semantics on eqx_flash's kernels.

FA2's dense conventions are eqx_flash's own (causal, window and ALiBi aligned bottom-right),
so `flash_attn_func` only moves the heads axis and renames. The packed call attends within
each sequence, aligned bottom-right *per sequence*: each sequence is a segment id and its
tokens sit at positions aligned on its keys (`q_positions`/`kv_positions`), so causal,
the window and per-head ALiBi act within it and the kernels skip, at run time, the
blocks of other sequences and those out of reach. ALiBi slopes per sequence are a small
`score_mod` over the packed index arrays.

One order differs: FA2 adds ALiBi *after* the soft cap (`softcap * tanh(scale * q.k /
softcap) - slope * |i - j|`: its kernel caps, then its mask adds the bias), where
`flash_attention` caps last. With both, the front ends cap and then add ALiBi in one
`score_mod` (`_CapThenAlibi`) and pass neither to `flash_attention`; with only one of
them the order does not matter and the built-in terms run.
"""

import math
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike

from .._api.binder import is_concrete
from .._api.flash import flash_attention
from .._core.options import make_options
from .._core.types import Flag, KernelsName, OptionalReal


def flash_attn_func(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    dropout_p: OptionalReal = 0.0,
    softmax_scale: OptionalReal = None,
    causal: Flag = False,
    window_size: Any = (-1, -1),  # (left, right); checked by `_options`
    softcap: OptionalReal = 0.0,
    alibi_slopes: ArrayLike | None = None,
    deterministic: Flag = False,
    return_attn_probs: Flag = False,
    *,
    key: Any = None,
    kernels: KernelsName = None,
) -> Array | tuple[Array, Array, None]:
    """FlashAttention-2's `flash_attn_func` on `(batch, seqlen, heads, dim)` arrays.

    **Arguments** (as in FA2): `q` `(batch, seqlen_q, heads, dim)`, `k`, `v` `(batch,
    seqlen_k, kv_heads, dim)` (`kv_heads` dividing `heads`); `dropout_p` (needs `key`, a
    PRNG key: JAX has no global generator); `softmax_scale` (default `1/sqrt(dim)`);
    `causal` and `window_size=(left, right)` (`-1`: unbounded) aligned bottom-right;
    `softcap` (`0.0`: none); `alibi_slopes` `(heads,)` or `(batch, heads)`, added after
    the soft cap as FA2 does (`softcap * tanh(scale * q.k / softcap) - slope * |i +
    seqlen_k - seqlen_q - j|`); `deterministic` (eqx_flash's backward pass is always
    deterministic: accepted, ignored); `return_attn_probs`; and eqx_flash's `kernels`
    (the kernel family, as in `flash_attention`).

    **Returns:** `out` `(batch, seqlen_q, heads, dim)`; with `return_attn_probs`, `(out,
    softmax_lse, None)`, the lse `(batch, heads, seqlen_q)` in float32 (the probabilities
    are never formed). A query with no key to attend gets `out = 0` and lse `-inf`
    (FA2's kernel writes `+inf` there).
    """
    del deterministic
    q, k, v = (jnp.swapaxes(jnp.asarray(x), -3, -2) for x in (q, k, v))
    options = _options(dropout_p, softmax_scale, causal, window_size, softcap, key)
    if alibi_slopes is not None and options["softcap"] is not None:
        # FA2's order: ALiBi after the cap (module docstring).
        slopes = _slopes(alibi_slopes, math.prod(q.shape[:-3]), q.shape[-3], "batch")
        options["score_mod"] = _CapThenAlibi(options.pop("softcap"), slopes,
                                             offset=k.shape[-2] - q.shape[-2])
    elif alibi_slopes is not None:
        options["alibi_slopes"] = jnp.asarray(alibi_slopes)
    out, lse = flash_attention(q, k, v, **options, kernels=kernels)
    out = jnp.swapaxes(out, -3, -2)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    cu_seqlens_q: ArrayLike,
    cu_seqlens_k: ArrayLike,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: OptionalReal = 0.0,
    softmax_scale: OptionalReal = None,
    causal: Flag = False,
    window_size: Any = (-1, -1),  # (left, right); checked by `_options`
    softcap: OptionalReal = 0.0,
    alibi_slopes: ArrayLike | None = None,
    deterministic: Flag = False,
    return_attn_probs: Flag = False,
    *,
    key: Any = None,
    kernels: KernelsName = None,
) -> Array | tuple[Array, Array, None]:
    """FlashAttention-2's `flash_attn_varlen_func` on packed sequences.

    **Arguments** (as in FA2): `q` `(total_q, heads, dim)`, `k`, `v` `(total_k, kv_heads,
    dim)`: the sequences of a batch one after another; `cu_seqlens_q`, `cu_seqlens_k`
    int32 `(batch + 1,)`, the cumulative lengths (starting at 0, ending at `total`),
    traced arrays welcome (under `jax.jit`); `max_seqlen_q`, `max_seqlen_k`: Python ints
    bounding the lengths. Concrete lengths are checked; traced ones cannot be (a value
    check could abort a jitted program), and tokens outside `[cu[0], cu[-1])` (a buffer
    padded past the last sequence) attend nothing: out 0, lse -inf. Sequence `b`'s queries
    attend only its keys; `causal`, `window_size` and ALiBi (`alibi_slopes` `(heads,)`
    or `(batch, heads)`, after the soft cap) are aligned bottom-right within each
    sequence (query `i` of a sequence of `n_q` queries and `n_k` keys against its key `i
    + n_k - n_q`). The other arguments as in `flash_attn_func`.

    **Returns:** `out` `(total_q, heads, dim)`; with `return_attn_probs`, `(out,
    softmax_lse, None)`, the lse in FA2's `(heads, total_q)` layout, float32.
    """
    del deterministic
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(f"q, k and v must be packed (total, heads, dim); got q.shape="
                         f"{q.shape}, k.shape={k.shape}, v.shape={v.shape}")
    cu_q = _cumulative("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
    cu_k = _cumulative("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of "
                         f"sequences; got shapes {cu_q.shape} and {cu_k.shape}")
    options = _options(dropout_p, softmax_scale, causal, window_size, softcap, key)
    packing = _Packing.of(cu_q, cu_k, q.shape[0], k.shape[0])
    # Each sequence as segment ids, its tokens at positions aligned bottom-right on its
    # keys: causal, the window and ALiBi then act within each sequence, and the kernels
    # skip the blocks of other sequences and those out of reach at run time.
    by_sequence = dict(q_segment_ids=packing.q_seq, kv_segment_ids=packing.k_seq,
                       q_positions=packing.q_pos, kv_positions=packing.k_pos)
    if alibi_slopes is not None:
        per_sequence = jnp.ndim(alibi_slopes) == 2
        slopes = _slopes(alibi_slopes, cu_q.shape[0] - 1, q.shape[1], "number of sequences")
        if per_sequence or options["softcap"] is not None:
            # Per sequence, not a per-head operand of the packed rows; with a cap, after
            # it (module docstring).
            options["score_mod"] = _CapThenAlibi(options.pop("softcap"), slopes, packing)
        else:
            by_sequence["alibi_slopes"] = slopes[0]
    q, k, v = (jnp.swapaxes(x, 0, 1) for x in (q, k, v))  # (heads, total, dim)
    out, lse = flash_attention(q, k, v, **by_sequence, **options, kernels=kernels)
    out = jnp.swapaxes(out, 0, 1)
    return (out, lse, None) if return_attn_probs else out


def _options(dropout_p, softmax_scale, causal, window_size, softcap, key) -> dict[str, Any]:
    """FA2's keywords as `flash_attention`'s (its checks name them as eqx_flash does)."""
    if not isinstance(window_size, tuple | list) or len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right), -1 for unbounded; got "
                         f"window_size={window_size!r}")
    left, right = (None if w == -1 else w for w in window_size)
    if causal:
        right = 0  # FA2: causal with a window keeps its left side
    window = None if left is None and right is None else (left, right)
    softcap = None if softcap == 0.0 else softcap
    make_options(softcap=softcap)  # checked here too: it may become a score_mod's
    return dict(scale=softmax_scale, causal=causal, window=window, softcap=softcap,
                dropout_rate=dropout_p, key=key if dropout_p else None)


def _slopes(alibi_slopes: ArrayLike, rows: int, heads: int, what: str) -> Array:
    """FA2's `alibi_slopes`, `(heads,)` or `(rows, heads)`, as `(rows, heads)`."""
    slopes = jnp.asarray(alibi_slopes)
    if slopes.shape not in ((heads,), (rows, heads)) or not jnp.issubdtype(
            slopes.dtype, jnp.floating):
        raise ValueError(f"alibi_slopes must be a float array ({heads},) or ({rows}, {heads}) "
                         f"(heads, or {what} by heads); got alibi_slopes.shape={slopes.shape}, "
                         f"dtype={slopes.dtype}")
    return jnp.broadcast_to(slopes, (rows, heads))


def _cumulative(name: str, cu: ArrayLike, total: int, max_seqlen: int) -> Array:
    cu = jnp.asarray(cu)
    if cu.ndim != 1 or cu.shape[0] < 2 or not jnp.issubdtype(cu.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array (batch + 1,); got {name}.shape="
                         f"{cu.shape}, {name}.dtype={cu.dtype}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 1:
        raise ValueError(f"max_seqlen must be a positive int; got {max_seqlen!r} with {name}")
    if not is_concrete(cu):  # traced (under jit): unchecked; see `_Packing.of`
        return cu.astype(jnp.int32)
    concrete = np.asarray(cu)
    lengths = concrete[1:] - concrete[:-1]
    if concrete[0] != 0 or concrete[-1] != total or (lengths < 0).any():
        raise ValueError(f"{name} must rise from 0 to {total} (the packed length); got "
                         f"{name}={concrete.tolist()}")
    if lengths.max() > max_seqlen:
        raise ValueError(f"{name} holds a sequence of {int(lengths.max())} tokens, past "
                         f"max_seqlen={max_seqlen}")
    return cu.astype(jnp.int32)


class _Packing(eqx.Module):
    """Each packed query's and key's sequence and position within it, the queries'
    aligned bottom-right on their sequence's keys (`+ n_k - n_q`). Tokens outside
    `[cu[0], cu[-1])` (traced cumulative lengths are not checked: a buffer padded past
    the last sequence, say) belong to no sequence: different ids for queries and keys,
    so they attend nothing and nothing attends them."""

    q_seq: Array  # (total_q,)
    q_pos: Array
    k_seq: Array  # (total_k,)
    k_pos: Array

    @classmethod
    def of(cls, cu_q: Array, cu_k: Array, total_q: int, total_k: int) -> "_Packing":
        def locate(cu: Array, total: int, outside: int) -> tuple[Array, Array]:
            index = jnp.arange(total, dtype=jnp.int32)
            seq = jnp.clip(jnp.searchsorted(cu, index, side="right") - 1, 0,
                           cu.shape[0] - 2).astype(jnp.int32)
            inside = (index >= cu[0]) & (index < cu[-1])
            return jnp.where(inside, seq, outside), index - cu[seq]

        (q_seq, q_pos), (k_seq, k_pos) = (locate(cu_q, total_q, -1),
                                          locate(cu_k, total_k, -2))
        offset = (cu_k[1:] - cu_k[:-1]) - (cu_q[1:] - cu_q[:-1])
        return cls(q_seq, q_pos + offset[jnp.maximum(q_seq, 0)], k_seq, k_pos)

    def at(self, q_idx: Array, kv_idx: Array) -> tuple[Array, Array, Array]:
        """`(query's sequence, query position, key position)` of the pairs; indices past
        the ends (blocks' padding, masked anyway) are clipped."""
        def take(x: Array, i: Array) -> Array:
            return jnp.take(x, i, mode="clip")

        return take(self.q_seq, q_idx), take(self.q_pos, q_idx), take(self.k_pos, kv_idx)


class _CapThenAlibi(eqx.Module):
    """score_mod: FA2's soft cap (if any), then its ALiBi, `-slope * |p - j|` with `p` the
    query's position aligned bottom-right on its keys. Slopes `(rows, heads)`, the rows
    being the batch (`packing=None`: `p = q_idx + offset`, `j = kv_idx`) or the packed
    sequences (positions within each one). Differentiable in the slopes."""

    softcap: float | None
    slopes: Array
    packing: _Packing | None = None
    offset: int = 0

    def __call__(self, s, b, h, q_idx, kv_idx):
        if self.softcap is not None:
            s = self.softcap * jnp.tanh(s / self.softcap)
        if self.packing is None:
            row, p, j = b, q_idx + self.offset, kv_idx
        else:
            row, p, j = self.packing.at(q_idx, kv_idx)
        slope = self.slopes[row, h].astype(s.dtype)
        return s - slope * jnp.abs(p - j).astype(s.dtype)
