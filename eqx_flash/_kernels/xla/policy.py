"""How the pure-JAX kernels are configured for a call: block sizes, flash-decoding,
heads in parallel, the compute dtype (`configure`, the xla family's `Configure`).

Every choice reads the call (`contract.Call`) and the machine facts (`contract.Machine`)
that `dispatch.choose` hands over, never a global, so that all pieces of a call agree.
"""

import dataclasses

import jax.numpy as jnp

from ..._core.config import KernelConfig, choose_block, default_blocks
from ..._core.operands import Operands
from ..._core.shapes import Shapes, ceil_div
from ..contract import Call, Machine

# Flash-decoding (`split_k`): a call with at most this many queries against at least
# `SPLIT_K_MIN_BLOCKS` key blocks splits its key blocks into parallel runs.
SPLIT_K_MAX_Q = 16
SPLIT_K_MIN_BLOCKS = 2
SPLIT_K_MAX_SPLITS = 8
# Flash-decoding splits the key blocks into parallel runs (`split_k_config`): shorter key
# blocks keep several rounds per run at moderate cache lengths.
DECODE_BLOCK_K = 1024


def configure(call: Call, machine: Machine, split_k: bool) -> KernelConfig:
    """The configuration of `call` for the pure-JAX kernels: the tuned block sizes
    (`_core.config.default_blocks`; fine ones where `wants_fine_blocks`, and always off a
    single CPU device), split-K where it applies and `split_k` allows it (not with a
    `score_mod`/`mask_mod`, traced at the blocks chosen here), heads in parallel off a
    single CPU device, and the compute dtype."""
    options, shapes, ops = call.options, call.shapes, call.ops
    fine = wants_fine_blocks(ops, call.mask_mod is not None) or not machine.single_cpu_device
    tuned_q, tuned_k = default_blocks(options.window, shapes.groups, fine, shapes.seq_k)
    if machine.backend in ACCELERATORS:
        tuned_q, tuned_k = accelerator_blocks(shapes)
    if shapes.seq_q <= SPLIT_K_MAX_Q:
        tuned_k = min(tuned_k, DECODE_BLOCK_K)
    cfg = KernelConfig(
        seq_q=shapes.seq_q,
        seq_k=shapes.seq_k,
        block_q=choose_block(options.block_q, tuned_q, shapes.seq_q),
        block_k=choose_block(options.block_k, tuned_k, shapes.seq_k),
        window=options.window,
        scale=options.scale_for(shapes.dim),
        softcap=options.softcap,
        dropout_rate=options.dropout_rate,
        lengths=ops.has_lengths,
        positions=ops.has_positions,
        parallel_heads=heads_in_parallel(machine),
        compute_dtype=kernel_dtype(call.dtype, machine.backend),
    )
    if not split_k or call.score_mod is not None or call.mask_mod is not None:
        return cfg
    cfg = split_k_config(cfg)
    # Score terms run the regular forward (the split-K one adds none), at the blocks
    # evened out for it all the same.
    return dataclasses.replace(cfg, splits=1) if ops.has_score_terms else cfg


# On an accelerator every block step is one batched product over batch x heads
# (`heads_in_parallel`), and a step whose logits pass what stays on chip round-trips them
# through HBM: measured on a TPU v5e (bf16, 16 heads of dim 128, 16k tokens per batch;
# `benchmarks/tune_pallas.md`, "XLA kernels"), the fastest forward blocks held 64 MiB of
# float32 logits per step at every sequence length: 256 x 256 at seq 1024 (batch 16),
# 512 x 512 at 4096 (batch 4), 1024 x 1024 at 16384 (batch 1); the CPU defaults (1024 x
# 2048) ran 2.4-4.5x slower at 1024-4096. Measured on a TPU; the GPU default until a GPU
# is measured.
ACCELERATORS = ("tpu", "gpu")
ACCELERATOR_STEP_BYTES = 64 * 2**20
ACCELERATOR_BLOCKS = ((1024, 1024), (512, 1024), (512, 512), (256, 512), (256, 256),
                      (128, 256), (128, 128))


def accelerator_blocks(shapes: Shapes) -> tuple[int, int]:
    """The largest of `ACCELERATOR_BLOCKS` whose logits for every (batch, head) of the
    call fit `ACCELERATOR_STEP_BYTES` (a batch the caller `vmap`s is not seen here; its
    blocks are those of one example)."""
    rows = shapes.batch * shapes.heads  # a block step's query rows per query row of a block
    for block_q, block_k in ACCELERATOR_BLOCKS:
        if rows * block_q * block_k * 4 <= ACCELERATOR_STEP_BYTES:
            return block_q, block_k
    return ACCELERATOR_BLOCKS[-1]


def wants_fine_blocks(ops: Operands, mask_mod: bool) -> bool:
    """Whether a call's cost follows structure finer than its band: a `mask_mod` (or
    `block_mask`), a pair mask, segment ids, lengths and positions skip work block by
    block at run time, and a bias is read (and its cotangent summed) block by block.
    A key-padding mask alone does not: padding rarely empties a whole block."""
    return mask_mod or ops.has_lengths or ops.has_positions or any(x is not None for x in (
        ops.pair_mask, ops.q_segment_ids, ops.kv_segment_ids, ops.bias))


def heads_in_parallel(machine: Machine) -> bool:
    """Whether `heads.per_head` maps the heads with `vmap` rather than looping over them.

    With several devices the batch or heads axis may be sharded, and a loop over a sharded
    axis would make XLA gather it onto every device; `vmap` keeps the axes parallel so the
    SPMD partitioner can split them. On a GPU or TPU a loop would run each head's small
    block products one after another, leaving most of the chip idle; `vmap` makes each
    block step one batched product over every head (its tiles cost batch x kv_heads times
    the loop's memory, still independent of the sequence length). A single CPU device runs
    the loop, which measured fastest there (`benchmarks/tune_blocks.md`): each block
    product a 2-d GEMM on every core, which the large default blocks are tuned for.
    Several host devices share the cores with heads mapped by `vmap`, where the large
    blocks measured slower (Ulysses on 4 host devices, causal fwd+bwd: 1.12-1.15x);
    there, and on accelerators, the fine blocks are the defaults (`configure`).
    """
    return not machine.single_cpu_device


def kernel_dtype(dtype, backend: str) -> jnp.dtype:
    """The dtype the kernels compute in for inputs of `dtype` on `backend`.

    On CPU, bfloat16 and float16 run in float32: x86 and most ARM CPUs have no arithmetic
    in those types, so XLA would convert the operands of every block product anyway
    (measured 1.4x slower than float32 on AVX2; `benchmarks/interleaved.py`). Results are
    rounded to the input dtype at the end, so they are at least as accurate. Accelerators
    keep the input dtype, where low-precision matmuls are the fast ones.
    """
    dtype = jnp.dtype(dtype)
    low = dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return jnp.dtype(jnp.float32) if low and backend == "cpu" else dtype


def num_splits(cfg: KernelConfig) -> int:
    """How many parallel runs the key blocks of `cfg` are split into: `SPLIT_K_MAX_SPLITS` (at
    most one per key block) when `seq_q <= SPLIT_K_MAX_Q` and there are at least
    `SPLIT_K_MIN_BLOCKS` key blocks, else 1 (the regular forward)."""
    num_k = ceil_div(cfg.seq_k, cfg.block_k)
    if cfg.seq_q > SPLIT_K_MAX_Q or num_k < SPLIT_K_MIN_BLOCKS:
        return 1
    return min(SPLIT_K_MAX_SPLITS, num_k)


def split_k_config(cfg: KernelConfig) -> KernelConfig:
    """`cfg` with `splits` set (`num_splits`) and, when split, `block_k` evened out so
    that the key blocks fill whole rounds of `splits` blocks (at most `block_k` still)."""
    splits = num_splits(cfg)
    if splits == 1:
        return cfg
    rounds = ceil_div(cfg.seq_k, splits * cfg.block_k)
    block_k = ceil_div(cfg.seq_k, splits * rounds)
    return dataclasses.replace(cfg, splits=splits, block_k=block_k)
