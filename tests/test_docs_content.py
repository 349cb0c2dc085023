"""What a newcomer reads first (#42): install lines that work from a clone, a license, the
layout named where examples are copied from, docstrings whose lists render as written, no
section twice, and the README and the site agreeing on the supported versions."""

import inspect
import pathlib
import re
import tomllib
import types

import pytest
from helpers import python_blocks

import eqx_flash
import eqx_flash.testing

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDES = sorted((ROOT / "docs" / "guides").glob("*.md"))
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]


def _prose(page: pathlib.Path) -> str:
    """The page without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)


def test_install_lines_work_from_a_clone():
    """eqx_flash is not on the package index: every `pip install` of it names the clone
    (`.` or `".[extra]"`), and every extra it names exists."""
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"])
    files = [*PAGES, *(ROOT / "examples").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    for path in files:
        for arguments in re.findall(r"pip install((?: +[^\s&;#`)]+)+)", path.read_text()):
            for target in arguments.split():
                if target.startswith("-"):
                    continue
                assert "eqx_flash" not in target, f"{path.name}: pip install{arguments}"
                if re.fullmatch(r"""["']?\.(\[[\w,]+\])?["']?""", target):
                    for extra in re.findall(r"\w+", target):
                        assert extra in extras, f"{path.name}: pip install{arguments}"


def test_license():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "eqx_flash developers" in text
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == {
        "text": "MIT"}


@pytest.mark.parametrize("page", [README, ROOT / "docs" / "index.md", *GUIDES],
                         ids=lambda p: p.name)
def test_first_example_names_the_axes(page: pathlib.Path):
    """The first example of the README, the home page and each guide says in a comment
    which axis is which, so that jax.nn's `(batch, seq, heads, dim)` is not passed by
    mistake (it raises nothing when the sizes happen to fit)."""
    blocks = python_blocks(page)
    if not blocks:
        return
    comments = re.findall(r"#[^\n]*", blocks[0])
    named = [c for c in comments if re.search(r"\((\*?batch|heads|seq)\w*, [^)]*\)", c)]
    assert named, f"{page.name}: no comment names the axes in\n{blocks[0]}"


@pytest.mark.parametrize("page", [README, ROOT / "docs" / "index.md"], ids=lambda p: p.name)
def test_the_layout_and_jax_nns_are_said_before_the_first_example(page: pathlib.Path):
    before = page.read_text().split("```python")[0]
    assert "heads\nbefore the sequence" in before or "heads before\nthe sequence" in before \
        or "heads before the sequence" in before, page.name
    assert "eqx_flash.dot_product_attention" in before, page.name


def _public_docstrings():
    seen: set[int] = set()

    def walk(obj, path):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if doc := inspect.getdoc(obj):
            yield path, doc
        if inspect.isclass(obj):
            for name, member in vars(obj).items():
                if not name.startswith("_") or name in ("__init__", "__call__"):
                    if callable(member) or isinstance(member, property | classmethod):
                        yield from walk(getattr(obj, name), f"{path}.{name}")

    for namespace in (eqx_flash, eqx_flash.testing):
        for name in dir(namespace):
            value = getattr(namespace, name)
            if not name.startswith("_") and not isinstance(value, types.ModuleType):
                yield from walk(value, f"{namespace.__name__}.{name}")


def test_docstring_lines_do_not_turn_into_list_items():
    """A wrapped line that starts with `- ` (or `* `, `+ `, `1. `) becomes a nested list
    item in the API reference (`alibi_slopes`'s `- j|` did)."""
    bad = [(path, line) for path, doc in _public_docstrings()
           for line in doc.splitlines() if re.match(r"\s+([-*+]|\d+\.)\s", line)]
    assert not bad, bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_section_twice(page: pathlib.Path):
    titles = re.findall(r"^#{2,4} (.+)$", _prose(page), flags=re.M)
    assert len(titles) == len(set(titles)), [t for t in titles if titles.count(t) > 1]


def test_the_site_shows_the_readmes_versions_table():
    """docs/index.md includes the README's table (pymdownx.snippets), so they agree."""
    readme = README.read_text()
    section = re.search(r"<!-- --8<-- \[start:versions\] -->\n(.*?)<!-- --8<-- "
                        r"\[end:versions\] -->", readme, re.S)
    assert section is not None
    assert "| jax, jaxlib | 0.7.0 |" in section.group(1)
    assert '--8<-- "README.md:versions"' in (ROOT / "docs" / "index.md").read_text()
    assert "pymdownx.snippets" in (ROOT / "mkdocs.yml").read_text()
