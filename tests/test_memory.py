"""Memory is linear in the sequence: the compiled forward+backward never holds anything
of size seq_q x seq_k. Checked on XLA's buffer assignment, so nothing big is allocated."""

import jax
import jax.numpy as jnp
import pytest
from helpers import optimised_compilation

from eqx_flash import flash_attention, plain_attention

SEQ, DIM = 16384, 64
SCORES = SEQ * SEQ * 4  # one float32 logit matrix: 1 GiB


@pytest.fixture(autouse=True)
def _users_compilation():
    """Measure the program users get (see `helpers.optimised_compilation`)."""
    with optimised_compilation():
        yield


def _temp_bytes(attention, causal):
    def loss(q, k, v):
        out, lse = attention(q, k, v, causal=causal)
        return out.sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()

    x = jax.ShapeDtypeStruct((1, 1, SEQ, DIM), jnp.float32)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
    analysis = compiled.memory_analysis()
    if analysis is None:
        pytest.fail("this backend gives no memory analysis")
    return analysis.temp_size_in_bytes


@pytest.mark.parametrize("causal", [False, True])
def test_forward_backward_is_linear_in_memory(causal):
    ours = _temp_bytes(flash_attention, causal)
    plain = _temp_bytes(plain_attention, causal)
    # Blocks are at most 512 x 512 (1 MiB); q, k, v and their gradients are 4 MiB each.
    assert ours < SCORES / 16, f"{ours / 2**20:.0f} MiB of temporaries"
    assert plain > 2 * SCORES, f"plain attention needed only {plain / 2**20:.0f} MiB"


def _compiled_temp(fn, *args) -> int:
    analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
    if analysis is None:
        pytest.fail("this backend gives no memory analysis")
    return analysis.temp_size_in_bytes


def test_forward_mode_is_linear_in_memory():
    """The jvp alone, and the sCM/MeanFlow training step (grad of a loss on the jvp's
    primal, stop_gradient on a target built from its tangent) through a small model with
    FlashMultiheadAttention, each hold far less than one seq x seq float32 matrix."""
    import equinox as eqx

    from eqx_flash import FlashMultiheadAttention

    x = jax.ShapeDtypeStruct((1, 1, SEQ, DIM), jnp.float32)

    def jvp(q, k, v, dq, dk, dv):
        return jax.jvp(lambda q, k, v: flash_attention(q, k, v, causal=True), (q, k, v),
                       (dq, dk, dv))

    jvp_bytes = _compiled_temp(jvp, x, x, x, x, x, x)
    assert jvp_bytes < SCORES / 8, f"jvp: {jvp_bytes / 2**20:.0f} MiB of temporaries"

    class Net(eqx.Module):
        attention: FlashMultiheadAttention
        proj: eqx.nn.Linear

        def __call__(self, x, t):
            h = jax.vmap(self.proj)(x) * t
            return x + self.attention(h, h, h)

    keys = jax.random.split(jax.random.key(0), 2)
    net = Net(FlashMultiheadAttention(1, DIM, causal=True, key=keys[0]),
              eqx.nn.Linear(DIM, DIM, key=keys[1]))
    params, static = eqx.partition(net, eqx.is_array)

    def loss(params, x, v, t):
        model = eqx.combine(params, static)
        u, du = jax.jvp(model, (x, t), (v, jnp.ones_like(t)))
        return jnp.mean((u - jax.lax.stop_gradient(u - du)) ** 2)

    seq = jax.ShapeDtypeStruct((SEQ, DIM), jnp.float32)
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    step_bytes = _compiled_temp(jax.grad(loss), params, seq, seq, scalar)
    assert step_bytes < SCORES / 8, f"sCM step: {step_bytes / 2**20:.0f} MiB of temporaries"


def test_forward_mode_with_alibi_is_linear_in_memory():
    """Tangents along the ALiBi slopes too (computed per block, like the term itself)."""
    x = jax.ShapeDtypeStruct((1, 2, SEQ, DIM), jnp.float32)
    slopes = jax.ShapeDtypeStruct((2,), jnp.float32)

    def jvp(q, k, v, s, dq, ds):
        return jax.jvp(lambda q, s: flash_attention(q, k, v, alibi_slopes=s, causal=True),
                       (q, s), (dq, ds))

    jvp_bytes = _compiled_temp(jvp, x, x, x, slopes, x, slopes)
    assert jvp_bytes < SCORES / 8, f"jvp: {jvp_bytes / 2**20:.0f} MiB of temporaries"


def test_sinks_and_max_scores_stay_linear_in_memory():
    """A causal fwd+bwd with learnable sinks (their gradient included) that also returns
    the max scores (#23): still far below one seq x seq float32 matrix."""
    def loss(q, k, v, sinks):
        out, lse, top = flash_attention(q, k, v, causal=True, sinks=sinks,
                                        return_max_scores=True)
        return out.sum() + lse.sum(), top

    x = jax.ShapeDtypeStruct((1, 1, SEQ, DIM), jnp.float32)
    sinks = jax.ShapeDtypeStruct((1,), jnp.float32)
    grad = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
    temp = _compiled_temp(grad, x, x, x, sinks)
    assert temp < SCORES / 8, f"{temp / 2**20:.0f} MiB of temporaries"


def _second_order_loss(q, k, v):
    out, lse = flash_attention(q, k, v, causal=True)
    return jnp.sum(jnp.sin(out)) + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()


def test_hessian_vector_product_is_linear_in_memory():
    """A causal HVP (jax.jvp of jax.grad along q, k, v) at seq 16384, one head, dim 64:
    temporaries below N^2 * 4 / 8 bytes, like the first-order paths (#24)."""
    x = jax.ShapeDtypeStruct((1, 1, SEQ, DIM), jnp.float32)
    grad = jax.grad(_second_order_loss, argnums=(0, 1, 2))

    def hvp(q, k, v, dq, dk, dv):
        return jax.jvp(grad, (q, k, v), (dq, dk, dv))[1]

    temp = _compiled_temp(hvp, x, x, x, x, x, x)
    assert temp < SCORES / 8, f"HVP: {temp / 2**20:.0f} MiB of temporaries"


def test_gradient_of_a_gradient_is_linear_in_memory():
    """A gradient penalty's gradient (reverse over reverse) stays blockwise too."""
    x = jax.ShapeDtypeStruct((1, 1, SEQ, DIM), jnp.float32)

    def penalty(q, k, v):
        return jnp.sum(jax.grad(_second_order_loss)(q, k, v) ** 2)

    temp = _compiled_temp(jax.grad(penalty, argnums=(0, 1, 2)), x, x, x)
    assert temp < SCORES / 8, f"grad of grad: {temp / 2**20:.0f} MiB of temporaries"
