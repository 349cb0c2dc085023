"""`eqx_flash.flax_attention` inside real Flax modules (`nnx.MultiHeadAttention`,
`linen.MultiHeadDotProductAttention`): the same outputs and parameter gradients as the
modules' default attention with the same parameters; dropout at its rate; a clear error
for `sow_weights`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close

import eqx_flash

# The test extra installs Flax; a machine without it (the TPU host) skips this module
# instead of failing the whole collection.
pytest.importorskip("flax", reason="Flax is not installed (the `flax` or `test` extra)")
from flax import linen, nnx  # noqa: E402

B, T, FEATURES, HEADS = 2, 24, 32, 4


def _nnx_pair(**kwargs):
    """Two nnx modules with the same parameters: Flax's attention and eqx_flash's."""
    ours = nnx.MultiHeadAttention(HEADS, FEATURES, decode=False, rngs=nnx.Rngs(0),
                                  attention_fn=eqx_flash.flax_attention, **kwargs)
    theirs = nnx.MultiHeadAttention(HEADS, FEATURES, decode=False, rngs=nnx.Rngs(0), **kwargs)
    return ours, theirs


def _masks():
    x = jax.random.normal(jax.random.key(1), (B, T, FEATURES))
    causal = nnx.make_causal_mask(jnp.ones((B, T)))
    lengths = jnp.array([T, 15])
    padding = nnx.make_attention_mask(jnp.arange(T)[None] < lengths[:, None],
                                      jnp.arange(T)[None] < lengths[:, None])
    return x, {"none": None, "causal": causal, "padding_causal": nnx.combine_masks(causal,
                                                                                   padding)}


@pytest.mark.parametrize("mask_name", ["none", "causal", "padding_causal"])
def test_nnx_outputs_and_parameter_gradients(mask_name):
    x, masks = _masks()
    mask = masks[mask_name]
    ours, theirs = _nnx_pair()
    out = ours(x, mask=mask, deterministic=True)
    ref = theirs(x, mask=mask, deterministic=True)
    rows = np.ones((B, T), bool) if mask is None else np.asarray(mask).any(axis=(1, 3))
    assert_close(np.where(rows[..., None], out, 0), np.where(rows[..., None], ref, 0))

    def loss(model):
        return jnp.sum(jnp.where(jnp.asarray(rows)[..., None], model(x, mask=mask,
                                                                     deterministic=True), 0) ** 2)

    grads = nnx.grad(loss)(ours)
    ref_grads = nnx.grad(loss)(theirs)
    for (path, g), (_, r) in zip(nnx.to_flat_state(nnx.state(grads)),
                                 nnx.to_flat_state(nnx.state(ref_grads)), strict=True):
        assert_close(g.get_value() if hasattr(g, "get_value") else g.value,
                     r.get_value() if hasattr(r, "get_value") else r.value, kind="grad",
                     name=str(path))


def test_nnx_is_causal_and_cross_attention_with_gqa_free_heads():
    x, _ = _masks()
    context = jax.random.normal(jax.random.key(2), (B, 40, FEATURES))
    ours, theirs = _nnx_pair()
    assert_close(ours(x, context, deterministic=True), theirs(x, context, deterministic=True))
    # several batch axes, as Flax allows
    xs = x.reshape(1, B, T, FEATURES)
    assert_close(ours(xs, deterministic=True), theirs(xs, deterministic=True))


def test_linen_module():
    x, masks = _masks()
    ours = linen.MultiHeadDotProductAttention(HEADS, attention_fn=eqx_flash.flax_attention)
    theirs = linen.MultiHeadDotProductAttention(HEADS)
    params = theirs.init(jax.random.key(0), x, x)
    for mask in (None, masks["causal"]):
        out = ours.apply(params, x, x, mask=mask, deterministic=True)
        assert_close(out, theirs.apply(params, x, x, mask=mask, deterministic=True))

    def loss(module, params):
        return jnp.sum(module.apply(params, x, x, mask=masks["causal"], deterministic=True) ** 2)

    grads = jax.grad(lambda p: loss(ours, p))(params)
    ref_grads = jax.grad(lambda p: loss(theirs, p))(params)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        assert_close(g, r, kind="grad")


def test_dropout_drops_at_its_rate():
    """Uniform attention (q = 0) onto one-hot values reads the weights back: a kept weight
    is 1 / (S (1 - rate)), a dropped one 0."""
    seq, rate = 256, 0.3
    q = jnp.zeros((1, 8, 2, 4))
    k = jnp.zeros((1, seq, 2, 4))
    v = jnp.broadcast_to(jnp.eye(seq)[None, :, None, :], (1, seq, 2, seq))
    out = eqx_flash.flax_attention(q, k, v, dropout_rng=jax.random.key(0), dropout_rate=rate)
    weights = np.asarray(out)
    dropped = np.mean(weights == 0)
    assert abs(dropped - rate) < 0.03, dropped
    np.testing.assert_allclose(weights[weights != 0], 1 / (seq * (1 - rate)), rtol=1e-5)
    same = eqx_flash.flax_attention(q, k, v, dropout_rng=jax.random.key(0), dropout_rate=rate,
                                    deterministic=True)
    np.testing.assert_allclose(np.asarray(same), 1 / seq, rtol=1e-5)
    ours, _ = _nnx_pair(dropout_rate=0.5)
    x, _ = _masks()
    assert not np.allclose(np.asarray(ours(x, deterministic=False)),
                           np.asarray(ours(x, deterministic=True)))


def test_errors():
    x, _ = _masks()
    ours, _ = _nnx_pair()
    with pytest.raises(NotImplementedError, match="sow_weights"):
        ours(x, deterministic=True, sow_weights=True)
    q = jnp.zeros((1, 8, 2, 4))
    with pytest.raises(ValueError, match="dropout_rng"):
        eqx_flash.flax_attention(q, q, q, dropout_rate=0.1)


def test_the_package_does_not_import_flax():
    import subprocess
    import sys

    code = ("import sys, eqx_flash; assert 'flax' not in sys.modules, 'flax imported'; "
            "print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr
