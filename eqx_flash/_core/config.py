"""The static configuration of one kernel call: what may attend, and how it is blocked.

`kernel_config` resolves the validated `AttentionOptions` against the problem's sizes
(default scale, tuned block sizes); kernels read only the `KernelConfig`.
"""

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from .operands import Operands
from .options import AttentionOptions, Window
from .shapes import Shapes

# Tuned on a 2-core x86-64 CPU: benchmarks/tune_blocks.py, result in benchmarks/tune_blocks.md.
# Large blocks run XLA's CPU GEMM nearer its peak: at seq 4096 the block products alone run
# at 0.86 of the 2048^3 matmul rate with 1024 x 2048 blocks against 0.69 with 512 x 1024,
# and the softmax's elementwise passes cost about the same per logit either way. The
# backward prefers long key blocks too (a key block's dk/dv stay in its loop's carry).
# With a causal/window band, 1024 x 1024 leaves less of the masked triangle inside the
# diagonal blocks than 1024 x 2048 and beats the smaller 512 x 512 on GEMM rate.
DEFAULT_BLOCKS = (1024, 2048)
DEFAULT_BLOCKS_BANDED = (1024, 1024)
# Flash-decoding splits the key blocks into parallel runs (`split_k_config`): shorter key
# blocks keep several rounds per run at moderate cache lengths.
DECODE_BLOCK_K = 1024
# Calls whose work follows a finer structure than the band keep finer blocks
# (`wants_fine_blocks`): at seq 4096, 512-token documents by segment ids ran 1.6x slower
# and a trained full bias 1.4x slower with the large blocks (`benchmarks/ab.py`).
FINE_BLOCKS = (512, 1024)
FINE_BLOCKS_BANDED = (512, 512)
# With fewer large key blocks than this, a band leaves too much of its masked triangle
# inside the diagonal blocks: causal fwd+bwd with the fine banded blocks took 0.74x the
# time at seq 1024 and 0.93x at 2048, and tied at 3072 (`benchmarks/tune_blocks.md`).
BANDED_MIN_BLOCKS = 3


def wants_fine_blocks(ops: Operands, mask_mod: bool) -> bool:
    """Whether a call's cost follows structure finer than its band: a `mask_mod` (or
    `block_mask`), a pair mask, segment ids, lengths and positions skip work block by
    block at run time, and a bias is read (and its cotangent summed) block by block.
    A key-padding mask alone does not: padding rarely empties a whole block."""
    return mask_mod or ops.has_lengths or ops.has_positions or any(x is not None for x in (
        ops.pair_mask, ops.q_segment_ids, ops.kv_segment_ids, ops.bias))


def single_cpu_device() -> bool:
    """Whether JAX runs on one CPU device: the kernels then loop over heads, each block
    product a 2-d GEMM on every core (`_kernels.xla.heads.heads_in_parallel`), which the large
    default blocks are tuned for. Several host devices share the cores with heads mapped
    by `vmap`, where the large blocks measured slower (Ulysses on 4 host devices, causal
    fwd+bwd: 1.12-1.15x); there, and on accelerators, the fine blocks are the defaults."""
    return jax.device_count() == 1 and jax.default_backend() == "cpu"


def default_blocks(window: Window, groups: int = 1, fine: bool = False,
                   seq_k: int | None = None) -> tuple[int, int]:
    """Tuned default `(block_q, block_k)` for a call with this causal/window band
    (`fine`: `wants_fine_blocks`; always fine off a `single_cpu_device`), against `seq_k`
    keys if known: a band over fewer than `BANDED_MIN_BLOCKS` large key blocks takes the
    fine ones.

    The kernels fold a kv head's `groups` query heads into the rows of one block, so the
    logit block is `(groups * block_q, block_k)`: `block_q` shrinks with `groups` to keep
    it the tuned size (at least 64 rows per head).
    """
    fine = fine or not single_cpu_device()
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
    # results are merged by their lse (`_kernels.xla.split_k`); 1 is the regular forward.
    splits: int = 1
    # The static parts of `score_mod`/`mask_mod` (a hashable `_mods.tracing.Mods`); None
    # without them.
    mods: Any = None
    # With global indices among the operands (`Operands.q_index`, ring attention): the
    # global `seq_k - seq_q` that ALiBi aligns them with.
    alibi_offset: int | None = None

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
        return (-(-self.seq_q // self.block_q) * self.block_q,
                -(-self.seq_k // self.block_k) * self.block_k)

    @property
    def band_window(self) -> Window:
        """The window the static schedule and the positional mask use."""
        return Window(None, None) if self.lengths or self.positions else self.window


def kernel_config(options: AttentionOptions, shapes: Shapes, fine: bool = False
                  ) -> KernelConfig:
    """The kernels' configuration for `options` on a problem of `shapes` (block sizes
    default to the tuned `default_blocks`; `fine`: `wants_fine_blocks`)."""
    tuned_q, tuned_k = default_blocks(options.window, shapes.groups, fine, shapes.seq_k)
    if shapes.seq_q <= SPLIT_K_MAX_Q:
        tuned_k = min(tuned_k, DECODE_BLOCK_K)
    return KernelConfig(
        seq_q=shapes.seq_q,
        seq_k=shapes.seq_k,
        block_q=choose_block(options.block_q, tuned_q, shapes.seq_q),
        block_k=choose_block(options.block_k, tuned_k, shapes.seq_k),
        window=options.window,
        scale=options.scale_for(shapes.dim),
        softcap=options.softcap,
        dropout_rate=options.dropout_rate,
    )


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


def kernel_dtype(dtype) -> jnp.dtype:
    """The dtype the kernels compute in for inputs of `dtype`.

    On CPU, bfloat16 and float16 run in float32: x86 and most ARM CPUs have no arithmetic
    in those types, so XLA would convert the operands of every block product anyway
    (measured 1.4x slower than float32 on AVX2; `benchmarks/interleaved.py`). Results are
    rounded to the input dtype at the end, so they are at least as accurate. Accelerators
    keep the input dtype, where low-precision matmuls are the fast ones.
    """
    dtype = jnp.dtype(dtype)
    low = dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return jnp.dtype(jnp.float32) if low and jax.default_backend() == "cpu" else dtype


def stat_dtype(dtype) -> jnp.dtype:
    """Dtype of softmax statistics and accumulators: float64 for float64, else float32.

    (Written out rather than `promote_types(dtype, float32)`, which strict dtype
    promotion rejects for bfloat16/float16.)
    """
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


# Flash-decoding (`_kernels.xla.split_k`): a call with at most this many queries against at least
# `SPLIT_K_MIN_BLOCKS` key blocks splits its key blocks into parallel runs.
SPLIT_K_MAX_Q = 16
SPLIT_K_MIN_BLOCKS = 2
SPLIT_K_MAX_SPLITS = 8


def num_splits(cfg: KernelConfig) -> int:
    """How many parallel runs the key blocks of `cfg` are split into: `SPLIT_K_MAX_SPLITS` (at
    most one per key block) when `seq_q <= SPLIT_K_MAX_Q` and there are at least
    `SPLIT_K_MIN_BLOCKS` key blocks, else 1 (the regular forward)."""
    num_k = -(-cfg.seq_k // cfg.block_k)
    if cfg.seq_q > SPLIT_K_MAX_Q or num_k < SPLIT_K_MIN_BLOCKS:
        return 1
    return min(SPLIT_K_MAX_SPLITS, num_k)


def split_k_config(cfg: KernelConfig) -> KernelConfig:
    """`cfg` with `splits` set (`num_splits`) and, when split, `block_k` evened out so
    that the key blocks fill whole rounds of `splits` blocks (at most `block_k` still)."""
    splits = num_splits(cfg)
    if splits == 1:
        return cfg
    rounds = -(-cfg.seq_k // (splits * cfg.block_k))
    block_k = -(-cfg.seq_k // (splits * rounds))
    return dataclasses.replace(cfg, splits=splits, block_k=block_k)
