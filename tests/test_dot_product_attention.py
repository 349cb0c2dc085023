"""`eqx_flash.dot_product_attention` against `jax.nn.dot_product_attention` itself: values,
residual and gradients over a grid of its options, unequal lengths (where its top-left
alignment differs from eqx_flash's bottom-right), GQA, unbatched calls and bf16."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close

import eqx_flash

B, N, K, H = 2, 4, 2, 8
LENGTHS = {"equal": (16, 16), "more_keys": (12, 20), "more_queries": (20, 12)}
OPTIONS = {
    "none": {},
    "causal": dict(is_causal=True),
    "window": dict(local_window_size=(6, 2)),
    "causal_window": dict(is_causal=True, local_window_size=5),
    "seq_lengths": dict(is_causal=True, query_seq_lengths=(None, 7),
                        key_value_seq_lengths=(None, 9)),
    "bias_mask": dict(bias=True, mask=True),
}


def _inputs(seq_q, seq_k, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (B, seq_q, N, H), dtype)
    k, v = (jax.random.normal(keys[i], (B, seq_k, K, H), dtype) for i in (1, 2))
    return q, k, v, keys[3:]


def _kwargs(option, seq_q, seq_k, keys):
    kw = {}
    for name, value in OPTIONS[option].items():
        if name == "bias":
            kw["bias"] = jax.random.normal(keys[0], (1, N, seq_q, seq_k))
        elif name == "mask":  # per batch element and key, every row keeping one key
            kw["mask"] = (jax.random.uniform(keys[1], (B, 1, 1, seq_k)) > 0.3).at[..., 0].set(True)
        elif name == "query_seq_lengths":
            kw[name] = jnp.array([seq_q, value[1]], jnp.int32)
        elif name == "key_value_seq_lengths":
            kw[name] = jnp.array([seq_k, value[1]], jnp.int32)
        else:
            kw[name] = value
    return kw


def _attended(lse):
    """Rows that attend a key (jax.nn averages the values of the others: a documented
    difference), `(B, T, N)`."""
    return np.isfinite(np.asarray(lse, np.float32))


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_values_residual_and_gradients_match_jax_nn(option, lengths):
    seq_q, seq_k = LENGTHS[lengths]
    q, k, v, keys = _inputs(seq_q, seq_k)
    kw = _kwargs(option, seq_q, seq_k, keys)
    weights = jax.random.normal(jax.random.key(9), q.shape)

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v, **kw) * weights)

    @jax.jit  # jax.nn's values, residual and gradients in one program
    def reference(q, k, v):
        grads = jax.grad(functools.partial(loss, jax.nn.dot_product_attention),
                         argnums=(0, 1, 2))(q, k, v)
        return jax.nn.dot_product_attention(q, k, v, **kw, return_residual=True), grads

    out, lse = eqx_flash.dot_product_attention(q, k, v, **kw, return_residual=True)
    (ref_out, ref_lse), ref_grads = reference(q, k, v)
    assert out.shape == ref_out.shape == q.shape and lse.shape == ref_lse.shape == q.shape[:-1]
    rows = _attended(lse)
    assert rows.any()
    assert_close(np.where(rows[..., None], out, 0), np.where(rows[..., None], ref_out, 0))
    assert_close(np.where(rows, lse, 0), np.where(rows, ref_lse, 0), kind="lse")
    if "query_seq_lengths" in kw:  # padded rows are 0 in both
        assert np.all(np.asarray(out)[1, kw["query_seq_lengths"][1]:] == 0)
    if not rows.all():  # rows without keys: jax.nn still sends them gradient; ours none
        return
    grads = jax.jit(jax.grad(functools.partial(loss, eqx_flash.dot_product_attention),
                             argnums=(0, 1, 2)))(q, k, v)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert_close(g, r, kind="grad", name=name)


def test_bias_gradient_and_bf16():
    q, k, v, keys = _inputs(16, 24)
    bias = jax.random.normal(keys[0], (B, N, 16, 24))

    def loss(fn, bias, q, k, v):
        return jnp.sum(fn(q, k, v, bias, is_causal=True) ** 2)

    @jax.jit  # everything below in one program
    def results(q, k, v, bias):
        got = jax.grad(functools.partial(loss, eqx_flash.dot_product_attention))(bias, q, k, v)
        expected = jax.grad(functools.partial(loss, jax.nn.dot_product_attention))(
            bias, q, k, v)
        qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
        out = eqx_flash.dot_product_attention(qb, kb, vb, is_causal=True)
        with jax.numpy_dtype_promotion("standard"):  # jax.nn's own code mixes bf16 and f32
            ref = jax.nn.dot_product_attention(qb, kb, vb, is_causal=True)
        return got, expected, out, ref

    got, expected, out, ref = results(q, k, v, bias)
    assert_close(got, expected, kind="grad")
    assert out.dtype == ref.dtype == jnp.bfloat16
    assert_close(out, ref, dtype=jnp.bfloat16)


def test_unbatched_and_jit():
    q, k, v, _ = _inputs(12, 20)
    fn = jax.jit(functools.partial(eqx_flash.dot_product_attention, is_causal=True,
                                   return_residual=True))
    q, k, v = (jnp.asarray(np.asarray(x)[0]) for x in (q, k, v))
    out, lse = fn(q, k, v)
    ref, ref_lse = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                             return_residual=True))(q, k, v)
    assert out.shape == (12, N, H) and lse.shape == (12, N)
    assert_close(out, ref)
    assert_close(lse, ref_lse, kind="lse")


def test_numpy_bool_causal_and_a_traced_scale_as_jax_nn_takes_them():
    """`is_causal=np.bool_(True)` and a `scale` traced under `jit` (a learned
    temperature), both of which jax.nn takes (#41: a TypeError each): values and the
    gradients of q, k, v and the scale against `jax.nn.dot_product_attention`'s."""
    q, k, v, _ = _inputs(12, 20)
    out = eqx_flash.dot_product_attention(q, k, v, is_causal=np.bool_(True))
    assert_close(out, jax.nn.dot_product_attention(q, k, v, is_causal=np.bool_(True)))
    weights = jax.random.normal(jax.random.key(4), q.shape)

    def loss(fn, q, k, v, log_temperature):
        return jnp.sum(fn(q, k, v, scale=jnp.exp(log_temperature), is_causal=True) * weights)

    args = (q, k, v, jnp.float32(-1.3))
    ours = jax.jit(jax.value_and_grad(functools.partial(loss, eqx_flash.dot_product_attention),
                                      argnums=(0, 1, 2, 3)))(*args)
    theirs = jax.jit(jax.value_and_grad(functools.partial(loss, jax.nn.dot_product_attention),
                                        argnums=(0, 1, 2, 3)))(*args)
    assert_close(ours[0], theirs[0])
    for name, g, e in zip(("dq", "dk", "dv", "dscale"), ours[1], theirs[1], strict=True):
        assert_close(g, e, kind="grad", name=name)
    with pytest.raises(TypeError, match="scale must be a real scalar"):
        jax.jit(lambda s: eqx_flash.dot_product_attention(q, k, v, scale=s))(jnp.ones(2))


def test_implementation_hands_over_to_jax_nn():
    q, k, v, _ = _inputs(16, 16)
    got = eqx_flash.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    expected = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    ours = eqx_flash.dot_product_attention(q, k, v, is_causal=True, implementation="eqx_flash")
    assert_close(ours, expected)


def test_errors_name_the_argument():
    q, k, v, _ = _inputs(16, 16)
    cases = [
        (dict(implementation="flash"), ValueError, "implementation must be one of"),
        (dict(mask=jnp.ones((B, 1, 16, 16), jnp.int32)), TypeError, "mask must be a bool"),
        (dict(bias=jnp.ones((1, 1, B, N, 16, 16))), ValueError, "bias must have at most 4"),
        (dict(query_seq_lengths=jnp.ones((3,), jnp.int32)), ValueError,
         r"query_seq_lengths must be an integer array of shape \(2,\)"),
        (dict(is_causal=1), TypeError, "is_causal must be a bool"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            eqx_flash.dot_product_attention(q, k, v, **kwargs)
    with pytest.raises(ValueError, match="value must have key's"):
        eqx_flash.dot_product_attention(q, k, v[:, :8])
    with pytest.raises(ValueError, match="must all be"):
        eqx_flash.dot_product_attention(q, k[0], v[0])
    with pytest.raises((ValueError, TypeError), match="heads"):
        eqx_flash.dot_product_attention(q[:, :, :3], k, v)  # 3 query heads, 2 kv heads


# Every length of each side, beside each of the other's and with and without a window
# (a covering set of the 3 x 3 x 2 product: each pair of the three factors appears).
@pytest.mark.parametrize(("seq_q", "seq_k", "window"), [
    (1, 1, None), (1, 7, (3, 1)), (1, 40, None), (5, 1, (3, 1)), (5, 7, None),
    (5, 40, (3, 1)), (33, 1, None), (33, 7, (3, 1)), (33, 40, (3, 1))])
def test_small_and_ragged_lengths(seq_q, seq_k, window):
    q, k, v, _ = _inputs(seq_q, seq_k, seed=3)

    @jax.jit  # both in one program (each case has shapes of its own)
    def both(q, k, v):
        kw = dict(is_causal=True, local_window_size=window)
        return (eqx_flash.dot_product_attention(q, k, v, **kw, return_residual=True),
                jax.nn.dot_product_attention(q, k, v, **kw))

    (out, lse), ref = both(q, k, v)
    rows = _attended(lse)
    assert_close(np.where(rows[..., None], out, 0), np.where(rows[..., None], ref, 0))
    assert np.all(np.asarray(out)[~rows] == 0)


# The dot-product-attention cases of jax's own tests/nn_test.py, restated against
# eqx_flash.dot_product_attention (their tolerances; jax.nn's reference implementation).
# jax's tests run with standard dtype promotion, which jax.nn's bf16/f16 path needs.

# jax's grid is 2 dtypes x 3 group counts x vmap or not; here a covering set of it (each
# pair of the three factors appears).
@pytest.mark.parametrize(("dtype", "groups", "use_vmap"), [
    (jnp.bfloat16, 1, False), (jnp.float16, 1, True), (jnp.bfloat16, 2, True),
    (jnp.float16, 2, False), (jnp.bfloat16, 4, False), (jnp.float16, 4, True)])
def test_jax_nn_test_grouped_query_attention(dtype, groups, use_vmap):
    batch, seq, heads, dim = 2, 128, 4, 32
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (batch, seq, heads, dim), dtype)
    k, v = (jax.random.normal(keys[i], (batch, seq, heads // groups, dim), dtype)
            for i in (1, 2))
    cotangent = jax.random.normal(keys[3], q.shape, dtype)
    ours = eqx_flash.dot_product_attention
    if use_vmap:
        ours = jax.vmap(ours)

    # jax.nn op by op: on CPU its float16 matmul does not compile inside a jit.
    with jax.numpy_dtype_promotion("standard"):
        k_rep, v_rep = (jnp.repeat(x, groups, axis=2) for x in (k, v))
        ref, ref_vjp = jax.vjp(jax.nn.dot_product_attention, q, k_rep, v_rep)
        d_ref = ref_vjp(cotangent)

    @jax.jit  # one program (each case has shapes or dtypes of its own)
    def value_and_vjp(q, k, v, cotangent):
        out, vjp = jax.vjp(ours, q, k, v)
        return out, *vjp(cotangent)

    out, dq, dk, dv = value_and_vjp(q, k, v, cotangent)
    d_ref_k, d_ref_v = (np.asarray(g, np.float32).reshape(batch, seq, heads // groups, groups,
                                                          dim).sum(axis=3) for g in d_ref[1:])
    for got, expected in ((out, ref), (dq, d_ref[0]), (dk, d_ref_k), (dv, d_ref_v)):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32),
                                   atol=0.01, rtol=0.01)


# jax's modes less three that a pair below contains: ("causal",) (in three), ("custom",)
# (in ("custom", "padding")) and ("bias",) (in ("bias", "causal"); without causal in
# `test_jax_nn_test_bias_gradient`).
@pytest.mark.parametrize("mask_mode", [("padding",), ("causal", "padding"), ("custom", "padding"),
                                       ("bias", "causal"), ("causal", "sliding_window")])
def test_jax_nn_test_masks(mask_mode):
    dtype, batch, seq, heads, dim = jnp.bfloat16, 2, 128, 4, 32
    keys = jax.random.split(jax.random.key(0), 5)
    q, k, v = (jax.random.normal(keys[i], (batch, seq, heads, dim), dtype) for i in range(3))
    cotangent = jax.random.normal(keys[3], q.shape, dtype)
    bias = (jax.random.normal(keys[4], (1, heads, seq, seq), dtype) if "bias" in mask_mode
            else None)
    mask = jnp.tril(jnp.ones((seq, seq), bool))[None, None] if "custom" in mask_mode else None
    kw = dict(is_causal="causal" in mask_mode,
              local_window_size=(3, 2) if "sliding_window" in mask_mode else None)
    if "padding" in mask_mode:
        kw.update(query_seq_lengths=jnp.array([seq // 2, seq // 4], jnp.int32),
                  key_value_seq_lengths=jnp.array([seq // 4, seq // 2], jnp.int32))

    def run(fn, q, k, v, bias, cotangent):
        """`fn`'s values and vjp, compiled as one program."""
        out, vjp = jax.vjp(lambda q, k, v, b: fn(q, k, v, b, mask, **kw), q, k, v, bias)
        return out, vjp(cotangent)

    args = (q, k, v, bias, cotangent)
    out, got = jax.jit(functools.partial(run, eqx_flash.dot_product_attention))(*args)
    with jax.numpy_dtype_promotion("standard"):
        ref, expected = jax.jit(functools.partial(run, jax.nn.dot_product_attention))(*args)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=0.01, rtol=0.01)
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), got, expected, strict=True):
        if r is None:
            continue
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                   atol=0.02, rtol=0.02, err_msg=name)


# jax's grid is batch 1 or 16 x vmap or not; each value once here.
@pytest.mark.parametrize(("batch", "use_vmap"), [(1, False), (16, True)])
def test_jax_nn_test_bias_gradient(batch, use_vmap):
    dtype, seq, heads, dim = jnp.bfloat16, 128, 4, 32
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (batch, seq, heads, dim), dtype)
    bias = jax.random.normal(keys[1], (batch, heads, seq, seq), dtype)
    mask = jnp.ones((1, 1, seq), bool)

    def attention(fn, x, bias, mask):
        return fn(x, x, x, bias, mask, is_causal=False)

    def gradients(fn, x, bias, mask):
        one = functools.partial(attention, fn)
        if use_vmap:
            one = jax.vmap(one, in_axes=(0, 0, None))
        value, vjp = jax.vjp(lambda x, b: one(x, b, mask), x, bias)
        return value, vjp(x)

    out, (dx, dbias) = jax.jit(functools.partial(gradients, eqx_flash.dot_product_attention))(
        x, bias, mask)
    with jax.numpy_dtype_promotion("standard"):  # (here, around the compiled call)
        ref, (ref_dx, ref_dbias) = jax.jit(
            functools.partial(gradients, jax.nn.dot_product_attention))(x, bias, mask)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=0.01, rtol=0.01)
    np.testing.assert_allclose(np.asarray(dbias, np.float32), np.asarray(ref_dbias, np.float32),
                               atol=0.1, rtol=0.1)
    np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(ref_dx, np.float32),
                               atol=0.1, rtol=0.1)
