"""Every python block in README.md runs as written."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_has_examples():
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index):
    # README blocks run under JAX's default settings, as users' code does.
    import jax

    with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
        exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), {})
