"""Decoding state: `KVCache`, the keys and values of the tokens seen so far.

A cache is an ordinary `eqx.Module` of arrays: it is passed to and returned from the
decoding call (`FlashMultiheadAttention.decode`), so it is a `jax.lax.scan` carry, a
`jax.vmap` argument (one cache per batch element, each with its own length) and a
donatable `eqx.filter_jit` argument without any extra machinery.
"""

import typing
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._api.binder import is_concrete


@typing.final
class KVCache(eqx.Module):
    """Keys and values of one sequence's past tokens, for one attention layer.

    Two modes:

    - **linear** (`window=None`): the buffers hold positions `0 .. max_len - 1`; `append`
        writes at `length`. Attention reads the valid prefix through `kv_lengths`, so
        key blocks past `length` are never computed.
    - **rolling** (`window=W`): the buffers hold the last `W` tokens, position `t` in
        slot `t % W`, for a causal model whose attention window reaches back `W - 1`
        tokens (`window=(W - 1, 0)`): memory stays fixed however long it generates.

    `length` is the number of tokens appended so far (the absolute position of the next
    one). Build one with `KVCache.empty`; batch by `jax.vmap`/`eqx.filter_vmap` over it.
    """

    k: Float[Array, "kv_heads max_len dim"]
    v: Float[Array, "kv_heads max_len dim_v"]
    length: Int[Array, ""]
    window: int | None = eqx.field(static=True, default=None)

    @classmethod
    def empty(
        cls, kv_heads: int, max_len: int, dim: int, dim_v: int | None = None,
        dtype: Any = jnp.float32, *, window: int | None = None,
    ) -> "KVCache":
        """An empty cache.

        **Arguments:**

        - `kv_heads`, `dim`, `dim_v`: the layer's key/value heads and head dims
            (`dim_v` defaults to `dim`).
        - `max_len`: positions the buffers hold (linear mode); ignored with `window`.
        - `dtype`: of the buffers.
        - `window`: if given, a rolling buffer of this many entries.

        **Returns:**

        A `KVCache` of zeros with `length = 0`.
        """
        dim_v = dim if dim_v is None else dim_v
        for name, n in (("kv_heads", kv_heads), ("max_len", max_len), ("dim", dim),
                        ("dim_v", dim_v)):
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ValueError(f"{name} must be a positive int; got {name}={n!r}")
        if window is not None:
            if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
                raise ValueError(f"window must be a positive int or None; got {window=!r}")
            max_len = window
        return cls(jnp.zeros((kv_heads, max_len, dim), dtype),
                   jnp.zeros((kv_heads, max_len, dim_v), dtype),
                   jnp.zeros((), jnp.int32), window)

    @property
    def size(self) -> int:
        """Entries in the buffers."""
        return self.k.shape[1]

    def append(
        self, k_new: Float[Array, "kv_heads n dim"], v_new: Float[Array, "kv_heads n dim_v"]
    ) -> "KVCache":
        """The cache with `n` more tokens written at positions `length .. length + n - 1`
        (`jax.lax.dynamic_update_slice`; under `jax.jit` with the cache donated, in place).

        **Arguments:**

        - `k_new`, `v_new`: the new tokens' keys and values.

        **Returns:**

        The new `KVCache`. Past `max_len`, linear mode raises: a `ValueError` for a
        concrete length, `eqx.error_if` under `jax.jit` on one device. With several
        devices a runtime error could abort the program, so instead the tokens that do
        not fit are dropped and `length` passes `max_len`: every later `decode` output
        is NaN.
        """
        if k_new.shape[0] != self.k.shape[0] or k_new.shape[2:] != self.k.shape[2:] or (
            v_new.shape != (*k_new.shape[:2], self.v.shape[2])
        ):
            raise ValueError(
                f"k_new, v_new must have shapes ({self.k.shape[0]}, n, {self.k.shape[2]}) and "
                f"({self.k.shape[0]}, n, {self.v.shape[2]}); got k_new.shape={k_new.shape}, "
                f"v_new.shape={v_new.shape}"
            )
        n = k_new.shape[1]
        k_new, v_new = k_new.astype(self.k.dtype), v_new.astype(self.v.dtype)
        if self.window is None:
            full = self.length + n > self.size
            message = "KVCache.append: the cache is full (length + n > max_len)"
            if is_concrete(full):
                if bool(full):
                    raise ValueError(f"{message}; got length={int(self.length)}, n={n}, "
                                     f"max_len={self.size}")
                length = self.length
            elif jax.device_count() == 1:
                length = eqx.error_if(self.length, full, message)
            else:
                # On several devices a runtime error here hangs the next collective and
                # then aborts the program, so none is raised: what does not fit is
                # dropped and `length` counts on past `max_len`, which `decode` answers
                # with NaN (as `eqx.error_if` does with EQX_ON_ERROR=nan).
                slots = self.length + jnp.arange(n, dtype=jnp.int32)
                k = self.k.at[:, slots].set(k_new, mode="drop", unique_indices=True)
                v = self.v.at[:, slots].set(v_new, mode="drop", unique_indices=True)
                return KVCache(k, v, self.length + n, None)
            k = jax.lax.dynamic_update_slice_in_dim(self.k, k_new, length, axis=1)
            v = jax.lax.dynamic_update_slice_in_dim(self.v, v_new, length, axis=1)
            return KVCache(k, v, length + n, None)
        # Rolling: only the last `size` new tokens survive; their slots are distinct.
        keep = min(n, self.size)
        slots = (self.length + n - keep + jnp.arange(keep, dtype=jnp.int32)) % self.size
        k = self.k.at[:, slots].set(k_new[:, n - keep:], unique_indices=True)
        v = self.v.at[:, slots].set(v_new[:, n - keep:], unique_indices=True)
        return KVCache(k, v, self.length + n, self.window)

    def positions(self) -> Int[Array, " max_len"]:
        """The absolute position held in each slot, -1 where none is yet."""
        slot = jnp.arange(self.size, dtype=jnp.int32)
        if self.window is None:
            return jnp.where(slot < self.length, slot, -1)
        # The largest t < length with t % size == slot.
        t = slot + self.size * ((self.length - 1 - slot) // self.size)
        return jnp.where(t >= 0, t, -1)
