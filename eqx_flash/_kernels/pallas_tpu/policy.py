"""The Pallas kernels' block sizes.

Measured on a TPU v5e (bf16, 16 heads of dim 128, 16k tokens per batch;
`benchmarks/tune_pallas.md`): without a band, 2048 query rows against 1024 keys computed
256 keys at a time ran fastest (forward 1.12x splash attention at its best block size at
seq 4096, forward+backward 1.31x); with a causal/window band, 1024 x 1024 (larger blocks
leave more of the masked triangle inside the diagonal blocks). The query heads of a kv
head share a block's rows, so `block_q` shrinks with them. Explicit sizes are honoured,
rounded up to the TPU's tiles (16 query rows, 128 keys), and every size is cut to the
sequence; with a `RelativeScoreMod`, query blocks are whole 128s. A `block_mask` built
at blocks that divide these is read coarsened; one built at other blocks of whole tiles
sets the blocks (`with_block_mask`).
"""

from ..._core.config import KernelConfig
from ..._mods.position_bias import RelativeScoreMod
from ..contract import Call
from ._relative import MULTIPLE as RELATIVE_TILE

ROWS, BLOCK_K = 2048, 1024
BANDED_ROWS, BANDED_BLOCK_K = 1024, 1024
ROW_TILE, KEY_TILE = 16, 128
MIN_BLOCK_Q = 128


def _up(n: int, tile: int) -> int:
    return -(-n // tile) * tile


def blocks(call: Call, cfg: KernelConfig) -> tuple[int, int]:
    """`(block_q, block_k)` for `call` (`cfg`: the xla family's configuration of it)."""
    options, shapes = call.options, call.shapes
    banded = not options.window.is_unbounded
    rows, block_k = (BANDED_ROWS, BANDED_BLOCK_K) if banded else (ROWS, BLOCK_K)
    block_q = _up(max(rows // shapes.groups, MIN_BLOCK_Q), ROW_TILE)
    if options.block_q is not None:
        block_q = _up(options.block_q, ROW_TILE)
    if options.block_k is not None:
        block_k = _up(options.block_k, KEY_TILE)
    del cfg
    chosen = (min(block_q, _up(shapes.seq_q, ROW_TILE)), min(block_k, _up(shapes.seq_k, KEY_TILE)))
    if isinstance(call.score_mod, RelativeScoreMod):
        # Its term is built on whole vregs (`_relative`): short queries pad up to one.
        chosen = (_up(chosen[0], RELATIVE_TILE), chosen[1])
    return with_block_mask(call, chosen) or chosen


def with_block_mask(call: Call, chosen: tuple[int, int]) -> tuple[int, int] | None:
    """The blocks for `call`'s `block_mask` (None without one, or where its blocks can be
    neither coarsened to `chosen` nor taken as they are)."""
    if call.block_mask is None:
        return None
    built_q, built_k = call.block_mask
    if chosen[0] % built_q == 0 and chosen[1] % built_k == 0:
        return chosen
    if built_q % ROW_TILE == 0 and built_k % KEY_TILE == 0:
        return built_q, built_k
    return None
