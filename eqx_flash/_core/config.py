"""The static configuration of one kernel call: what may attend, and how it is blocked.

`_kernels.dispatch.choose` resolves the validated `AttentionOptions` against the
problem's sizes (default scale, tuned block sizes) and the machine, and records the
result, the kernel family it chose included, in a `KernelConfig`; kernels read only that.
The tuned block sizes of the pure-JAX kernels are here (`default_blocks`), where
`_mods.block_mask` reads them too.
"""

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from .options import Window
from .shapes import ceil_div

# Tuned on a 2-core x86-64 CPU: benchmarks/tune_blocks.py, result in benchmarks/tune_blocks.md.
# Large blocks run XLA's CPU GEMM nearer its peak: at seq 4096 the block products alone run
# at 0.86 of the 2048^3 matmul rate with 1024 x 2048 blocks against 0.69 with 512 x 1024,
# and the softmax's elementwise passes cost about the same per logit either way. The
# backward prefers long key blocks too (a key block's dk/dv stay in its loop's carry).
# With a causal/window band, 1024 x 1024 leaves less of the masked triangle inside the
# diagonal blocks than 1024 x 2048 and beats the smaller 512 x 512 on GEMM rate.
DEFAULT_BLOCKS = (1024, 2048)
DEFAULT_BLOCKS_BANDED = (1024, 1024)
# Calls whose work follows a finer structure than the band keep finer blocks
# (`_kernels.xla.policy.wants_fine_blocks`): at seq 4096, 512-token documents by segment
# ids ran 1.6x slower and a trained full bias 1.4x slower with the large blocks
# (`benchmarks/ab.py`).
FINE_BLOCKS = (512, 1024)
FINE_BLOCKS_BANDED = (512, 512)
# With fewer large key blocks than this, a band leaves too much of its masked triangle
# inside the diagonal blocks: causal fwd+bwd with the fine banded blocks took 0.74x the
# time at seq 1024 and 0.93x at 2048, and tied at 3072 (`benchmarks/tune_blocks.md`).
BANDED_MIN_BLOCKS = 3


def default_blocks(window: Window, groups: int = 1, fine: bool = False,
                   seq_k: int | None = None) -> tuple[int, int]:
    """Tuned default `(block_q, block_k)` for a call with this causal/window band
    (`fine`: the finer blocks, `_kernels.xla.policy.configure`), against `seq_k` keys if
    known: a band over fewer than `BANDED_MIN_BLOCKS` large key blocks takes the fine
    ones.

    The kernels fold a kv head's `groups` query heads into the rows of one block, so the
    logit block is `(groups * block_q, block_k)`: `block_q` shrinks with `groups` to keep
    it the tuned size (at least 64 rows per head).
    """
    if window.is_unbounded:
        block_q, block_k = FINE_BLOCKS if fine else DEFAULT_BLOCKS
    else:
        short = seq_k is not None and seq_k < BANDED_MIN_BLOCKS * DEFAULT_BLOCKS_BANDED[1]
        block_q, block_k = FINE_BLOCKS_BANDED if fine or short else DEFAULT_BLOCKS_BANDED
    return max(block_q // groups, 64), block_k


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Everything static about one kernel call, resolved; hashable, so it can be the
    static argument of the derivative rules (`_autodiff`) and a `jax.jit` static
    argument. `seq_q`/`seq_k` are the true (unpadded) lengths.

    Query row `i` sits at aligned position `p = i + diagonal_offset` (the window is around
    `p`); it is `seq_k - seq_q` (bottom-right) unless a caller such as the ring kernel
    places a chunk of queries against a chunk of keys elsewhere in the sequence.
    """

    seq_q: int
    seq_k: int
    block_q: int
    block_k: int
    window: Window
    scale: float
    softcap: float | None = None
    dropout_rate: float = 0.0
    diagonal_offset: int | None = None  # None: seq_k - seq_q
    # Variable lengths given: the window aligns on them at run time
    # (`_semantics.masking.length_mask`), so the static band (`band_window`) is unbounded
    # and run-time limits narrow it.
    lengths: bool = False
    # Positions given (`Operands.q_positions`): causal and the window are measured on them
    # at run time (`_semantics.masking.position_mask`), so the static band is unbounded
    # and run-time limits (`_kernels.schedule.position_limits`) narrow it.
    positions: bool = False
    # Flash-decoding: > 1 splits the key blocks into this many parallel runs whose partial
    # results are merged by their lse (`_kernels.xla.split_k`); 1 is the regular forward
    # (`split_k`).
    splits: int = 1
    # The static parts of `score_mod`/`mask_mod` (a hashable `_mods.tracing.Mods`); None
    # without them.
    mods: Any = None
    # With global indices among the operands (`Operands.q_index`, ring attention): the
    # global `seq_k - seq_q` that ALiBi aligns them with.
    alibi_offset: int | None = None
    # The kernel family that runs the call (`_kernels.dispatch.FAMILIES`), chosen once
    # by `_kernels.dispatch.choose`: the derivative rules and the ring replay it.
    family: str = "xla"
    # Whether the pure-JAX kernels map (batch, kv head) with `vmap` rather than loop over
    # them (`_kernels.xla.policy.heads_in_parallel`, a fact of the machine).
    parallel_heads: bool = False
    # The dtype q, k, v are cast to for the kernels (`_kernels.xla.policy.kernel_dtype`);
    # None: the inputs' own.
    compute_dtype: Any = None
    # A `mask_mod`'s block summary where it is known when traced and the family plans its
    # grid by it then (`_mods.block_mask.KnownSummary`); None otherwise.
    block_summary: Any = None

    @property
    def split_k(self) -> bool:
        """Whether the forward is the split-K (flash-decoding) kernel."""
        return self.splits > 1

    @property
    def offset(self) -> int:
        return self.seq_k - self.seq_q if self.diagonal_offset is None else self.diagonal_offset

    @property
    def score_offset(self) -> int:
        """The offset ALiBi aligns positions with (`_semantics.score_terms.alibi_distance`)."""
        return self.offset if self.alibi_offset is None else self.alibi_offset

    @property
    def padded_seq(self) -> tuple[int, int]:
        """`(seq_q, seq_k)` rounded up to whole blocks: the kernels' array lengths."""
        return (ceil_div(self.seq_q, self.block_q) * self.block_q,
                ceil_div(self.seq_k, self.block_k) * self.block_k)

    @property
    def band_window(self) -> Window:
        """The window the static schedule and the positional mask use."""
        return Window(None, None) if self.lengths or self.positions else self.window


def choose_block(requested: int | None, default: int, seq: int) -> int:
    """Block size along one sequence axis.

    An explicit request is honoured (clipped to the sequence, padding the last block).
    The default is balanced: the fewest blocks of at most `default`, sized evenly, so a
    length like 1500 runs as 3 blocks of 500 with no padding at all.
    """
    if requested is not None:
        return min(requested, seq)
    num_blocks = math.ceil(seq / default)
    return math.ceil(seq / num_blocks)


def stat_dtype(dtype) -> jnp.dtype:
    """Dtype of softmax statistics and accumulators: float64 for float64, else float32.

    (Written out rather than `promote_types(dtype, float32)`, which strict dtype
    promotion rejects for bfloat16/float16.)
    """
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)
