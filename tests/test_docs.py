"""Every python block of the documentation site's pages (docs/**/*.md) runs as written,
and every public name has a page in the API reference."""

import pathlib

import pytest
from helpers import python_blocks, run_block

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
BLOCKS = [
    (page, index, code)
    for page in PAGES
    for index, code in enumerate(python_blocks(page))
]


def test_guides_have_examples():
    guides = {page.stem for page, _, _ in BLOCKS if page.parent.name == "guides"}
    assert {"masks", "modules", "testing", "distributed", "typing"} <= guides, guides


@pytest.mark.parametrize(
    "page, index, code",
    BLOCKS,
    ids=[f"{page.relative_to(DOCS)}:{index}" for page, index, _ in BLOCKS],
)
def test_docs_block_runs(page, index, code):
    run_block(code, f"{page.relative_to(DOCS)} block {index}")


def test_api_reference_covers_every_public_name():
    import types

    import eqx_flash
    import eqx_flash.testing

    api = "\n".join(page.read_text() for page in (DOCS / "api").glob("*.md"))
    public = [
        f"eqx_flash.{name}"
        for name, value in vars(eqx_flash).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    ]
    public += [f"eqx_flash.testing.{name}" for name in eqx_flash.testing.__all__]
    missing = [name for name in public if f"::: {name}\n" not in api + "\n"]
    assert not missing, f"no API reference entry for {missing}"
