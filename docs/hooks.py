"""mkdocs hooks: readable signatures in the API reference, and jaxtyping shape strings
kept as written.

`on_config` appends `readable_signatures.ReadableSignatures` to mkdocstrings' griffe
extensions after hippogriffe's (this hook's `on_config` runs between hippogriffe's and
mkdocstrings'), so it
re-renders the annotations hippogriffe took from the signatures, and lays signatures out
with `readable_signatures.packed_signature` instead of one parameter per line.

griffe parses string constants in annotations as forward references. A jaxtyping shape
string that starts with `...` and goes on with `#`-prefixed (broadcastable) axes parses as
`Ellipsis` followed by a comment, so the API reference showed `Bool[Array, ...]` instead of
the shape; likewise `"..."` showed as `...`. No real forward reference contains `#`,
starts with a space or is `...`: such strings stay string literals. (A one-axis shape such
as `" seq_q"` still shows unquoted: jaxtyping hands griffe the axis name stripped.)

These patch private functions of griffe and mkdocstrings-python (the docs extra's
versions); `.ci/check_site.py` fails the docs build's check if a signature comes out long.
"""

import builtins
import pathlib

import griffe._internal.expressions as expressions
import mkdocstrings_handlers.python._internal.rendering as rendering
from mkdocs.plugins import event_priority
from readable_signatures import packed_signature

HERE = pathlib.Path(__file__).resolve().parent


def _compile(source, filename, *args, **kwargs):
    if filename == "<string-annotation>" and isinstance(source, str) and (
        "#" in source or source.startswith(" ") or source == "..."
    ):
        raise SyntaxError("a jaxtyping shape string, not a forward reference")
    return builtins.compile(source, filename, *args, **kwargs)


expressions.compile = _compile  # pyright: ignore[reportAttributeAccessIssue]
rendering._format_signature = packed_signature  # pyright: ignore[reportAttributeAccessIssue]


@event_priority(40)  # after hippogriffe's (50), before mkdocstrings reads its options (0)
def on_config(config):
    options = config.plugins["mkdocstrings"].config["handlers"]["python"]["options"]
    extension = f"{HERE / 'readable_signatures.py'}:ReadableSignatures"
    options.setdefault("extensions", []).append({extension: {}})
    return config
