"""Bad module construction and bad module calls raise errors naming the argument: every
validation case of `FlashAttention` and `FlashMultiheadAttention` lives here (the options
they share with the functions are also in `test_option_errors.py`).

Written against the API of the modules issue: `FlashMultiheadAttention(num_heads,
query_size, ..., *, key, num_kv_heads=...)` called as `mha(query, key_, value, mask)`, and
`FlashAttention(causal=..., ...)` called as `attn(q, k, v, mask)` on unbatched inputs.
"""

import re
import subprocess
import sys
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import pytest

import eqx_flash

NUM_HEADS, QUERY, KEY, VALUE, Q_SEQ, KV_SEQ = 4, 16, 12, 10, 6, 9
ERRORS = (TypeError, ValueError)


def _assert_names(error: pytest.ExceptionInfo, argument: str) -> None:
    message = str(error.value)
    if isinstance(error.value, jaxtyping.TypeCheckError):
        assert f"parameter '{argument}'" in message, message
    else:
        assert re.search(rf"(?<![\w.]){re.escape(argument)}(?!\w)", message), message


def _mha(**kwargs: Any):
    options: dict[str, Any] = dict(key_size=KEY, value_size=VALUE, key=jax.random.key(0))
    options.update(kwargs)
    return eqx_flash.FlashMultiheadAttention(NUM_HEADS, QUERY, **options)


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"num_kv_heads": 0}, "num_kv_heads"),
        ({"num_kv_heads": -2}, "num_kv_heads"),
        ({"num_heads": 0}, "num_heads"),
        ({"query_size": 0}, "query_size"),
        ({"key_size": -1}, "key_size"),
        ({"value_size": 0}, "value_size"),
        ({"output_size": 0}, "output_size"),
        ({"qk_size": 0}, "qk_size"),
        ({"vo_size": -3}, "vo_size"),
        ({"block_q": 0}, "block_q"),
        ({"block_k": -1}, "block_k"),
        ({"block_k": 2.5}, "block_k"),
        ({"window": -1}, "window"),
        ({"softcap": 0.0}, "softcap"),
        ({"dropout_p": 1.0}, "dropout_p"),
        ({"dropout_p": -0.1}, "dropout_p"),
    ],
)
def test_construction(kwargs: dict[str, Any], argument: str):
    options: dict[str, Any] = dict(
        num_heads=NUM_HEADS, query_size=QUERY, key_size=KEY, value_size=VALUE,
        key=jax.random.key(0),
    )
    options.update(kwargs)
    with pytest.raises(ERRORS) as error:
        eqx_flash.FlashMultiheadAttention(**options)
    _assert_names(error, argument)


def _inputs() -> dict[str, Any]:
    return dict(
        query=jnp.zeros((Q_SEQ, QUERY)),
        key_=jnp.zeros((KV_SEQ, KEY)),
        value=jnp.zeros((KV_SEQ, VALUE)),
    )


CALL_CASES = [
    ({"query": jnp.zeros((Q_SEQ, QUERY + 1))}, "query"),
    ({"key_": jnp.zeros((KV_SEQ, KEY + 1))}, "key_"),
    ({"value": jnp.zeros((KV_SEQ, VALUE - 1))}, "value"),
    ({"value": jnp.zeros((KV_SEQ + 1, VALUE))}, "value"),
    ({"query": jnp.zeros((2, Q_SEQ, QUERY))}, "query"),  # batched: users vmap instead
    ({"mask": jnp.ones((Q_SEQ, KV_SEQ + 1), bool)}, "mask"),
    ({"mask": jnp.ones((KV_SEQ,))}, "mask"),  # a float mask
]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "filter_jit"])
@pytest.mark.parametrize("change, argument", CALL_CASES)
def test_multihead_call(change: dict[str, Any], argument: str, jit: bool):
    mha = _mha(num_kv_heads=2)
    inputs = {**_inputs(), **change}
    call = eqx.filter_jit(mha) if jit else mha
    with pytest.raises(ERRORS) as error:
        call(inputs["query"], inputs["key_"], inputs["value"], inputs.get("mask"))
    _assert_names(error, argument)


def test_multihead_good_call():
    """The baseline the cases perturb is valid."""
    mha = _mha(num_kv_heads=2)
    inputs = _inputs()
    out = mha(inputs["query"], inputs["key_"], inputs["value"], jnp.ones((KV_SEQ,), bool))
    assert out.shape == (Q_SEQ, QUERY)


@pytest.mark.parametrize(
    "shapes, argument",
    [
        ({"k": (2, KV_SEQ, 9)}, "k"),  # head dim differs from q's
        ({"v": (2, KV_SEQ + 1, 8)}, "v"),  # k and v sequence lengths differ
        ({"k": (3, KV_SEQ, 8), "v": (3, KV_SEQ, 8)}, "k"),  # 3 kv heads for 4 heads
    ],
)
def test_flash_attention_module_call(shapes: dict[str, tuple[int, ...]], argument: str):
    attn = eqx_flash.FlashAttention(causal=True)
    arrays = dict(q=(NUM_HEADS, Q_SEQ, 8), k=(2, KV_SEQ, 8), v=(2, KV_SEQ, 8))
    arrays.update(shapes)
    with pytest.raises(ERRORS) as error:
        attn(*(jnp.zeros(arrays[n]) for n in ("q", "k", "v")))
    _assert_names(error, argument)


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"block_q": 0}, "block_q"),
        ({"block_q": -4}, "block_q"),
        ({"window": (-1, 0)}, "window"),
        ({"window": (1, 2, 3)}, "window"),
        ({"softcap": -1.0}, "softcap"),
        ({"softcap": -2.0}, "softcap"),
        ({"scale": float("inf")}, "scale"),
        ({"dropout_p": 1.5}, "dropout_p"),
    ],
)
def test_flash_attention_module_construction(kwargs: dict[str, Any], argument: str):
    with pytest.raises(ERRORS) as error:
        eqx_flash.FlashAttention(**kwargs)
    _assert_names(error, argument)


def test_flash_attention_module_causal_must_be_bool():
    with pytest.raises(TypeError) as error:
        eqx_flash.FlashAttention(causal=1)  # type: ignore[arg-type]
    _assert_names(error, "causal")


def test_from_eqx_rejects_unknown_options():
    mha = eqx.nn.MultiheadAttention(2, 8, key=jax.random.key(1))
    with pytest.raises(TypeError, match="num_kv_heads"):
        eqx_flash.FlashMultiheadAttention.from_eqx(mha, num_kv_heads=1)


def test_process_heads_must_keep_shapes():
    mha = _mha()
    x = jnp.zeros((Q_SEQ, QUERY))
    with pytest.raises(ValueError, match="process_heads"):
        mha(x, jnp.zeros((KV_SEQ, KEY)), jnp.zeros((KV_SEQ, VALUE)),
            process_heads=lambda q, k, v: (q[:-1], k[:-1], v[:-1]))


def test_dropout_p_of_the_wrong_type_is_refused_at_construction():
    """Checked in a process without the test suite's jaxtyping import hook, which would
    catch the annotation first: the module's own check must name `dropout_p`."""
    script = (
        "import jax, eqx_flash\n"
        "for build in (lambda: eqx_flash.FlashAttention(dropout_p='0.1', inference=True),\n"
        "              lambda: eqx_flash.FlashMultiheadAttention(\n"
        "                  4, 16, dropout_p='0.1', inference=True, key=jax.random.key(0))):\n"
        "    try:\n"
        "        build()\n"
        "    except TypeError as error:\n"
        "        assert 'dropout_p' in str(error), error\n"
        "    else:\n"
        "        raise SystemExit('accepted')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("module", ["FlashAttention", "FlashMultiheadAttention"])
def test_traced_dropout_rate_is_refused_naming_dropout(module: str):
    q = jnp.ones((Q_SEQ, QUERY))
    if module == "FlashAttention":
        layer = eqx_flash.FlashAttention(dropout_p=0.1)
        layer = eqx.tree_at(lambda m: m.dropout_p, layer, jnp.asarray(0.2))
        heads = jnp.ones((2, Q_SEQ, 8))
        call, name = (lambda m, key: m(heads, heads, heads, key=key)), "dropout_p"
    else:
        layer = eqx.tree_at(lambda m: m.dropout.p, _mha(dropout_p=0.1), jnp.asarray(0.2))
        call, name = (lambda m, key: m(q, jnp.ones((KV_SEQ, KEY)),
                                       jnp.ones((KV_SEQ, VALUE)), key=key)), "dropout.p"
    # Concrete, the swapped-in rate is used as a number.
    assert call(layer, jax.random.key(1)).shape[0] in (2, Q_SEQ)
    with pytest.raises(TypeError, match=re.escape(name) + ".*traced"):
        eqx.filter_jit(call)(layer, jax.random.key(1))
    # In inference mode the rate is not read, traced or not.
    eqx.filter_jit(call)(eqx.nn.inference_mode(layer), None)
