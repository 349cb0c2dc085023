"""Memory is linear in the sequence: the compiled forward+backward never holds anything
of size seq_q x seq_k. Checked on XLA's buffer assignment, so nothing big is allocated."""

import jax
import jax.numpy as jnp
import pytest

from eqx_flash import flash_attention, plain_attention

SEQ, DIM = 16384, 64
SCORES = SEQ * SEQ * 4  # one float32 logit matrix: 1 GiB


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
