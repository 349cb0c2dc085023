"""One bad option, one error: every entry point rejects the same bad value with the same
exception type and the same message, before any tracing.

The rule: `TypeError` for a value of the wrong type (a string, a bool where a number or an
int is expected, a float where an int is expected, a tuple of the wrong length), and
`ValueError` for a value of the right type out of range (negative, zero where a positive
value is required, not finite). The message names the argument and shows the value, and it
is the one `flash_attention` gives, word for word.
"""

import os
import traceback
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, assert_lse_close, qkv
from jax.sharding import Mesh, PartitionSpec

import eqx_flash

Q, K, V = qkv(jax.random.key(0), (1, 2, 8, 8), (1, 2, 8, 8))
MESH = Mesh(np.array(jax.devices()[:1]), ("seq",))
SEQ = PartitionSpec(None, None, "seq")

ALL = frozenset({"causal", "window", "scale", "softcap", "block_q", "block_k"})

# (option, bad value, the exception the rule asks for)
BAD: list[tuple[str, Any, type[Exception]]] = [
    ("softcap", "x", TypeError),
    ("softcap", 0, ValueError),
    ("softcap", -1.0, ValueError),
    ("softcap", float("nan"), ValueError),
    ("scale", "x", TypeError),
    ("scale", float("inf"), ValueError),
    ("window", (-1, 0), ValueError),
    ("window", "a", TypeError),
    ("window", (1, 2, 3), TypeError),
    ("window", (1.5, 2), TypeError),
    ("causal", "yes", TypeError),
    ("block_q", 0, ValueError),
    ("block_q", 1.5, TypeError),
    ("block_k", True, TypeError),
    ("block_k", -3, ValueError),
]


def _ring(**options: Any):
    """`ring_flash_attention` the way it is meant to be called: inside `jax.shard_map`."""

    def local(q, k, v):
        return eqx_flash.ring_flash_attention(q, k, v, axis_name="seq", **options)

    mapped = jax.shard_map(local, mesh=MESH, in_specs=(SEQ, SEQ, SEQ),
                           out_specs=(SEQ, SEQ), check_vma=False)
    return mapped(Q, K, V)


# name -> (call with the options, the options it takes)
ENTRY_POINTS: dict[str, tuple[Callable[..., Any], frozenset[str]]] = {
    "flash_attention": (lambda **o: eqx_flash.flash_attention(Q, K, V, **o), ALL),
    "causal_flash_attention": (
        lambda **o: eqx_flash.causal_flash_attention(Q, K, V, **o), ALL - {"causal"}
    ),
    "plain_attention": (
        lambda **o: eqx_flash.plain_attention(Q, K, V, **o), ALL - {"block_q", "block_k"}
    ),
    "cosine_sim_flash_attention": (
        lambda **o: eqx_flash.cosine_sim_flash_attention(Q, K, V, **o), ALL
    ),
    "FlashAttention": (lambda **o: eqx_flash.FlashAttention(**o), ALL),
    "FlashMultiheadAttention": (
        lambda **o: eqx_flash.FlashMultiheadAttention(2, 8, key=jax.random.key(0), **o),
        ALL - {"scale"},
    ),
    "ring_flash_attention": (_ring, ALL),
    "sharded_flash_attention": (
        lambda **o: eqx_flash.sharded_flash_attention(Q, K, V, mesh=MESH, seq_axis="seq", **o),
        ALL,
    ),
}


def _error(call: Callable[..., Any], **options: Any) -> Exception:
    try:
        call(**options)
    except Exception as error:  # noqa: BLE001 - the test inspects whatever was raised
        return error
    raise AssertionError(f"no error for {options}")


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


CASES = [
    pytest.param(entry, option, value, expected, id=f"{entry}-{option}={value!r}")
    for entry, (_, takes) in ENTRY_POINTS.items()
    for option, value, expected in BAD
    if option in takes
]


@pytest.mark.parametrize("entry, option, value, expected", CASES)
def test_same_error_everywhere(entry: str, option: str, value: Any, expected: type[Exception]):
    reference = _error(ENTRY_POINTS["flash_attention"][0], **{option: value})
    assert isinstance(reference, expected), (
        f"flash_attention({option}={value!r}) raised {_describe(reference)}; "
        f"expected {expected.__name__}"
    )
    message = str(reference)
    assert option in message, f"the message does not name {option!r}: {message}"
    assert repr(value) in message, f"the message does not show {value!r}: {message}"

    error = _error(ENTRY_POINTS[entry][0], **{option: value})
    assert type(error) is type(reference), (
        f"{entry}: {_describe(error)}\nflash_attention: {_describe(reference)}"
    )
    assert str(error) == message, (
        f"{entry}: {_describe(error)}\nflash_attention: {_describe(reference)}"
    )


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_good_options_pass(entry: str):
    """The baseline the cases perturb is valid, so each error is due to the bad value."""
    call, takes = ENTRY_POINTS[entry]
    good = dict(causal=True, window=(3, 0), scale=0.5, softcap=5.0, block_q=8, block_k=8)
    given = {n: x for n, x in good.items() if n in takes}
    result = call(**given)
    # What the options mean, for the reference (causal_flash_attention is causal itself).
    meaning = {"causal": True, **{n: x for n, x in given.items() if n not in ("block_q",
                                                                           "block_k")}}
    if isinstance(result, eqx.Module):
        assert {n: getattr(result, n) for n in given} == given
        if isinstance(result, eqx_flash.FlashAttention):
            assert_close(result(Q[0], K[0], V[0]),
                         eqx_flash.plain_attention(Q[0], K[0], V[0], **meaning)[0])
        return
    q, k = Q, K
    if entry == "cosine_sim_flash_attention":
        q, k = (x / jnp.linalg.norm(x, axis=-1, keepdims=True) for x in (Q, K))
    out, lse = result
    expected_out, expected_lse = eqx_flash.plain_attention(q, k, V, **meaning)
    assert_close(out, expected_out)
    assert_lse_close(lse, expected_lse)


@pytest.fixture
def unfiltered_tracebacks():
    before = jax.config.jax_traceback_filtering
    jax.config.update("jax_traceback_filtering", "off")
    yield
    jax.config.update("jax_traceback_filtering", before)


def _jax_frames(error: Exception) -> list[str]:
    internal = os.sep + os.path.join("jax", "_src") + os.sep
    return [
        f"{frame.filename}:{frame.lineno} {frame.name}"
        for frame in traceback.extract_tb(error.__traceback__)
        if internal in frame.filename
    ]


SHARDED = [
    pytest.param(entry, option, value, id=f"{entry}-{option}={value!r}")
    for entry in ("sharded_flash_attention", "ring_flash_attention")
    for option, value, _ in BAD
]


@pytest.mark.parametrize("entry, option, value", SHARDED)
@pytest.mark.usefixtures("unfiltered_tracebacks")
def test_multi_device_entry_points_validate_before_tracing(entry: str, option: str, value: Any):
    """A plain call (no `shard_map` around it) raises the very error `flash_attention`
    raises, from the validator itself: no frame of JAX's tracing (`jit`, `shard_map`) lies
    between the call and the `raise`. For the ring, options are checked before it looks for
    its mesh axis, so a bad option is reported as such even outside `shard_map`."""
    if entry == "sharded_flash_attention":
        call = ENTRY_POINTS[entry][0]
    else:
        def call(**options):
            return eqx_flash.ring_flash_attention(Q, K, V, axis_name="seq", **options)
    reference = _error(ENTRY_POINTS["flash_attention"][0], **{option: value})
    error = _error(call, **{option: value})
    assert type(error) is type(reference) and str(error) == str(reference), (
        f"{entry}: {_describe(error)}\nflash_attention: {_describe(reference)}"
    )
    frames = _jax_frames(error)
    assert not frames, f"{entry} raised from inside JAX's tracing:\n" + "\n".join(frames)
