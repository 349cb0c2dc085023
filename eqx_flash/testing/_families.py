"""Families of `score_mod`/`mask_mod` the strategy draws: PyTrees (`eqx.Module`s), so
`check_attention` differentiates their floating leaves."""


import equinox as eqx
from jaxtyping import Array, Bool, Float, Int

from .._mods.position_bias import RelativeScoreMod


class RelativeBiasTable(RelativeScoreMod):
    """score_mod: a learned bias per query head and relative position `i - j` (a
    `RelativeScoreMod`: the Pallas TPU kernels build it in the kernel)."""

    table: Float[Array, "heads distances"]  # distances = seq_q + seq_k - 1
    seq_k: int = eqx.field(static=True)

    def bias(self, head, relative):
        return self.table[head, self.seq_k - 1 - relative]


class HeadScaling(eqx.Module):
    """score_mod: each query head's logits times its own (learned) factor."""

    scales: Float[Array, " heads"]

    def __call__(self, s, b, h, i, j):
        return s * self.scales[h].astype(s.dtype)


class PrefixLM(eqx.Module):
    """mask_mod: keys in the prefix, and causal (bottom-right) after it."""

    prefix: int = eqx.field(static=True)
    offset: int = eqx.field(static=True)  # seq_k - seq_q

    def __call__(self, b, h, i, j):
        return (j < self.prefix) | (j <= i + self.offset)


class Documents(eqx.Module):
    """mask_mod: a query attends to the keys of its own document (ids per batch element,
    `batch` being the flat batch index)."""

    q_docs: Int[Array, "batch seq_q"]
    kv_docs: Int[Array, "batch seq_k"]

    def __call__(self, b, h, i, j):
        return self.q_docs[b, i] == self.kv_docs[b, j]


class Dilated(eqx.Module):
    """mask_mod: every `dilation`-th key around the aligned position."""

    dilation: int = eqx.field(static=True)
    offset: int = eqx.field(static=True)

    def __call__(self, b, h, i, j):
        return (i + self.offset - j) % self.dilation == 0


class BlockSparse(eqx.Module):
    """mask_mod: a random pattern of `block x block` tiles."""

    tiles: Bool[Array, "tiles_q tiles_k"]
    block: int = eqx.field(static=True)

    def __call__(self, b, h, i, j):
        return self.tiles[i // self.block, j // self.block]
