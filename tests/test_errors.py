"""Every bad input raises TypeError/ValueError naming the argument, eagerly and under jit.

Each case runs twice: with jaxtyping's runtime checks on (the default; shape mismatches
between arguments are then caught by axis name) and switched off with
`jaxtyping.config.update("jaxtyping_disable", True)`, where the explicit checks in
`eqx_flash._api.binder` must still catch every case on their own.
"""

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jaxtyping
import pytest
from helpers import normal, qkv

import eqx_flash

B, H, KH, SQ, SK, D, DV = 2, 4, 2, 8, 12, 16, 8

KEY = jax.random.key(0)


def _good() -> dict[str, Any]:
    """A valid call: GQA, a key-padding mask, segment ids, dropout with a key."""
    q, k, v = qkv(0, (B, H, SQ, D), (B, KH, SK, D), dim_v=DV)
    return dict(
        q=q,
        k=k,
        v=v,
        mask=jnp.ones((B, SK), bool),
        attn_mask=jnp.ones((SQ, SK), bool),
        q_segment_ids=jnp.zeros((B, SQ), jnp.int32),
        kv_segment_ids=jnp.zeros((B, SK), jnp.int32),
        dropout_rate=0.1,
        key=jax.random.key(0),
    )


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    change: dict[str, Any]  # replaces entries of `_good()`; the value `None` removes one
    argument: str  # the message must name this argument
    checked: type[Exception]  # expected with jaxtyping's checks on
    unchecked: type[Exception]  # expected with them off: the explicit checks alone
    blocks: bool = False  # only flash_attention takes block sizes

    def kwargs(self) -> dict[str, Any]:
        kwargs = _good()
        for name, value in self.change.items():
            if value is None:
                kwargs.pop(name)
            else:
                kwargs[name] = value
        return kwargs


T, V = TypeError, ValueError
CASES = [
    # q, k, v: dtypes
    Case("q-int", {"q": jnp.ones((B, H, SQ, D), jnp.int32)}, "q", T, T),
    Case("k-int", {"k": jnp.ones((B, KH, SK, D), jnp.int32)}, "k", T, T),
    Case("v-bool", {"v": jnp.ones((B, KH, SK, DV), bool)}, "v", T, T),
    Case("k-other-float", {"k": normal(KEY, (B, KH, SK, D), jnp.bfloat16)}, "k", T, T),
    Case("v-other-float", {"v": normal(KEY, (B, KH, SK, DV), jnp.float16)}, "v", T, T),
    # q, k, v: shapes
    Case("head-dim", {"k": normal(KEY, (B, KH, SK, D + 1))}, "k", T, V),
    Case("kv-seq", {"v": normal(KEY, (B, KH, SK + 1, DV))}, "v", T, V),
    Case("kv-heads-divide", {"k": normal(KEY, (B, 3, SK, D)), "v": normal(KEY, (B, 3, SK, DV))},
         "k", V, V),
    Case("kv-heads-differ", {"v": normal(KEY, (B, 1, SK, DV))}, "v", T, V),
    Case("batch", {"k": normal(KEY, (3, KH, SK, D)), "v": normal(KEY, (3, KH, SK, DV))}, "k", T, V),
    Case("ndim", {"q": normal(KEY, (SQ, D))}, "q", V, V),
    Case("q-1d", {"q": normal(KEY, (D,))}, "q", T, V),
    Case("empty-seq", {"q": normal(KEY, (B, H, 0, D)), "attn_mask": None, "q_segment_ids": None,
                       "kv_segment_ids": None}, "q", V, V),
    # masks and segment ids
    Case("mask-seq", {"mask": jnp.ones((B, SK + 1), bool)}, "mask", T, V),
    Case("mask-batch", {"mask": jnp.ones((3, SK), bool)}, "mask", V, V),
    Case("mask-float", {"mask": jnp.ones((B, SK), jnp.float32)}, "mask", T, T),
    Case("attn-mask-shape", {"attn_mask": jnp.ones((SQ + 1, SK), bool)}, "attn_mask", T, V),
    Case("attn-mask-float", {"attn_mask": jnp.ones((SQ, SK))}, "attn_mask", T, T),
    Case("attn-mask-1d", {"attn_mask": jnp.ones((SK,), bool)}, "attn_mask", T, V),
    Case("q-ids-shape", {"q_segment_ids": jnp.zeros((B, SQ + 1), jnp.int32)},
         "q_segment_ids", T, V),
    Case("kv-ids-float", {"kv_segment_ids": jnp.zeros((B, SK))}, "kv_segment_ids", T, T),
    Case("q-ids-bool", {"q_segment_ids": jnp.zeros((B, SQ), bool)}, "q_segment_ids", T, T),
    Case("only-q-ids", {"kv_segment_ids": None}, "kv_segment_ids", V, V),
    Case("only-kv-ids", {"q_segment_ids": None}, "q_segment_ids", V, V),
    # static options
    Case("block-q-zero", {"block_q": 0}, "block_q", V, V, blocks=True),
    Case("block-k-negative", {"block_k": -4}, "block_k", V, V, blocks=True),
    Case("block-q-float", {"block_q": 2.5}, "block_q", T, T, blocks=True),
    Case("block-k-bool", {"block_k": True}, "block_k", T, T, blocks=True),
    Case("window-negative", {"window": -1}, "window", V, V),
    Case("window-right-negative", {"window": (2, -1)}, "window", V, V),
    Case("window-triple", {"window": (1, 2, 3)}, "window", T, T),
    Case("window-float", {"window": 2.0}, "window", T, T),
    Case("softcap-zero", {"softcap": 0.0}, "softcap", V, V),
    Case("softcap-negative", {"softcap": -1}, "softcap", V, V),
    Case("softcap-inf", {"softcap": float("inf")}, "softcap", V, V),
    Case("scale-nan", {"scale": float("nan")}, "scale", V, V),
    Case("scale-inf", {"scale": float("-inf")}, "scale", V, V),
    Case("scale-str", {"scale": "0.5"}, "scale", T, T),
    Case("causal-str", {"causal": "yes"}, "causal", T, T),
    # dropout
    Case("dropout-one", {"dropout_rate": 1.0}, "dropout_rate", V, V),
    Case("dropout-negative", {"dropout_rate": -0.1}, "dropout_rate", V, V),
    Case("dropout-nan", {"dropout_rate": float("nan")}, "dropout_rate", V, V),
    Case("dropout-no-key", {"key": None}, "key", V, V),
    Case("dropout-float-key", {"key": jnp.zeros((2,))}, "key", T, T),
    Case("dropout-batched-key", {"key": jax.random.split(jax.random.key(0), 2)}, "key", T, V),
]

FUNCTIONS: dict[str, Callable[..., Any]] = {
    "flash_attention": eqx_flash.flash_attention,
    "plain_attention": eqx_flash.plain_attention,
}


@pytest.fixture(params=["checked", "unchecked"])
def checks(request):
    """Run with jaxtyping's runtime checks on, then with them switched off."""
    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", request.param == "unchecked")
    yield request.param
    jaxtyping.config.update("jaxtyping_disable", before)


def _assert_names(error: pytest.ExceptionInfo, argument: str) -> None:
    message = str(error.value)
    if isinstance(error.value, jaxtyping.TypeCheckError):
        # jaxtyping names the parameter and shows the annotation and the actual value.
        assert f"parameter '{argument}'" in message, message
        assert "Actual value" in message and "Expected type" in message, message
    else:
        # Our own messages name the argument (`k.shape=...`, `block_q=0`) and say "got".
        assert re.search(rf"(?<![\w.]){re.escape(argument)}(?!\w)", message), message
        assert "got" in message, message


def _expected(case: Case, checks: str) -> type[Exception]:
    return case.checked if checks == "checked" else case.unchecked


EAGER = [
    pytest.param(name, case, id=f"{name}-{case.id}")
    for name in FUNCTIONS
    for case in CASES
    if not (case.blocks and name == "plain_attention")
]


@pytest.mark.parametrize("name, case", EAGER)
def test_eager(name: str, case: Case, checks: str):
    with pytest.raises(_expected(case, checks)) as error:
        FUNCTIONS[name](**case.kwargs())
    _assert_names(error, case.argument)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_under_jit(case: Case, checks: str):
    """Arrays are traced arguments: the error must come while tracing, not as a NaN."""
    kwargs = case.kwargs()
    arrays = {n: x for n, x in kwargs.items() if isinstance(x, jax.Array)}
    static = {n: x for n, x in kwargs.items() if n not in arrays}
    call = jax.jit(lambda arrays: eqx_flash.flash_attention(**arrays, **static))
    with pytest.raises(_expected(case, checks)) as error:
        call(arrays)
    _assert_names(error, case.argument)


@pytest.mark.parametrize("argument", ["scale", "softcap", "dropout_rate"])
def test_traced_scalar(argument: str, checks: str):
    """Scalars fix the compiled program, so a traced one is a clear error, not a crash."""
    good = _good()

    @jax.jit
    def call(value):
        return eqx_flash.flash_attention(good["q"], good["k"], good["v"], **{argument: value},
                                         key=good["key"])

    with pytest.raises(TypeError) as error:
        call(jnp.float32(0.5))
    _assert_names(error, argument)


def test_the_good_call_works(checks: str):
    """The baseline every case perturbs is valid, so each error is due to its change."""
    for name, fn in FUNCTIONS.items():
        out, lse = fn(**_good())
        assert out.shape == (B, H, SQ, DV), name
        assert lse.shape == (B, H, SQ), name
        assert bool(jnp.all(jnp.isfinite(out))), name


def test_causal_flash_attention_rejects_causal():
    good = _good()
    with pytest.raises(TypeError) as error:
        eqx_flash.causal_flash_attention(good["q"], good["k"], good["v"], causal=False)
    _assert_names(error, "causal")
