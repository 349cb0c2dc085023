"""Check the built documentation site for what a newcomer reads (issue #42), after
`mkdocs build --strict`:

    python .ci/check_site.py SITE_DIR

- every signature in the API reference fits on one screen: at most `MAX_LINES` rendered
  lines (`flash_attention`'s 27 parameters included);
- array arguments read as jaxtyping annotations (`Float[Array, "..."]`), not as the
  `Union[...]` of JAX and NumPy, batched and bare types checked at call time;
- the options the code checks show their type, never `Any` (and `flash_attention`'s
  `causal`, `window` and `scale` exactly as the issue asks);
- no private module path (`eqx_flash._...`) on an API page;
- no underscore member on any page but the `__init__`/`__call__` a page lists;
- no nested list inside an API page's docstrings (a wrapped line that starts with `- `
  turns into one: the `alibi_slopes` defect), and no section title twice on a page;
- no build tool (`*.py`) copied into the site.

Prints every problem and exits 1 if there is one. The functions take the HTML text, so
`tests/test_check_site.py` checks the checker on pages made to fail.
"""

import html
import pathlib
import re
import sys

MAX_LINES = 25
# The options whose type `make_options` (or the binder) checks: never `Any` on the page.
CHECKED_OPTIONS = ("causal", "window", "scale", "softcap", "block_q", "block_k",
                   "dropout_rate", "dropout_p", "return_max_scores", "is_causal")
# How `flash_attention` must show them (issue #42).
FLASH_ATTENTION_SHOWS = ("causal: bool = False",
                         "window: int | tuple[int | None, int | None] | None = None",
                         "scale: float | None = None")
ALLOWED_DUNDERS = ("__init__", "__call__")


def _text(fragment: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


def signatures(page: str) -> list[str]:
    """The rendered signatures of a page, as text (one per `doc-signature` block)."""
    blocks = re.findall(r'<div class="doc-signature[^"]*"><pre>(.*?)</pre>', page, re.S)
    return [_text(block).strip("\n") for block in blocks]


def parameters(signature: str) -> dict[str, str]:
    """`{name: annotation and default}` of a signature's parameters (top-level commas)."""
    inside = signature[signature.find("(") + 1:]
    found, depth, start = {}, 0, 0
    for i, char in enumerate(re.sub(r'"[^"]*"', lambda m: '"' + " " * (len(m[0]) - 2) + '"',
                                    inside)):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            if depth == 0:
                end = i
                break
            depth -= 1
        elif char == "," and depth == 0:
            _add(found, inside[start:i])
            start = i + 1
    else:
        end = len(inside)
    _add(found, inside[start:end])
    return found


def _add(found: dict[str, str], piece: str) -> None:
    """`name: annotation = default` -> `found[name] = "annotation = default"` (`""` when
    unannotated)."""
    piece = " ".join(piece.split())
    name = re.match(r"[*\s]*(\w*)", piece)[1]  # pyright: ignore[reportOptionalSubscript]
    rest = piece[piece.index(name) + len(name):].strip() if name else ""
    if name:
        found[name] = rest[1:].strip() if rest.startswith(":") else ""


def check_api_page(name: str, page: str) -> list[str]:
    problems = []
    for signature in signatures(page):
        title = signature.split("(")[0]
        lines = signature.splitlines()
        if len(lines) > MAX_LINES:
            problems.append(f"{name}: {title} takes {len(lines)} lines (at most {MAX_LINES})")
        for bad in ("Union[", "ndarray", "jaxtyping.", "jaxlib", "NoneType", "Optional["):
            if bad in signature:
                problems.append(f"{name}: {title} shows {bad!r}: {signature!r}")
        for option, shown in parameters(signature).items():
            if option in CHECKED_OPTIONS and (not shown or re.search(r"\bAny\b", shown)):
                problems.append(f"{name}: {title}'s {option} shows as {shown!r}")
        if title == "flash_attention":
            flat = " ".join(signature.split())
            problems += [f"{name}: flash_attention does not show `{want}`"
                         for want in FLASH_ATTENTION_SHOWS if want not in flat]
    text = _text(page)
    for path in sorted(set(re.findall(r"eqx_flash\._\w[\w.]*", text))):
        problems.append(f"{name}: private path {path}")
    for contents in re.findall(r'<div class="doc doc-contents[^"]*">(.*?)</div>', page, re.S):
        if re.search(r"<li>(?:(?!</li>).)*<ul>", contents, re.S):
            problems.append(f"{name}: a nested list in a docstring: "
                            f"{_text(contents)[:160]!r}")
    return problems


def check_page(name: str, page: str) -> list[str]:
    problems = []
    for anchor in re.findall(r'<h\d id="([^"]+)"', page):
        member = anchor.rsplit(".", 1)[-1]
        if "." in anchor and member.startswith("_") and member not in ALLOWED_DUNDERS:
            problems.append(f"{name}: underscore member {anchor}")
    titles = [_text(t).strip().rstrip("¶¤").strip()
              for t in re.findall(r"<h[23][^>]*>(.*?)</h[23]>", page, re.S)]
    for title in sorted({t for t in titles if titles.count(t) > 1}):
        problems.append(f"{name}: the section {title!r} appears {titles.count(title)} times")
    return problems


def check_site(site: pathlib.Path) -> list[str]:
    problems = [f"build tool copied into the site: {p.relative_to(site)}"
                for p in sorted(site.rglob("*.py"))]
    pages = sorted(site.rglob("*.html"))
    api = [p for p in pages if p.relative_to(site).parts[0] == "api"]
    if not any("flash_attention(" in "".join(signatures(p.read_text())) for p in api):
        problems.append("no page shows flash_attention's signature")
    for path in pages:
        name, page = str(path.relative_to(site)), path.read_text()
        problems += check_page(name, page)
        if path in api:
            problems += check_api_page(name, page)
    return problems


def main() -> None:
    site = pathlib.Path(sys.argv[1])
    problems = check_site(site)
    for problem in problems:
        print(problem)
    signatures_seen = sum(len(signatures(p.read_text())) for p in site.rglob("*.html"))
    print(f"check_site: {signatures_seen} signatures, {len(problems)} problems")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
