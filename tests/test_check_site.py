"""`.ci/check_site.py`, the check CI runs over the built documentation site (issue #42),
catches each defect it is for: pages made to fail, and the passing form of each."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_site", ROOT / ".ci" / "check_site.py")
assert _spec is not None and _spec.loader is not None
check_site = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_site)

GOOD_FLASH = """flash_attention(
    q: Float[Array, "*batch heads seq_q dim"] | Float[Array, "seq_q dim"],
    k: Float[Array, "*batch kv_heads seq_k dim"], v: Float[Array, "*batch kv_heads seq_k dim_v"],
    *, causal: bool = False, window: int | tuple[int | None, int | None] | None = None,
    scale: float | None = None, block_q: int | None = None,
) -> tuple[Array, ...]"""


def _signature_page(signature: str, contents: str = "<p>Text.</p>") -> str:
    escaped = signature.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return (f'<h3 id="eqx_flash.f" class="doc doc-heading">f</h3>'
            f'<div class="doc-signature highlight"><pre><span></span><code>'
            f'<span class="n">{escaped}</span></code></pre></div>'
            f'<div class="doc doc-contents first">{contents}</div>')


def test_a_good_page_passes():
    page = _signature_page(GOOD_FLASH, "<ul><li><code>q</code>: queries.</li></ul>")
    assert check_site.check_api_page("api/attention/index.html", page) == []
    assert check_site.check_page("api/attention/index.html", page) == []
    assert check_site.signatures(page) == [GOOD_FLASH]


def test_long_signature():
    long = "g(\n" + "".join(f"    p{i}: int,\n" for i in range(30)) + ")"
    problems = check_site.check_api_page("p", _signature_page(long))
    assert any("takes 32 lines" in p for p in problems), problems


@pytest.mark.parametrize("shown", ["Union[Float[Array, 'a'], Float[ndarray, 'a']]",
                                   "jaxtyping.Float[jaxlib._jax.Array, 'a']"])
def test_unreadable_array_annotation(shown: str):
    problems = check_site.check_api_page("p", _signature_page(f"g(q: {shown})"))
    assert problems, shown


@pytest.mark.parametrize("option", ["causal", "window", "block_k", "dropout_p"])
def test_any_for_a_checked_option(option: str):
    problems = check_site.check_api_page("p", _signature_page(f"g(x: int, *, {option}: Any = 1)"))
    assert any(f"{option} shows as 'Any = 1'" in p for p in problems), problems
    unannotated = check_site.check_api_page("p", _signature_page(f"g(*, {option}=1)"))
    assert unannotated, option


def test_flash_attention_shows_the_option_types():
    page = _signature_page(GOOD_FLASH.replace("scale: float | None", "scale: float | int | None"))
    problems = check_site.check_api_page("p", page)
    assert problems == ["p: flash_attention does not show `scale: float | None = None`"]


def test_private_path():
    page = _signature_page("decode(x: int) -> tuple[int, eqx_flash._nn.cache.KVCache]")
    assert check_site.check_api_page("p", page) == ["p: private path eqx_flash._nn.cache.KVCache"]


def test_nested_list_in_a_docstring():
    contents = ("<ul><li><code>alibi_slopes</code>: adds <code>-slope * |i</code>"
                "<ul><li>j|</li></ul></li></ul>")
    problems = check_site.check_api_page("p", _signature_page("g(x: int)", contents))
    assert any("nested list" in p for p in problems), problems


def test_underscore_members():
    page = ('<h3 id="eqx_flash.ALiBi.__init__">init</h3>'
            '<h3 id="eqx_flash.ALiBi.__call__">c</h3>'
            '<h4 id="eqx_flash.ALiBi.__dataclass_fields__">d</h4>'
            '<h4 id="eqx_flash.X._private">p</h4>')
    problems = check_site.check_page("p", page)
    assert problems == ["p: underscore member eqx_flash.ALiBi.__dataclass_fields__",
                        "p: underscore member eqx_flash.X._private"]


def test_a_section_twice():
    page = '<h2 id="in-a-model">In a model<a class="headerlink">¤</a></h2>' * 2
    assert check_site.check_page("p", page) == ["p: the section 'In a model' appears 2 times"]


def test_build_tools_and_missing_signatures(tmp_path: pathlib.Path):
    (tmp_path / "api").mkdir()
    (tmp_path / "api" / "index.html").write_text("<p>no signature</p>")
    (tmp_path / "hooks.py").write_text("")
    problems = check_site.check_site(tmp_path)
    assert problems == ["build tool copied into the site: hooks.py",
                        "no page shows flash_attention's signature"]
    (tmp_path / "hooks.py").unlink()
    (tmp_path / "api" / "index.html").write_text(_signature_page(GOOD_FLASH))
    assert check_site.check_site(tmp_path) == []
