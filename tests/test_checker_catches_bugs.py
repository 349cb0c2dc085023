"""The checker has teeth: for attention functions with realistic bugs, Hypothesis finds an
input on which `check_attention` fails, and the real kernel passes on that same input."""

import math
import subprocess
import sys

import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, Phase, find, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample

from eqx_flash import flash_attention, plain_attention
from eqx_flash.testing import attention_inputs, check_attention


def plain(q, k, v, **kwargs):
    kwargs.pop("block_q", None)
    kwargs.pop("block_k", None)
    return plain_attention(q, k, v, **kwargs)


def wrong_scale(q, k, v, **kwargs):
    scale = kwargs.pop("scale", None) or 1 / math.sqrt(q.shape[-1])
    return plain(q, k, v, scale=1.02 * scale, **kwargs)


def ignores_key_mask(q, k, v, **kwargs):
    kwargs.pop("mask", None)
    return plain(q, k, v, **kwargs)


def causal_off_by_one(q, k, v, **kwargs):
    if kwargs.pop("causal", False):
        kwargs["attn_mask"] = jnp.tri(
            q.shape[-2], k.shape[-2], k.shape[-2] - q.shape[-2] + 1, dtype=bool
        )
    return plain(q, k, v, **kwargs)


def gqa_tiled(q, k, v, **kwargs):
    groups = q.shape[-3] // k.shape[-3]
    reps = (1,) * (k.ndim - 3) + (groups, 1, 1)
    return plain(q, jnp.tile(k, reps), jnp.tile(v, reps), **kwargs)


def lse_shifted(q, k, v, **kwargs):
    out, lse = plain(q, k, v, **kwargs)
    return out, lse + 1e-2


def ignores_segment_ids(q, k, v, **kwargs):
    kwargs.pop("q_segment_ids", None)
    kwargs.pop("kv_segment_ids", None)
    return plain(q, k, v, **kwargs)


def ignores_softcap(q, k, v, **kwargs):
    kwargs.pop("softcap", None)
    return plain(q, k, v, **kwargs)


def empty_rows_average(q, k, v, **kwargs):
    out, lse = plain(q, k, v, **kwargs)
    groups = q.shape[-3] // k.shape[-3]
    mean_v = jnp.repeat(v.mean(axis=-2), groups, axis=-2)[..., None, :]
    return jnp.where(jnp.isneginf(lse)[..., None], mean_v.astype(out.dtype), out), lse


problems = attention_inputs


# Each bug with the strategy restricted to the feature it breaks.
BUGS = {
    "wrong_scale": (wrong_scale, problems()),
    "ignores_key_mask": (ignores_key_mask, problems(mask=True)),
    "causal_off_by_one": (
        causal_off_by_one,
        problems(causal=True, window=False, attn_mask=False),
    ),
    "gqa_tiled": (gqa_tiled, problems(heads=[(4, 2)])),
    "lse_shifted": (lse_shifted, problems()),
    "ignores_segment_ids": (ignores_segment_ids, problems(segment_ids=True)),
    "ignores_softcap": (ignores_softcap, problems(softcap=True)),
    "empty_rows_average": (empty_rows_average, problems(fully_masked_rows=True)),
}

FIND = settings(
    max_examples=300,
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.generate],  # the first counterexample is enough; shrinking compiles more
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def fails(fn, inputs) -> bool:
    try:
        check_attention(fn, inputs)
    except AssertionError:
        return True
    return False


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_finds_counterexample(bug):
    broken, strategy = BUGS[bug]
    example = find(strategy, lambda inputs: fails(broken, inputs), settings=FIND)
    check_attention(flash_attention, example)  # the counterexample is not a false alarm


def test_report_is_readable():
    example = find(problems(dtypes=[jnp.float32]), lambda _: True, settings=FIND)
    with pytest.raises(AssertionError) as info:
        check_attention(lse_shifted, example)
    report = str(info.value)
    assert "lse:" in report and "worst at" in report and "AttentionInputs(q=float32" in report
    assert "rtol" in report


def test_real_kernel_passes_the_bug_strategies():
    strategy = st.one_of(*(s for _, s in BUGS.values()))
    examples = max(3, settings().max_examples // 5)
    with pytest.raises(NoSuchExample):
        find(
            strategy,
            lambda inputs: fails(flash_attention, inputs),
            settings=settings(FIND, max_examples=examples),
        )


def test_checker_accepts_out_only_and_reports_empty_rows():
    example = find(
        problems(dtypes=[jnp.float32], fully_masked_rows=True, causal=False),
        lambda _: True,
        settings=FIND,
    )
    check_attention(lambda q, k, v, **kw: plain(q, k, v, **kw)[0], example)  # out only
    with pytest.raises(AssertionError, match=r"lse: -inf at"):
        check_attention(
            lambda q, k, v, **kw: (plain(q, k, v, **kw)[0], 0 * example.q[..., 0]),
            example,
            grads=False,
        )


def test_import_needs_no_hypothesis():
    # `hypothesis` is an optional extra: importing eqx_flash.testing must not need it.
    code = (
        "import sys; sys.modules['hypothesis'] = None\n"
        "import eqx_flash.testing as t\n"
        "assert t.value_and_grad_difference is not None and callable(t.check_attention)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
