"""The kernel choice (`_kernels.dispatch`): made once per call, recorded in the
`KernelConfig`, and replayed by the derivative rules and the ring; a family may leave
pieces to the xla family; unknown or uncovering families are refused naming `kernels`."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, qkv

import eqx_flash
from eqx_flash._api.binder import bind
from eqx_flash._api.flash import call_of
from eqx_flash._kernels import dispatch
from eqx_flash._kernels.contract import KernelFamily, Machine

BLOCKS = dict(block_q=8, block_k=8)


def _call(**kwargs):
    q, k, v = qkv(0, (2, 4, 20, 8), (2, 2, 28, 8))
    return call_of(bind("flash_attention", q=q, k=k, v=v, **kwargs))


class _Spy:
    """A family whose forward is the xla one, counted, and which runs only calls without
    `causal`; every other piece is left to the xla family."""

    def __init__(self, monkeypatch):
        self.forwards = 0
        xla = dispatch.FAMILIES["xla"]

        def forward(cfg, *args):
            assert cfg.family == "spy"
            self.forwards += 1
            return xla.forward(cfg, *args)

        def covers(cfg, call):
            return "causal" if not cfg.window.is_unbounded else None

        monkeypatch.setitem(dispatch.FAMILIES, "spy", KernelFamily("spy", covers, forward))
        monkeypatch.setattr(dispatch, "default_order", lambda machine: ("spy", "xla"))
        jax.clear_caches()


def test_choose_records_the_family_and_the_machine_facts():
    cfg = dispatch.choose(_call(**BLOCKS))
    assert cfg.family == "xla"
    assert cfg.parallel_heads == (not dispatch.machine().single_cpu_device)
    assert (cfg.block_q, cfg.block_k) == (8, 8)
    assert dispatch.choose(_call(**BLOCKS), "xla") == cfg


def test_decoding_is_recorded_as_split_k():
    q, k, v = qkv(0, (1, 2, 1, 8), (1, 2, 3000, 8))
    call = call_of(bind("flash_attention", q=q, k=k, v=v))
    assert dispatch.choose(call).split_k
    assert not dispatch.choose(call, split_k=False).split_k
    with_bias = call_of(bind("flash_attention", q=q, k=k, v=v, bias=jnp.zeros((1, 3000))))
    cfg = dispatch.choose(with_bias)  # score terms: the regular forward, same blocks
    assert not cfg.split_k and cfg.block_k == dispatch.choose(call).block_k


@pytest.mark.parametrize("kernels", ["pallas", "", "XLA"])
def test_an_unknown_family_is_refused_naming_kernels(kernels):
    with pytest.raises(ValueError, match="kernels must be None or one of 'xla'"):
        dispatch.choose(_call(), kernels)


def test_a_requested_family_that_does_not_cover_the_call_raises(monkeypatch):
    _Spy(monkeypatch)
    assert dispatch.choose(_call(), "spy").family == "spy"
    with pytest.raises(NotImplementedError, match="kernels='spy' does not cover.*causal"):
        dispatch.choose(_call(causal=True), "spy")
    assert dispatch.choose(_call(causal=True)).family == "xla"  # None falls back


def test_family_of_pairs_missing_pieces_with_xla(monkeypatch):
    spy = _Spy(monkeypatch)
    kernels = dispatch.family_of(dataclasses.replace(dispatch.choose(_call()), family="spy"))
    xla = dispatch.FAMILIES["xla"]
    assert kernels.forward is dispatch.FAMILIES["spy"].forward
    assert (kernels.backward, kernels.tangent, kernels.split_k_forward) == (
        xla.backward, xla.tangent, xla.split_k_forward)
    del spy


def test_every_piece_of_a_call_runs_the_family_chosen_for_it(monkeypatch):
    """Values, gradients and tangents through a family with a forward of its own and
    xla's derivative kernels, on one device and on the ring: the family's forward runs,
    and the results are xla's."""
    q, k, v = qkv(1, (2, 4, 20, 8), (2, 2, 28, 8))

    def results(fn):  # one compiled program (traced anew each call, so the spy sees it)
        def all_of_them():
            value = fn(q, k, v)
            grads = jax.grad(lambda *a: jnp.sum(fn(*a)[0] ** 2), argnums=(0, 1, 2))(q, k, v)
            tangent = jax.jvp(lambda q: fn(q, k, v)[0], (q,), (jnp.ones_like(q),))[1]
            return value, grads, tangent

        return jax.jit(all_of_them)()

    def flash(q, k, v):
        return eqx_flash.flash_attention(q, k, v, **BLOCKS)

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("seq",))
    spec = jax.sharding.PartitionSpec(None, None, "seq")
    ring = jax.shard_map(
        lambda q, k, v: eqx_flash.ring_flash_attention(q, k, v, axis_name="seq", **BLOCKS),
        mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, spec))
    expected = [results(flash), results(ring)]
    spy = _Spy(monkeypatch)
    for fn, want in zip((flash, ring), expected, strict=True):
        before = spy.forwards
        got = results(fn)
        assert spy.forwards > before
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert_close(a, b)
    causal = spy.forwards
    eqx_flash.flash_attention(q, k, v, causal=True, **BLOCKS)  # not covered: xla's
    assert spy.forwards == causal


def test_the_default_order_puts_the_pallas_kernels_first_on_one_tpu_only():
    order = dispatch.default_order
    assert order(Machine("tpu", 1)) == ("pallas_tpu", "xla")
    assert order(Machine("tpu", 4)) == ("xla",)  # meshes: the partitioner's kernels
    assert order(Machine("cpu", 1)) == order(Machine("gpu", 1)) == ("xla",)


def test_second_order_hands_mosaic_kernels_to_the_xla_family():
    cfg = dispatch.choose(_call(**BLOCKS), "pallas_tpu")
    assert cfg.family == "pallas_tpu"
    assert dispatch.differentiable(cfg) == dataclasses.replace(cfg, family="xla")
    xla = dispatch.choose(_call(**BLOCKS), "xla")
    assert dispatch.differentiable(xla) is xla


def test_none_passes_over_what_a_family_leaves_to_the_xla_kernels(monkeypatch):
    """Where the Pallas kernels come first (one TPU, simulated here), `kernels=None`
    takes them for a `mask_mod` (its block summary drives their plan), a bias, an
    `attn_mask` and a `score_mod`; what a family covers but passes over
    (`KernelFamily.passes_over`, a family's own choice) goes to the pure-JAX kernels
    with the reason said, and asked for by name, the family runs it."""
    monkeypatch.setattr(dispatch, "default_order", lambda machine: ("pallas_tpu", "xla"))

    def window(b, h, i, j):
        return (j <= i) & (i - j < 8)

    windowed = _call(mask_mod=window)
    assert dispatch.choose(_call()).family == "pallas_tpu"
    assert dispatch.choose(windowed).family == "pallas_tpu"
    for extra in (dict(bias=jnp.zeros((20, 28))), dict(attn_mask=jnp.ones((20, 28), bool)),
                  dict(score_mod=lambda s, b, h, i, j: s - 0.1 * (i - j).astype(s.dtype))):
        assert dispatch.choose(_call(**extra)).family == "pallas_tpu", extra
    pallas = dispatch.FAMILIES["pallas_tpu"]
    monkeypatch.setitem(dispatch.FAMILIES, "pallas_tpu", pallas._replace(
        passes_over=lambda call: "a mask_mod" if call.mask_mod is not None else None))
    assert dispatch.choose(_call()).family == "pallas_tpu"
    assert dispatch.choose(windowed).family == "xla"
    assert dispatch.choose(windowed, "pallas_tpu").family == "pallas_tpu"
    family, reason = dispatch.why(windowed)
    assert family == "xla" and "mask_mod" in reason and "kernels='pallas_tpu'" in reason
