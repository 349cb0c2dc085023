"""MeanFlow (one-step generation, arXiv 2505.13447) on a toy set task, with `jax.jvp`
through `eqx_flash.FlashMultiheadAttention`.

Each sample is a set of 16 points in 2-d lying evenly spaced on a circle of random
radius (0.5-1.5), rotation and centre: the points only make sense together, so the
network has to attend across them. A small transformer `u(z, r, t)` learns the *average*
velocity of the flow from data (t = 0) to noise (t = 1) over `[r, t]`; the MeanFlow
identity gives its regression target from a jvp of the network along `(dz/dt, 0, 1)`:

    u_target = v - (t - r) * d/dt u(z_t, r, t),   v = noise - data,

with `stop_gradient` on the target, so `jax.grad` of the loss needs the jvp's primal
output only, and the jvp's tangent is computed blockwise by eqx_flash's tangent kernel
(the gradient still runs the hand-written backward). Sampling is one step:
`x = noise - u(noise, 0, 1)`. Runs on CPU in about a minute:

    python examples/meanflow.py --steps 600
"""

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from eqx_flash import FlashMultiheadAttention

POINTS = 16


def sample_data(key: PRNGKeyArray, batch: int) -> Float[Array, "batch points 2"]:
    k_r, k_phase, k_centre = jax.random.split(key, 3)
    radius = jax.random.uniform(k_r, (batch, 1), minval=0.5, maxval=1.5)
    phase = jax.random.uniform(k_phase, (batch, 1), maxval=2 * jnp.pi)
    angles = phase + jnp.linspace(0.0, 2 * jnp.pi, POINTS, endpoint=False)[None, :]
    centre = 0.3 * jax.random.normal(k_centre, (batch, 1, 2))
    circle = jnp.stack([jnp.cos(angles), jnp.sin(angles)], axis=-1)
    return centre + radius[..., None] * circle


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attention: FlashMultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, width: int, heads: int, *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.norm1 = eqx.nn.LayerNorm(width)
        self.attention = FlashMultiheadAttention(heads, width, key=k1)
        self.norm2 = eqx.nn.LayerNorm(width)
        self.mlp = eqx.nn.MLP(width, width, 2 * width, depth=1, activation=jax.nn.gelu, key=k2)

    def __call__(self, x: Float[Array, "points width"]) -> Float[Array, "points width"]:
        h = jax.vmap(self.norm1)(x)
        x = x + self.attention(h, h, h)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class AverageVelocity(eqx.Module):
    """`u(z, r, t)`: the average velocity over `[r, t]` of every point of the set."""

    embed: eqx.nn.Linear
    blocks: list[Block]
    out: eqx.nn.Linear

    def __init__(self, width: int = 64, heads: int = 4, depth: int = 1, *, key: PRNGKeyArray):
        keys = jax.random.split(key, depth + 2)
        self.embed = eqx.nn.Linear(2 + 4, width, key=keys[0])
        self.blocks = [Block(width, heads, key=k) for k in keys[1:-1]]
        self.out = eqx.nn.Linear(width, 2, key=keys[-1])

    def __call__(
        self, z: Float[Array, "points 2"], r: Float[Array, ""], t: Float[Array, ""]
    ) -> Float[Array, "points 2"]:
        times = jnp.stack([t, t - r, jnp.sin(3 * t), jnp.cos(3 * t)])
        features = jnp.concatenate([z, jnp.broadcast_to(times, (z.shape[0], 4))], axis=-1)
        h = jax.vmap(self.embed)(features)
        for block in self.blocks:
            h = block(h)
        return jax.vmap(self.out)(h)


def meanflow_loss(model: AverageVelocity, key: PRNGKeyArray, batch: int) -> Array:
    k_data, k_noise, k_t, k_r, k_same = jax.random.split(key, 5)
    x = sample_data(k_data, batch)
    e = jax.random.normal(k_noise, x.shape)
    t = jax.random.uniform(k_t, (batch,))
    r = jax.random.uniform(k_r, (batch,)) * t
    # Half the batch with r = t: plain flow matching (the instantaneous velocity).
    r = jnp.where(jax.random.bernoulli(k_same, 0.5, (batch,)), t, r)
    z = (1 - t[:, None, None]) * x + t[:, None, None] * e
    v = e - x

    def one(z, r, t, v):
        # d/dt u(z_t, r, t) along the flow: tangents (dz/dt, dr/dt, dt/dt) = (v, 0, 1).
        u, du_dt = jax.jvp(model, (z, r, t), (v, jnp.zeros_like(r), jnp.ones_like(t)))
        target = jax.lax.stop_gradient(v - (t - r) * du_dt)
        return jnp.mean((u - target) ** 2)

    return jnp.mean(jax.vmap(one)(z, r, t, v))


def sample(model: AverageVelocity, key: PRNGKeyArray, batch: int) -> Array:
    """One-step generation: from noise at t = 1 straight to data at r = 0."""
    e = jax.random.normal(key, (batch, POINTS, 2))
    zero, one = jnp.zeros(()), jnp.ones(())
    return jax.vmap(lambda e: e - model(e, zero, one))(e)


def circle_error(points: Float[Array, "batch points 2"]) -> Array:
    """How far generated sets are from circles: the spread of the distances to their
    centroid, relative to the mean distance (0 for a perfect circle; ~0.5 for noise)."""
    d = jnp.linalg.norm(points - points.mean(axis=1, keepdims=True), axis=-1)
    return jnp.mean(d.std(axis=1) / d.mean(axis=1))


# --- a hand-written Adam, to keep the example free of optimiser dependencies ---


def adam_init(params: PyTree) -> tuple[PyTree, PyTree, Array]:
    zeros = jax.tree.map(jnp.zeros_like, params)
    return zeros, zeros, jnp.zeros((), jnp.int32)


def adam_update(grads, state, lr: float, b1: float = 0.9, b2: float = 0.99, eps: float = 1e-8):
    m, v, t = state
    t = t + 1
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
    tf = t.astype(jnp.float32)
    correction = jnp.sqrt(1 - b2**tf) / (1 - b1**tf)
    updates = jax.tree.map(lambda m, v: -lr * correction * m / (jnp.sqrt(v) + eps), m, v)
    return updates, (m, v, t)


def train(
    steps: int = 600, *, batch: int = 64, lr: float = 2e-3, seed: int = 0, log_every: int = 50
) -> tuple[list[float], float]:
    """Train; return the loss at every step and the circle error of one-step samples."""
    key_model, key_train, key_sample = jax.random.split(jax.random.key(seed), 3)
    model = AverageVelocity(key=key_model)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    opt_state = adam_init(params)

    @eqx.filter_jit
    def step(params, opt_state, key):
        loss, grads = jax.value_and_grad(
            lambda p: meanflow_loss(eqx.combine(p, static), key, batch)
        )(params)
        updates, opt_state = adam_update(grads, opt_state, lr)
        return eqx.apply_updates(params, updates), opt_state, loss

    losses = []
    start = time.perf_counter()
    for i, key in enumerate(jax.random.split(key_train, steps)):
        params, opt_state, loss = step(params, opt_state, key)
        losses.append(float(loss))
        if log_every and (i % log_every == 0 or i == steps - 1):
            print(f"step {i:4d}  loss {losses[-1]:.4f}  ({time.perf_counter() - start:.1f}s)")
    model = eqx.combine(params, static)
    error = float(circle_error(eqx.filter_jit(sample)(model, key_sample, 256)))
    noise = float(circle_error(jax.random.normal(key_sample, (256, POINTS, 2))))
    print(f"one-step samples: circle error {error:.3f} (noise {noise:.3f}, data 0)")
    return losses, error


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600,
                        help="training steps (batches of 64 sets); the default takes about "
                        "a minute on a CPU")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the model's initialisation, the data and the samples")
    args = parser.parse_args()
    losses, _ = train(args.steps, seed=args.seed)
    print(f"loss: first {losses[0]:.4f}, last {losses[-1]:.4f}")
