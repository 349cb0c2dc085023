"""Ready-made `score_mod`s: ALiBi and T5's learned relative position bias, and
`RelativeScoreMod`, the base of every bias that depends on the key-minus-query offset.

They are `eqx.Module`s called as `score_mod(score, batch, head, q_idx, kv_idx)`, so their
arrays are PyTree leaves: pass the module as `score_mod=` (or as a field of
`FlashAttention`) and gradients reach them.
"""

import abc
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The standard ALiBi slopes (Press et al.): `2^(-8 i / n)` for `i = 1..n` when `n` is
    a power of two; otherwise those of the power of two below, then every other slope of
    the power of two above."""
    def powers(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if num_heads <= 0:
        raise ValueError(f"num_heads must be a positive int; got num_heads={num_heads!r}")
    below = 2 ** math.floor(math.log2(num_heads))
    slopes = powers(below)
    if below < num_heads:
        slopes += powers(2 * below)[0::2][: num_heads - below]
    return np.asarray(slopes, np.float32)


class ALiBi(eqx.Module):
    """ALiBi as a `score_mod`: adds `-slopes[head] * |q_idx + offset - kv_idx|`.

    `offset` aligns query and key positions: `seq_k - seq_q` aligns them bottom-right,
    as `flash_attention(alibi_slopes=...)` does, and the default 0 equals it when
    `seq_q == seq_k`. Given alone as the `score_mod` (no `alibi_slopes`, no positions),
    `flash_attention` runs it as its own ALiBi (`alibi_slopes=alibi.slopes` at this
    offset: no call per block, and in the Pallas TPU kernels too); composed into another
    function it is called per block like any score_mod. `slopes` is a leaf, so it trains
    if you let it (freeze it with `eqx.partition` or `jax.lax.stop_gradient` otherwise).
    """

    slopes: Float[Array, " heads"]
    offset: int = eqx.field(static=True, default=0)

    def __init__(self, num_heads: int, offset: int = 0):
        self.slopes = jnp.asarray(alibi_slopes(num_heads))
        self.offset = int(offset)

    def __call__(self, score: Array, batch: Array, head: Array, q_idx: Array,
                 kv_idx: Array) -> Array:
        del batch
        distance = jnp.abs(q_idx + self.offset - kv_idx).astype(score.dtype)
        return score - self.slopes[head].astype(score.dtype) * distance


class RelativeScoreMod(eqx.Module):
    """A `score_mod` adding `bias(head, kv_idx - q_idx)`: a bias of the head and of the
    key's offset from the query alone (T5's buckets, a learned table of clipped
    distances, KERPLE, ...). Subclass it and write `bias`.

    Every kernel family runs it as the `score_mod` it is. The Pallas TPU kernels read
    it as what it is: its bias depends on the offset only, so `bias` is evaluated once
    per call on every offset the sequences have (a vector per head, by plain JAX: any
    function, table lookups included), and each tile's term is the Toeplitz matrix of a
    window of that vector, read from the vector's diagonals; the backward kernel sums
    the logits' cotangent along them, and the module's arrays get their gradient from
    that vector's. A plain `score_mod` adding such a lookup (`score + table[h,
    clip(kv_idx - q_idx)]`) is recognised as one. `bias` must be elementwise: `head`
    and `relative` are int32 arrays that broadcast against each other.
    """

    @abc.abstractmethod
    def bias(self, head: Array, relative: Array) -> Array:
        """The bias of query head `head` at offset `relative = kv_idx - q_idx`."""

    def __call__(self, score: Array, batch: Array, head: Array, q_idx: Array,
                 kv_idx: Array) -> Array:
        del batch
        return score + self.bias(head, kv_idx - q_idx).astype(score.dtype)


def relative_position_bucket(
    relative_position: Int[Array, "*shape"], bidirectional: bool, num_buckets: int,
    max_distance: int,
) -> Int[Array, "*shape"]:
    """T5's bucket of `kv_idx - q_idx`: exact for small distances, logarithmic up to
    `max_distance`, then the last bucket; half the buckets for each direction when
    `bidirectional`, else keys after the query share bucket 0."""
    n = -relative_position.astype(jnp.int32)
    bucket = jnp.zeros_like(n)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + jnp.where(n < 0, num_buckets, 0).astype(jnp.int32)
        n = jnp.abs(n)
    else:
        n = jnp.maximum(n, 0)
    max_exact = num_buckets // 2
    # log(0) never happens: small distances take the exact branch.
    scaled = jnp.log(jnp.maximum(n, 1).astype(jnp.float32) / max_exact) / math.log(
        max_distance / max_exact)
    large = max_exact + (scaled * (num_buckets - max_exact)).astype(jnp.int32)
    large = jnp.minimum(large, num_buckets - 1)
    return bucket + jnp.where(n < max_exact, n, large)


class RelativePositionBias(RelativeScoreMod):
    """T5's learned relative position bias as a `score_mod`: adds
    `table[bucket(kv_idx - q_idx), head]` (`relative_position_bucket`).

    `table` `(num_buckets, num_heads)` is a leaf, so it trains through `flash_attention`
    (its cotangent is accumulated block by block in float32). A `RelativeScoreMod`: the
    Pallas TPU kernels run it in the kernel, its gradient included.
    """

    table: Float[Array, "buckets heads"]
    num_buckets: int = eqx.field(static=True)
    max_distance: int = eqx.field(static=True)
    bidirectional: bool = eqx.field(static=True)

    def __init__(self, num_heads: int, num_buckets: int = 32, max_distance: int = 128,
                 bidirectional: bool = True, *, key: PRNGKeyArray):
        min_buckets = 4 if bidirectional else 2
        if num_buckets < min_buckets or max_distance <= num_buckets // (4 if bidirectional else 2):
            raise ValueError(
                f"num_buckets must be >= {min_buckets} and max_distance larger than the exact "
                f"range; got num_buckets={num_buckets}, max_distance={max_distance}"
            )
        self.table = 0.1 * jax.random.normal(key, (num_buckets, num_heads), jnp.float32)
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.bidirectional = bidirectional

    def bias(self, head: Array, relative: Array) -> Array:
        bucket = relative_position_bucket(relative, self.bidirectional, self.num_buckets,
                                          self.max_distance)
        return self.table[bucket, head]
