"""The block plan (`_kernels.schedule`) and the block values `_semantics` evaluates
(`_core.operands.block`): the static flags are the positional mask summarised per block,
the visit tables list what the loops visit in their order, and a block of operands is
the slice of each."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from eqx_flash._core.config import KernelConfig
from eqx_flash._core.operands import Operands, add_block, block
from eqx_flash._core.options import Window
from eqx_flash._kernels.schedule import block_plan, static_flags
from eqx_flash._kernels.xla.loops import over_band
from eqx_flash._mods.block_mask import EMPTY, FULL, PARTIAL
from eqx_flash._semantics.masking import positional_mask

WINDOWS = [Window(), Window(None, 0), Window(3, 0), Window(5, 2), Window(None, 4),
           Window(7, None), Window(4, -2)]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("sizes", [(13, 21, 4, 6, 8), (20, 9, 7, 3, 0), (8, 30, 3, 8, -11)])
def test_static_flags_summarise_the_positional_mask(window, sizes):
    """Per block pair: EMPTY where the mask keeps no pair, FULL where it keeps every pair
    (and the block holds no key padding), PARTIAL otherwise — the mask on every pair."""
    seq_q, seq_k, block_q, block_k, offset = sizes
    num_q, num_k = -(-seq_q // block_q), -(-seq_k // block_k)
    i = np.arange(num_q * block_q)[:, None]
    j = np.arange(num_k * block_k)[None, :]
    mask = np.asarray(positional_mask(jnp.asarray(i), jnp.asarray(j), offset, seq_k, window))
    mask = mask & (i < seq_q)  # padded query rows are discarded, never counted
    real_rows = (i < seq_q) & np.ones_like(j, bool)
    expected = np.zeros((num_q, num_k), np.int8)
    for qb, kb in itertools.product(range(num_q), range(num_k)):
        rows = slice(qb * block_q, (qb + 1) * block_q)
        cols = slice(kb * block_k, (kb + 1) * block_k)
        kept, real = mask[rows, cols], real_rows[rows, cols]
        expected[qb, kb] = (EMPTY if not kept.any() else
                            FULL if kept[real].all() and (kb + 1) * block_k <= seq_k
                            else PARTIAL)
    np.testing.assert_array_equal(
        static_flags(seq_q, seq_k, block_q, block_k, window, offset), expected)


@pytest.mark.parametrize("window", WINDOWS)
def test_visit_tables_list_what_the_loops_visit_in_their_order(window):
    cfg = KernelConfig(seq_q=37, seq_k=45, block_q=8, block_k=8, window=window, scale=1.0)
    plan = block_plan(cfg)
    for by in ("q", "k"):
        visits, bands = plan.visits(by), plan.bands(by)
        flags = plan.oriented(by)
        width = bands.inner

        def step(carry, j, masked):  # record the visits in order
            order, kinds, n = carry
            kind = jnp.asarray(PARTIAL if masked else FULL, jnp.int8)
            return order.at[n].set(j), kinds.at[n].set(kind), n + 1

        for outer in range(len(visits.lengths)):
            init = (jnp.zeros(width, jnp.int32), jnp.zeros(width, jnp.int8), jnp.int32(0))
            order, kinds, n = over_band(bands, jnp.int32(outer), step, init)
            assert int(n) == visits.lengths[outer]
            np.testing.assert_array_equal(order[:n], visits.order[outer, :n])
            np.testing.assert_array_equal(kinds[:n], visits.flags[outer, :n])
            np.testing.assert_array_equal(flags[outer, visits.order[outer, :n]],
                                          visits.flags[outer, :n])
            assert np.all(visits.flags[outer, n:] == EMPTY)


def test_a_block_of_operands_is_the_slice_of_each_and_add_block_puts_it_back():
    rng = np.random.default_rng(0)
    bias = jnp.asarray(rng.standard_normal((2, 12, 10)), jnp.float32)
    key_mask = jnp.asarray(rng.random((1, 1, 10)) < 0.5)
    q_ids = jnp.asarray(rng.integers(0, 3, (1, 12, 1)), jnp.int32)
    slopes = jnp.asarray(rng.random((2, 1, 1)), jnp.float32)
    flags = jnp.zeros((1, 3, 2), jnp.int8)
    ops = Operands(bias=bias, key_mask=key_mask, q_segment_ids=q_ids, alibi_slopes=slopes,
                   block_flags=flags)
    blk = block(ops, 4, 5, 4, 5)
    np.testing.assert_array_equal(blk.bias, bias[:, 4:8, 5:10])
    np.testing.assert_array_equal(blk.key_mask, key_mask[:, :, 5:10])
    np.testing.assert_array_equal(blk.q_segment_ids, q_ids[:, 4:8])
    assert blk.alibi_slopes is slopes and blk.block_flags is flags  # broadcast / per block
    acc = Operands(bias=jnp.ones_like(bias), alibi_slopes=jnp.zeros_like(slopes))
    total = add_block(acc, Operands(bias=blk.bias, alibi_slopes=slopes), 4, 5)
    expected = np.ones(bias.shape, np.float32)
    expected[:, 4:8, 5:10] += np.asarray(bias[:, 4:8, 5:10])
    np.testing.assert_array_equal(total.bias, expected)
    np.testing.assert_array_equal(total.alibi_slopes, slopes)
