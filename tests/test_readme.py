"""Every python block in README.md runs as written."""

import pathlib

import pytest
from helpers import python_blocks, run_block

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = python_blocks(README)


def test_readme_has_examples():
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index):
    run_block(BLOCKS[index], f"README.md block {index}")
