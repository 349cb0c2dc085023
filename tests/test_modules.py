"""FlashAttention and FlashMultiheadAttention against eqx.nn.MultiheadAttention.

Bad construction and bad calls are tested in `test_module_errors.py`.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import enable_x64, qkv

from eqx_flash import FlashAttention, FlashMultiheadAttention, flash_attention, plain_attention

SEQ_Q, SEQ_K = 12, 20


def _assert_tree_close(a, b, rtol=1e-5, atol=1e-5):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def _params(m):
    return eqx.filter(m, eqx.is_inexact_array)


@eqx.filter_jit  # compiled whole: eagerly, each op of the module compiles a program
def _call(module, *args, **kwargs):
    return module(*args, **kwargs)


def _tril(rows, columns):
    """A lower-triangular bool mask, made in NumPy: no eager op to compile."""
    return jax.device_put(np.tril(np.ones((rows, columns), bool)))


@eqx.filter_jit  # compiled whole: eagerly, each op of the module compiles a program
def _value_and_grads(model, query, key_, value, cotangent, **call):
    """`((<out, cotangent>, out), grads)`: the output, and the gradients of
    <out, cotangent> for the parameters and the inputs."""

    @functools.partial(eqx.filter_value_and_grad, has_aux=True)
    def f(args):
        m, q, k, v = args
        out = m(q, k, v, **call)
        return jnp.sum(out * cotangent), out

    return f((model, query, key_, value))


def _inputs(key, query_size=16, key_size=16, value_size=16, seq_q=SEQ_Q, seq_k=SEQ_K):
    """Unbatched `(seq, size)` query, key and value inputs of the modules."""
    return qkv(key, (seq_q, query_size), (seq_k, key_size), dim_v=value_size)


# --- initialisation and conversion ---


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"key_size": 12, "value_size": 10, "output_size": 6, "qk_size": 5, "vo_size": 3,
         "use_query_bias": True, "use_key_bias": True, "use_value_bias": True,
         "use_output_bias": True},
    ],
)
def test_same_initial_weights(kwargs):
    key = jax.random.key(42)
    mha = eqx.nn.MultiheadAttention(4, 16, **kwargs, dropout_p=0.1, key=key)
    ours = FlashMultiheadAttention(4, 16, **kwargs, dropout_p=0.1, key=key)
    for name in ("query_proj", "key_proj", "value_proj", "output_proj", "dropout"):
        a, b = getattr(mha, name), getattr(ours, name)
        assert jax.tree.structure(a) == jax.tree.structure(b)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(x, y)
    for name in ("num_heads", "query_size", "key_size", "value_size", "output_size",
                 "qk_size", "vo_size", "use_query_bias", "use_key_bias", "use_value_bias",
                 "use_output_bias"):
        assert getattr(mha, name) == getattr(ours, name)
    assert ours.num_kv_heads == 4


def test_dtype_float64_params():
    with enable_x64(True):
        ours = FlashMultiheadAttention(2, 8, dtype=jnp.float64, key=jax.random.key(0))
        mha = eqx.nn.MultiheadAttention(2, 8, dtype=jnp.float64, key=jax.random.key(0))
        assert ours.query_proj.weight.dtype == jnp.float64
        x = jax.random.normal(jax.random.key(1), (6, 8), jnp.float64)
        np.testing.assert_allclose(_call(ours, x, x, x), _call(mha, x, x, x), rtol=1e-12,
                                   atol=1e-12)


def test_from_eqx_keeps_weights_and_dropout():
    mha = eqx.nn.MultiheadAttention(4, 16, 12, 10, 8, use_key_bias=True, dropout_p=0.3,
                                    inference=True, key=jax.random.key(1))
    ours = FlashMultiheadAttention.from_eqx(mha, causal=True, block_q=4)
    for name in ("query_proj", "key_proj", "value_proj", "output_proj"):
        a, b = getattr(ours, name), getattr(mha, name)
        assert jax.tree.structure(a) == jax.tree.structure(b)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            assert x is y  # the very same arrays, not copies
    assert ours.dropout.p == 0.3 and ours.dropout.inference is True
    assert (ours.key_size, ours.value_size, ours.output_size) == (12, 10, 8)
    assert ours.causal and ours.block_q == 4 and ours.num_kv_heads == 4
    q, k, v = _inputs(jax.random.key(2), 16, 12, 10, seq_k=SEQ_Q)
    causal = _tril(SEQ_Q, SEQ_Q)
    np.testing.assert_allclose(_call(ours, q, k, v), _call(mha, q, k, v, causal), rtol=1e-5,
                               atol=1e-6)


# --- parity with eqx.nn.MultiheadAttention ---


def _mask(kind, key, heads=4):
    if kind is None:
        return None, None
    if kind == "padding":
        pad = jnp.arange(SEQ_K) < 15
        return pad, jnp.broadcast_to(pad, (SEQ_Q, SEQ_K))
    shape = (SEQ_Q, SEQ_K) if kind == "dense" else (heads, SEQ_Q, SEQ_K)
    m = jax.random.bernoulli(key, 0.6, shape)
    m = m.at[..., 0].set(True)  # no fully masked rows here (see the dedicated test)
    return m, m


@pytest.mark.parametrize("mask_kind", [None, "padding", "dense", "per_head"])
def test_matches_equinox(mask_kind, getkey):
    sizes = {"key_size": 12, "value_size": 10, "output_size": 6, "qk_size": 5, "vo_size": 3,
             "use_query_bias": True, "use_value_bias": True, "use_output_bias": True}
    model_key = getkey()
    mha = eqx.nn.MultiheadAttention(4, 16, **sizes, key=model_key)
    ours = FlashMultiheadAttention(4, 16, **sizes, block_q=8, block_k=8, key=model_key)
    q, k, v = _inputs(getkey(), 16, 12, 10)
    ours_mask, eqx_mask = _mask(mask_kind, getkey())
    cot = jax.random.normal(getkey(), (SEQ_Q, 6))
    (val_e, out_e), grads_e = _value_and_grads(mha, q, k, v, cot, mask=eqx_mask)
    (val_o, out_o), grads_o = _value_and_grads(ours, q, k, v, cot, mask=ours_mask)
    np.testing.assert_allclose(val_o, val_e, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out_o, out_e, rtol=1e-5, atol=1e-6)
    # Same field names, so the gradient pytrees line up leaf for leaf.
    (gm_e, *gx_e), (gm_o, *gx_o) = grads_e, grads_o
    for name in ("query_proj", "key_proj", "value_proj", "output_proj"):
        _assert_tree_close(getattr(gm_o, name), getattr(gm_e, name))
    _assert_tree_close(gx_o, gx_e)


def _rope_heads(rope):
    def process_heads(q, k, v):
        q = jax.vmap(rope, in_axes=1, out_axes=1)(q)
        k = jax.vmap(rope, in_axes=1, out_axes=1)(k)
        return q, k, v

    return process_heads


def test_rotary_process_heads(getkey):
    model_key = getkey()
    mha = eqx.nn.MultiheadAttention(4, 16, key=model_key)
    ours = FlashMultiheadAttention(4, 16, causal=True, key=model_key)
    rope = eqx.nn.RotaryPositionalEmbedding(4)
    x, _, _ = _inputs(getkey())
    causal = _tril(SEQ_Q, SEQ_Q)
    cot = jax.random.normal(getkey(), (SEQ_Q, 16))
    process_heads = _rope_heads(rope)
    (val_e, _), grads_e = _value_and_grads(mha, x, x, x, cot, mask=causal,
                                           process_heads=process_heads)
    (val_o, out_o), grads_o = _value_and_grads(ours, x, x, x, cot, process_heads=process_heads)
    np.testing.assert_allclose(val_o, val_e, rtol=1e-5)
    _assert_tree_close(grads_o[1:], grads_e[1:])
    _assert_tree_close(_params(grads_o[0]).query_proj, _params(grads_e[0]).query_proj)
    # Rotary embeddings actually changed something.
    assert not np.allclose(out_o, _call(ours, x, x, x))


def test_fully_masked_row_differs_from_equinox(getkey):
    model_key = getkey()
    mha = eqx.nn.MultiheadAttention(2, 8, use_output_bias=True, key=model_key)
    ours = FlashMultiheadAttention(2, 8, use_output_bias=True, key=model_key)
    x = jax.random.normal(getkey(), (6, 8))
    mask = np.ones((6, 6), bool)
    mask[2] = False
    mask = jax.device_put(mask)
    out_o, out_e = (np.asarray(_call(m, x, x, x, mask)) for m in (ours, mha))
    rows = np.arange(6) != 2
    np.testing.assert_allclose(out_o[rows], out_e[rows], rtol=1e-5, atol=1e-6)
    # Equinox attends uniformly (the mean of the values); we attend to nothing: 0 heads,
    # so the output is just the output projection's bias.
    assert ours.output_proj.bias is not None
    np.testing.assert_allclose(out_o[2], ours.output_proj.bias, rtol=1e-6)
    mean_v = eqx.filter_jit(lambda x: mha.output_proj(jax.vmap(mha.value_proj)(x).mean(0)))(x)
    np.testing.assert_allclose(out_e[2], mean_v, rtol=1e-5, atol=1e-6)
    grads = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(m(x, x, x, mask) ** 2)))(ours)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


def test_options_match_dense_masks(getkey):
    model_key = getkey()
    mha = eqx.nn.MultiheadAttention(4, 16, key=model_key)
    ours = FlashMultiheadAttention(4, 16, causal=True, window=(3, None), softcap=None,
                                   key=model_key)
    q, k, v = _inputs(getkey())
    i = np.arange(SEQ_Q)[:, None] + SEQ_K - SEQ_Q
    j = np.arange(SEQ_K)[None, :]
    dense = jax.device_put((j <= i) & (j >= i - 3))
    np.testing.assert_allclose(_call(ours, q, k, v), _call(mha, q, k, v, dense), rtol=1e-5,
                               atol=1e-6)


# --- batching and transformations ---


def test_vmap_with_per_example_padding(getkey):
    model_key = getkey()
    mha = eqx.nn.MultiheadAttention(4, 16, key=model_key)
    ours = FlashMultiheadAttention(4, 16, key=model_key)
    batch = 3
    x = jax.random.normal(getkey(), (batch, SEQ_K, 16))
    lengths = np.array([SEQ_K, 13, 5])
    pad = np.arange(SEQ_K)[None, :] < lengths[:, None]
    out = np.asarray(jax.vmap(ours)(x, x, x, jax.device_put(pad)))
    x = np.asarray(x)  # (sliced in NumPy: no eager op to compile)
    for b in range(batch):
        dense = np.broadcast_to(pad[b], (SEQ_K, SEQ_K))
        xb, dense = jax.device_put((x[b], dense))
        np.testing.assert_allclose(out[b], _call(mha, xb, xb, xb, dense), rtol=1e-5, atol=1e-6)


def test_filter_jit_and_grad(getkey):
    ours = FlashMultiheadAttention(4, 16, causal=True, dropout_p=0.2, key=getkey())
    x = jax.random.normal(getkey(), (2, SEQ_Q, 16))
    keys = jax.random.split(getkey(), 2)

    @eqx.filter_jit
    def step(model, x, keys):
        def loss(m):
            return jnp.mean(jax.vmap(lambda xi, ki: m(xi, xi, xi, key=ki))(x, keys) ** 2)

        value, grads = eqx.filter_value_and_grad(loss)(model)
        return value, eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads))

    value, new = step(ours, x, keys)
    value2, _ = step(new, x, keys)
    assert np.isfinite(value) and np.isfinite(value2)
    assert not np.allclose(new.query_proj.weight, ours.query_proj.weight)


def test_gqa_equals_repeated_kv_projections(getkey):
    heads, kv_heads, qk, vo = 4, 2, 3, 5
    ours = FlashMultiheadAttention(heads, 16, qk_size=qk, vo_size=vo, num_kv_heads=kv_heads,
                                   use_key_bias=True, key=getkey())
    assert ours.key_proj.weight.shape == (kv_heads * qk, 16)
    groups = heads // kv_heads

    def repeat(linear, size):
        # Query head h uses kv head h // groups. (In NumPy: no eager op to compile.)
        new = eqx.nn.Linear(16, heads * size, use_bias=linear.use_bias, key=getkey())
        w = np.repeat(np.asarray(linear.weight).reshape(kv_heads, size, -1), groups, axis=0)
        new = eqx.tree_at(lambda lin: lin.weight, new,
                          jax.device_put(w.reshape(heads * size, -1)))
        if linear.bias is not None:
            b = np.repeat(np.asarray(linear.bias).reshape(kv_heads, size), groups, axis=0)
            new = eqx.tree_at(lambda lin: lin.bias, new, jax.device_put(b.reshape(-1)))
        return new

    mha = eqx.nn.MultiheadAttention(heads, 16, qk_size=qk, vo_size=vo, use_key_bias=True,
                                    key=getkey())
    mha = eqx.tree_at(
        lambda m: (m.query_proj, m.key_proj, m.value_proj, m.output_proj),
        mha,
        (ours.query_proj, repeat(ours.key_proj, qk), repeat(ours.value_proj, vo),
         ours.output_proj),
    )
    q, k, v = _inputs(getkey())
    mask = np.random.default_rng(0).random((heads, SEQ_Q, SEQ_K)) < 0.7
    mask[..., 0] = True
    mask = jax.device_put(mask)
    np.testing.assert_allclose(_call(ours, q, k, v, mask), _call(mha, q, k, v, mask),
                               rtol=1e-5, atol=1e-6)
    mqa = FlashMultiheadAttention(heads, 16, num_kv_heads=1, key=getkey())
    assert mqa(q, k, v).shape == (SEQ_Q, 16)


# --- dropout and the inference switch ---


def test_dropout_matches_plain_attention(getkey):
    model_key, drop_key = getkey(), getkey()
    ours = FlashMultiheadAttention(4, 16, dropout_p=0.3, num_kv_heads=2, key=model_key)
    q, k, v = _inputs(getkey())
    out = _call(ours, q, k, v, key=drop_key)

    @jax.jit  # compiled whole: faster than op by op
    def reference(q, k, v, key):
        heads = [
            jax.vmap(p)(x).reshape(x.shape[0], n, -1).swapaxes(0, 1)
            for p, x, n in ((ours.query_proj, q, 4), (ours.key_proj, k, 2),
                            (ours.value_proj, v, 2))
        ]
        ref, _ = plain_attention(*heads, dropout_rate=0.3, key=key)
        return jax.vmap(ours.output_proj)(ref.swapaxes(0, 1).reshape(SEQ_Q, -1))

    np.testing.assert_allclose(out, reference(q, k, v, drop_key), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out, _call(ours, q, k, v, key=drop_key))
    assert not np.allclose(out, _call(ours, q, k, v, key=getkey()))


def test_inference_switch(getkey):
    model_key = getkey()
    ours = FlashMultiheadAttention(4, 16, dropout_p=0.5, key=model_key)
    clean = FlashMultiheadAttention(4, 16, key=model_key)
    q, k, v = _inputs(getkey())
    expected = clean(q, k, v)
    drop_key = getkey()
    assert not np.allclose(ours(q, k, v, key=drop_key), expected)
    np.testing.assert_allclose(ours(q, k, v, key=drop_key, inference=True), expected)
    inf = eqx.nn.inference_mode(ours)
    assert inf.dropout.inference is True
    np.testing.assert_allclose(inf(q, k, v), expected)  # no key needed
    train = eqx.nn.inference_mode(inf, value=False)
    np.testing.assert_array_equal(train(q, k, v, key=drop_key), ours(q, k, v, key=drop_key))
    with pytest.raises(RuntimeError, match="key"):
        ours(q, k, v)
    np.testing.assert_allclose(ours(q, k, v, key=drop_key, inference=False),
                               ours(q, k, v, key=drop_key))


def test_deprecated_deterministic_keyword(getkey):
    """`deterministic=` is accepted as `eqx.nn.MultiheadAttention` accepts it: as
    `inference=`, with a warning."""
    model_key, drop_key = getkey(), getkey()
    ours = FlashMultiheadAttention(4, 16, dropout_p=0.5, key=model_key)
    theirs = eqx.nn.MultiheadAttention(4, 16, dropout_p=0.5, key=model_key)
    q, k, v = _inputs(getkey())
    with pytest.warns(UserWarning, match="deterministic"):
        out = ours(q, k, v, deterministic=True)
    with pytest.warns(UserWarning, match="deterministic"):
        expected = theirs(q, k, v, deterministic=True)
    np.testing.assert_allclose(out, ours(q, k, v, inference=True))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    with pytest.warns(UserWarning, match="deterministic"):
        dropped = ours(q, k, v, key=drop_key, deterministic=False)
    np.testing.assert_array_equal(dropped, ours(q, k, v, key=drop_key))


# --- FlashAttention ---


def test_flash_attention_module(getkey):
    q, k, v = qkv(getkey(), (4, SEQ_Q, 8), (2, SEQ_K, 8), dim_v=6)
    attn = FlashAttention(causal=True, window=[4, None], softcap=5.0, scale=0.3, block_q=4,
                          block_k=8, dropout_p=0.25)
    assert attn.window == (4, None)
    opts = {"causal": True, "window": (4, None), "softcap": 5.0, "scale": 0.3}
    rng = np.random.default_rng(0)  # (masks made in NumPy: no eager op to compile)
    pad, dense, per_head = jax.device_put((
        np.arange(SEQ_K) < 17, rng.random((SEQ_Q, SEQ_K)) < 0.8,
        rng.random((4, SEQ_Q, SEQ_K)) < 0.8))
    drop_key = getkey()
    plain = eqx.filter_jit(plain_attention)  # (compiled whole: faster than op by op)
    np.testing.assert_allclose(
        attn(q, k, v, pad, key=drop_key),
        plain(q, k, v, pad, dropout_rate=0.25, key=drop_key, **opts)[0],
        rtol=1e-5, atol=1e-6,
    )
    for m in (dense, per_head):
        np.testing.assert_allclose(
            attn(q, k, v, m, inference=True),
            plain(q, k, v, attn_mask=m, **opts)[0], rtol=1e-5, atol=1e-6,
        )
    out = eqx.nn.inference_mode(attn)(q, k, v)
    expected = flash_attention(q, k, v, block_q=4, block_k=8, **opts)[0]
    np.testing.assert_array_equal(out, expected)
    with pytest.raises(RuntimeError, match="key"):
        attn(q, k, v)
    assert attn(q, k, v, key=drop_key).shape == (4, SEQ_Q, 6)


def test_lengths_bias_and_alibi_at_call_time(getkey):
    """Both modules take `q_lengths`/`kv_lengths`/`bias`/`alibi_slopes` per example, and
    `vmap` gives per-example values: the same answer as the batched functions."""
    batch = 3
    q, k, v = qkv(getkey(), (batch, 4, SEQ_Q, 8), (batch, 2, SEQ_K, 8))
    bias = jax.random.normal(getkey(), (batch, 4, SEQ_Q, SEQ_K))
    slopes = jnp.array([0.5, 0.25, 0.125, 0.0625])
    q_len, kv_len = jnp.array([SEQ_Q, 7, 1]), jnp.array([SEQ_K, 9, 3])
    extra = dict(bias=bias, q_lengths=q_len, kv_lengths=kv_len)

    attn = FlashAttention(causal=True, block_q=4, block_k=8)
    # Each computation compiled whole: eagerly, each op compiles a program.
    out = np.asarray(jax.jit(jax.vmap(lambda q, k, v, b, lq, lk: attn(
        q, k, v, bias=b, q_lengths=lq, kv_lengths=lk, alibi_slopes=slopes)))(
        q, k, v, bias, q_len, kv_len))
    ref, _ = eqx.filter_jit(plain_attention)(q, k, v, causal=True, alibi_slopes=slopes,
                                             **extra)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    assert np.all(out[1, :, 7:] == 0)  # queries past q_lengths

    # The multi-head module: the same heads through the projections, and rows past
    # q_lengths are the output projection of zeros.
    mha = FlashMultiheadAttention(4, 16, num_kv_heads=2, causal=True, use_output_bias=True,
                                  key=getkey())
    x = jax.random.normal(getkey(), (batch, SEQ_K, 16))
    y = x[:, :SEQ_Q]

    def ours(y, x, b, lq, lk):
        return mha(y, x, x, bias=b, q_lengths=lq, kv_lengths=lk, alibi_slopes=slopes)

    def reference(y, x, b, lq, lk):
        def attend(q, k, v):  # (seq, heads, size) -> heads first, plain attention, back
            t = (jnp.swapaxes(a, 0, 1) for a in (q, k, v))
            out, _ = plain_attention(*t, causal=True, bias=b, q_lengths=lq, kv_lengths=lk,
                                     alibi_slopes=slopes)
            return jnp.swapaxes(out, 0, 1)

        q = jax.vmap(mha.query_proj)(y).reshape(SEQ_Q, 4, -1)
        k = jax.vmap(mha.key_proj)(x).reshape(SEQ_K, 2, -1)
        v = jax.vmap(mha.value_proj)(x).reshape(SEQ_K, 2, -1)
        return jax.vmap(mha.output_proj)(attend(q, k, v).reshape(SEQ_Q, -1))

    out = np.asarray(jax.jit(jax.vmap(ours))(y, x, bias, q_len, kv_len))
    np.testing.assert_allclose(out, jax.jit(jax.vmap(reference))(y, x, bias, q_len, kv_len),
                               rtol=1e-5, atol=1e-5)
    zeros_out = _call(mha.output_proj,
                      jax.device_put(np.zeros(mha.num_heads * mha.vo_size, np.float32)))
    np.testing.assert_allclose(out[2, 1:], np.broadcast_to(zeros_out, (SEQ_Q - 1, 16)),
                               rtol=1e-6, atol=1e-6)

    # Gradients reach the bias and the slopes through the module.
    q, k, v, bias = jax.device_put([np.asarray(x)[0] for x in (q, k, v, bias)])
    d_bias, d_slopes = jax.jit(jax.grad(lambda b, s: jnp.sum(attn(
        q, k, v, bias=b, alibi_slopes=s) ** 2), argnums=(0, 1)))(bias, slopes)
    r_bias, r_slopes = jax.jit(jax.grad(lambda b, s: jnp.sum(plain_attention(
        q, k, v, causal=True, bias=b, alibi_slopes=s)[0] ** 2), argnums=(0, 1)))(
        bias, slopes)
    np.testing.assert_allclose(d_bias, r_bias, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(d_slopes, r_slopes, rtol=1e-4, atol=1e-5)
