"""FlashAttention-2's entry points: `flash_attn_varlen_func` on packed sequences equals
attention on each sequence alone (values and gradients), and `flash_attn_func` equals
`flash_attention` in FA2's layout."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, assert_lse_close, enable_x64

import eqx_flash

HEADS, KV_HEADS, DIM = 4, 2, 8
# (query length, key length) of each packed sequence: lengths of 1, unequal q/k lengths.
SEQUENCES = [(5, 5), (1, 9), (12, 4), (7, 13), (1, 1), (20, 20)]
OPTIONS = {
    "full": {},
    "causal": dict(causal=True),
    "window": dict(window_size=(3, 2)),
    "causal_window": dict(causal=True, window_size=(4, -1)),
    "alibi": dict(causal=True, alibi=True),
    "scale": dict(softmax_scale=0.3),
}


def _packed(seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    total_q = sum(n for n, _ in SEQUENCES)
    total_k = sum(n for _, n in SEQUENCES)
    q = jax.random.normal(keys[0], (total_q, HEADS, DIM))
    k = jax.random.normal(keys[1], (total_k, KV_HEADS, DIM))
    v = jax.random.normal(keys[2], (total_k, KV_HEADS, DIM))
    cu_q = jnp.asarray(np.cumsum([0] + [n for n, _ in SEQUENCES]), jnp.int32)
    cu_k = jnp.asarray(np.cumsum([0] + [n for _, n in SEQUENCES]), jnp.int32)
    slopes = jax.random.uniform(keys[3], (HEADS,))
    return q, k, v, cu_q, cu_k, slopes


def _fa2_kwargs(option, slopes):
    kw = dict(OPTIONS[option])
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = slopes
    return kw


def _one_sequence(q, k, v, option, slopes):
    """`flash_attention` on one sequence in eqx_flash's layout: FA2's semantics are its
    own (bottom-right causal, window and ALiBi)."""
    kw = dict(OPTIONS[option])
    window = kw.pop("window_size", None)
    if window is not None:
        left, right = (None if w == -1 else w for w in window)
        kw["window"] = (left, 0 if kw.get("causal") else right)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = slopes
    if "softmax_scale" in kw:
        kw["scale"] = kw.pop("softmax_scale")
    out, lse = eqx_flash.plain_attention(*(jnp.swapaxes(x, 0, 1) for x in (q, k, v)), **kw)
    return jnp.swapaxes(out, 0, 1), lse


def _value_and_grads(fn, weights, *args):
    """`(fn(*args), grads)`: the gradients of `sum(fn(*args)[0] * weights)` along every
    argument (trace it under `jax.jit`: `_compiled_value_and_grads`)."""

    def loss(*args):
        result = fn(*args)
        return jnp.sum(result[0] * weights), result

    grads, result = jax.grad(loss, argnums=tuple(range(len(args))), has_aux=True)(*args)
    return result, grads


def _compiled_value_and_grads(fn, weights, *args):
    """`_value_and_grads`, compiled as one program (forward and backward)."""
    return jax.jit(functools.partial(_value_and_grads, fn))(weights, *args)


# Where each packed sequence starts in q and in k, its query and key lengths.
STARTS = [(int(a), nq, int(c), nk) for (nq, nk), a, c in zip(
    SEQUENCES, np.cumsum([0] + [n for n, _ in SEQUENCES]),
    np.cumsum([0] + [n for _, n in SEQUENCES]), strict=False)]


@pytest.mark.parametrize("option", list(OPTIONS))
def test_each_packed_sequence_is_attention_on_it_alone(option):
    q, k, v, cu_q, cu_k, slopes = _packed()
    kw = _fa2_kwargs(option, slopes)
    fn = functools.partial(eqx_flash.flash_attn_varlen_func, cu_seqlens_q=cu_q,
                           cu_seqlens_k=cu_k, max_seqlen_q=20, max_seqlen_k=20,
                           return_attn_probs=True, **kw)
    weights = jax.random.normal(jax.random.key(5), q.shape)
    # (Everything compiled whole, one program each side: faster than op by op, the same
    # numbers.)
    (out, lse, probs), grads = _compiled_value_and_grads(fn, weights, q, k, v)
    assert probs is None and out.shape == q.shape and lse.shape == (HEADS, q.shape[0])

    def each_alone(q, k, v):
        """Every sequence's `((out, lse), grads)` on its own."""
        return [_value_and_grads(lambda *x: _one_sequence(*x, option, slopes),
                                 weights[a:a + nq], q[a:a + nq], k[c:c + nk], v[c:c + nk])
                for a, nq, c, nk in STARTS]

    out, lse = np.asarray(out), np.asarray(lse)
    grads = [np.asarray(g) for g in grads]
    for b, ((ref_out, ref_lse), ref_grads) in enumerate(jax.jit(each_alone)(q, k, v)):
        a, nq, c, nk = STARTS[b]
        assert_close(out[a:a + nq], ref_out, name=f"out of sequence {b}")
        assert_lse_close(lse[:, a:a + nq], ref_lse)
        for name, g, r in zip(("dq", "dk", "dv"), (grads[0][a:a + nq], grads[1][c:c + nk],
                                                   grads[2][c:c + nk]), ref_grads,
                              strict=True):
            assert_close(g, r, kind="grad", name=f"{name} of sequence {b}")


def test_alibi_slopes_per_sequence_and_their_gradient():
    q, k, v, cu_q, cu_k, _ = _packed(1)
    slopes = jax.random.uniform(jax.random.key(7), (len(SEQUENCES), HEADS))

    def packed(slopes):
        out = eqx_flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 20, 20, causal=True,
                                               alibi_slopes=slopes)
        return jnp.sum(out ** 2)

    def separately(slopes):
        total = 0.0
        for b, (a, nq, c, nk) in enumerate(STARTS):
            out, _ = eqx_flash.plain_attention(
                *(jnp.swapaxes(x, 0, 1) for x in (q[a:a + nq], k[c:c + nk], v[c:c + nk])),
                causal=True, alibi_slopes=slopes[b])
            total = total + jnp.sum(out ** 2)
        return total

    # Each side compiled whole (values and gradient in one program).
    got, grad = jax.jit(jax.value_and_grad(packed))(slopes)
    expected, expected_grad = jax.jit(jax.value_and_grad(separately))(slopes)
    assert_close(got, expected)
    assert_close(grad, expected_grad, kind="grad")


def test_flash_attn_func_is_flash_attention_in_fa2_layout():
    keys = jax.random.split(jax.random.key(2), 4)
    q = jax.random.normal(keys[0], (2, 24, HEADS, DIM))
    k, v = (jax.random.normal(keys[i], (2, 40, KV_HEADS, DIM)) for i in (1, 2))
    slopes = jax.random.uniform(keys[3], (2, HEADS))
    # (A soft cap with ALiBi is FA2's order, not flash_attention's: `FA2_CASES` below.)
    out, lse, _ = eqx_flash.flash_attn_func(q, k, v, causal=True, window_size=(8, -1),
                                            alibi_slopes=slopes, return_attn_probs=True)
    ref, ref_lse = eqx_flash.flash_attention(
        *(jnp.swapaxes(x, 1, 2) for x in (q, k, v)), causal=True, window=(8, 0),
        alibi_slopes=slopes)
    assert_close(out, jnp.swapaxes(ref, 1, 2))
    assert_lse_close(lse, ref_lse)
    assert lse.shape == (2, HEADS, 24)
    dropped = eqx_flash.flash_attn_func(q, k, v, dropout_p=0.5, key=jax.random.key(3))
    assert not np.allclose(np.asarray(dropped), np.asarray(eqx_flash.flash_attn_func(q, k, v)))


def test_bad_input_names_the_argument():
    q, k, v, cu_q, cu_k, _ = _packed()
    with pytest.raises(ValueError, match="cu_seqlens_q must rise from 0"):
        eqx_flash.flash_attn_varlen_func(q, k, v, cu_q.at[-1].set(3), cu_k, 20, 20)
    with pytest.raises(ValueError, match="past max_seqlen=8"):
        eqx_flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 8, 20)
    with pytest.raises(ValueError, match="same number of sequences"):
        eqx_flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k[:-1].at[-1].set(k.shape[0]),
                                         20, 100)
    with pytest.raises(ValueError, match="window_size must be a pair"):
        eqx_flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 20, 20, window_size=3)
    with pytest.raises(ValueError, match="packed"):
        eqx_flash.flash_attn_varlen_func(q[None], k, v, cu_q, cu_k, 20, 20)
    with pytest.raises(ValueError, match="dropout_rate > 0 needs a PRNG key|key"):
        eqx_flash.flash_attn_func(q[None], k[None], v[None], dropout_p=0.1)


def test_no_block_is_spent_across_sequences(monkeypatch):
    """Eight packed causal sequences of 256: the forward computes only blocks on the
    diagonal, fewer than causal attention over the whole packed sequence would."""
    from test_flex import _BlockCounter

    from eqx_flash._core.config import FINE_BLOCKS_BANDED

    counter = _BlockCounter(monkeypatch)
    n, length = 8, 256
    x = jax.random.normal(jax.random.key(0), (n * length, 2, 32))
    cu = jnp.arange(0, n * length + 1, length, dtype=jnp.int32)
    varlen = counter.run(lambda: eqx_flash.flash_attn_varlen_func(
        x, x, x, cu, cu, length, length, causal=True))["forward"]
    # At the blocks the packed call runs with (segment ids keep the fine ones).
    block_q, block_k = FINE_BLOCKS_BANDED
    whole = counter.run(lambda: eqx_flash.flash_attention(
        *(jnp.swapaxes(x, 0, 1),) * 3, causal=True, block_q=block_q,
        block_k=block_k))["forward"]
    assert 0 < varlen < whole, (varlen, whole)


def _fa2_formula(xp, q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, slopes=None,
                 scale=None):
    """FlashAttention-2's attention as its docs and test reference state it, written out
    here (NumPy, or jax.numpy for gradients) on `(batch, seqlen, heads, dim)`: scores
    `softcap * tanh(scale * q.k / softcap)`, THEN `- slope * |i + seqlen_k - seqlen_q -
    j|` (ALiBi after the cap), then the bottom-right causal/window masks; `(out, lse)`,
    the lse `(batch, heads, seqlen_q)`; a row with no key gets out 0 and lse -inf
    (eqx_flash's convention; FA2's kernel writes +inf there)."""
    groups = q.shape[2] // k.shape[2]
    k, v = xp.repeat(k, groups, axis=2), xp.repeat(v, groups, axis=2)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = xp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        s = softcap * xp.tanh(s / softcap)
    sq, sk = q.shape[1], k.shape[1]
    i = (np.arange(sq)[:, None] + sk - sq)[None, None]  # its key, bottom-right aligned
    j = np.arange(sk)[None, None, None, :]
    if slopes is not None:
        slopes = xp.broadcast_to(slopes, (q.shape[0], q.shape[2]))
        s = s - slopes[:, :, None, None] * np.abs(i - j).astype(np.float64)
    left, right = window
    if causal:
        right = 0
    allowed = np.ones((1, 1, sq, sk), bool)
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    top = xp.max(xp.where(allowed, s, -np.inf), axis=-1, keepdims=True)
    top = xp.where(allowed.any(-1, keepdims=True), top, 0.0)
    # (No exp of -inf, whose derivative XLA:CPU compiles to NaN without its optimisations.)
    e = xp.where(allowed, xp.exp(xp.where(allowed, s, 0.0) - top), 0.0)
    total = xp.sum(e, axis=-1, keepdims=True)
    out = xp.einsum("bhqk,bkhd->bqhd", e / xp.where(total > 0, total, 1.0), v)
    with np.errstate(divide="ignore"):  # a row with no key: out 0, lse -inf
        return out, (xp.log(total) + top)[..., 0]


FA2_CASES = {
    "softcap_alibi": dict(softcap=2.0, alibi=True),
    "softcap_alibi_causal": dict(softcap=2.0, alibi=True, causal=True),
    "softcap_alibi_window": dict(softcap=1.5, alibi=True, window=(5, 3), scale=0.4),
    "softcap_only": dict(softcap=2.0, causal=True),
    "alibi_only": dict(alibi=True, window=(4, -1)),
}


def _fa2_inputs(case, per_batch, seed=3, batch=2, sq=12, sk=20):
    keys = jax.random.split(jax.random.key(seed), 5)
    q = 2 * jax.random.normal(keys[0], (batch, sq, HEADS, DIM))
    k, v = (2 * jax.random.normal(x, (batch, sk, KV_HEADS, DIM)) for x in keys[1:3])
    options = dict(FA2_CASES[case])
    slopes = None
    if options.pop("alibi", False):
        slopes = jax.random.uniform(keys[3], (batch, HEADS) if per_batch else (HEADS,),
                                    minval=0.1, maxval=1.0)
    return (q, k, v), slopes, options


def _fa2_kw(options, slopes):
    kw = {("window_size" if n == "window" else "softmax_scale" if n == "scale" else n): x
          for n, x in options.items()}
    return kw | ({} if slopes is None else {"alibi_slopes": slopes})


def _expected_and_grads(qkv, slopes, options, weights):
    """The float64 formula's `(out, lse)` and the gradients of `sum(out * weights)` along
    q, k, v and the slopes."""
    with enable_x64():
        wide = [jnp.asarray(np.asarray(x), jnp.float64) for x in qkv]
        wide_slopes = None if slopes is None else jnp.asarray(np.asarray(slopes), jnp.float64)
        out, lse = _fa2_formula(np, *(np.asarray(x) for x in wide), slopes=None if slopes is
                                None else np.asarray(wide_slopes), **options)

        def loss(q, k, v, s):
            o, _ = _fa2_formula(jnp, q, k, v, slopes=s, **options)
            return jnp.sum(o * jnp.asarray(np.asarray(weights), jnp.float64))

        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3) if slopes is not None else (0, 1, 2)))(
            *wide, wide_slopes)
        return out, lse, [np.asarray(g) for g in grads]


@pytest.mark.parametrize("case, per_batch", [
    *((case, False) for case in FA2_CASES), ("softcap_alibi", True),
    ("softcap_alibi_causal", True)])
def test_flash_attn_func_is_fa2s_formula(case, per_batch):
    """`flash_attn_func` against FA2's own order of operations, written out in float64:
    ALiBi after the soft cap (#41: it was added before the cap, off by up to 2);
    values, lse and the gradients of q, k, v and the slopes."""
    qkv, slopes, options = _fa2_inputs(case, per_batch)
    weights = jax.random.normal(jax.random.key(11), qkv[0].shape)
    kw = _fa2_kw(options, slopes)
    args = (*qkv, *(() if slopes is None else (slopes,)))

    def call(q, k, v, *s):
        extra = {} if not s else {"alibi_slopes": s[0]}
        return eqx_flash.flash_attn_func(q, k, v, return_attn_probs=True, **(kw | extra))

    (out, lse, _), grads = _compiled_value_and_grads(call, weights, *args)
    expected_out, expected_lse, expected_grads = _expected_and_grads(qkv, slopes, options,
                                                                     weights)
    assert_close(out, expected_out)
    assert_lse_close(lse, expected_lse)
    names = ("dq", "dk", "dv", "dslopes")[:len(args)]
    for name, g, e in zip(names, grads, expected_grads, strict=True):
        assert_close(g, e, kind="grad", name=name)


# With a soft cap, slopes per head are broadcast to slopes per sequence and both take one
# path (`_CapThenAlibi`): each case once, and each slopes' shape once.
@pytest.mark.parametrize(("case", "per_sequence"), [("softcap_alibi_causal", True),
                                                    ("softcap_alibi_window", False)])
def test_flash_attn_varlen_func_is_fa2s_formula_per_sequence(case, per_sequence):
    """`flash_attn_varlen_func` with a soft cap and ALiBi (per head and per sequence)
    against FA2's formula on each sequence alone, float64 (#41): values, lse and the
    gradients of q, k, v and the slopes."""
    q, k, v, cu_q, cu_k, _ = _packed(4)
    q, k, v = 2 * q, 2 * k, 2 * v
    options = {n: x for n, x in FA2_CASES[case].items() if n != "alibi"}
    shape = (len(SEQUENCES), HEADS) if per_sequence else (HEADS,)
    slopes = jax.random.uniform(jax.random.key(12), shape, minval=0.1, maxval=1.0)
    weights = jax.random.normal(jax.random.key(13), q.shape)
    kw = {n: x for n, x in _fa2_kw(options, None).items()}

    def packed(q, k, v, slopes):
        return eqx_flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 20, 20, alibi_slopes=slopes,
                                                return_attn_probs=True, **kw)

    def formula(xp, q, k, v, slopes):
        """Each sequence alone through `_fa2_formula`, packed back."""
        outs, lses = [], []
        for b, (a, nq, c, nk) in enumerate(STARTS):
            own = slopes[b] if per_sequence else slopes
            o, lse = _fa2_formula(xp, q[None, a:a + nq], k[None, c:c + nk], v[None, c:c + nk],
                                  slopes=own, **options)
            outs.append(o[0])
            lses.append(lse[0])
        return xp.concatenate(outs), xp.concatenate(lses, axis=-1)

    (out, lse, _), grads = _compiled_value_and_grads(packed, weights, q, k, v, slopes)
    with enable_x64():
        wide = [jnp.asarray(np.asarray(x), jnp.float64) for x in (q, k, v, slopes, weights)]
        expected_out, expected_lse = formula(np, *(np.asarray(x) for x in wide[:4]))
        expected_grads = jax.jit(jax.grad(  # compiled whole: six sequences' shapes
            lambda *a: jnp.sum(formula(jnp, *a)[0] * wide[4]), argnums=(0, 1, 2, 3)))(*wide[:4])
        expected_grads = [np.asarray(g) for g in expected_grads]
    assert_close(out, expected_out)
    assert_lse_close(lse, expected_lse)
    for name, g, e in zip(("dq", "dk", "dv", "dslopes"), grads, expected_grads, strict=True):
        assert_close(g, e, kind="grad", name=name)


def test_traced_cumulative_lengths_under_jit():
    """`cu_seqlens` traced under `jax.jit` (#41: a TracerBoolConversionError), with a
    soft cap and per-head ALiBi: equal to the eager call, and its gradients to those with
    the lengths concrete; a buffer padded past the last sequence (`cu[-1] < total`,
    unchecked when traced) leaves the padding rows at out 0 and lse -inf and changes no
    real row."""
    q, k, v, cu_q, cu_k, slopes = _packed(5)
    kw = dict(causal=True, softcap=3.0, alibi_slopes=slopes, return_attn_probs=True)

    def call(q, k, v, cu_q, cu_k):
        return eqx_flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 20, 20, **kw)

    def loss(q, k, v, cu_q, cu_k):
        result = call(q, k, v, cu_q, cu_k)
        return jnp.sum(result[0] ** 2), result

    grad = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
    eager = call(q, k, v, cu_q, cu_k)
    grads, jitted = jax.jit(grad)(q, k, v, cu_q, cu_k)  # the lengths traced
    assert_close(jitted[0], eager[0])
    assert_lse_close(jitted[1], eager[1])
    concrete, _ = jax.jit(lambda q, k, v: grad(q, k, v, cu_q, cu_k))(q, k, v)
    for g, e in zip(grads, concrete, strict=True):
        assert_close(g, e, kind="grad")
    pad = 5
    padded = [jnp.asarray(np.concatenate([x, np.full((pad, *x.shape[1:]), np.nan, x.dtype)]))
              for x in (q, k, v)]
    out, lse = (np.asarray(x) for x in jax.jit(call)(*padded, cu_q, cu_k)[:2])
    assert_close(out[:-pad], eager[0])
    assert_lse_close(lse[:, :-pad], eager[1])
    np.testing.assert_array_equal(out[-pad:], 0.0)
    assert np.all(np.isneginf(lse[:, -pad:]))
