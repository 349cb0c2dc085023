"""mkdocs hook: keep jaxtyping shape strings such as `"... #seq_q #seq_k"` as written.

griffe parses string constants in annotations as forward references. A jaxtyping shape
string that starts with `...` and goes on with `#`-prefixed (broadcastable) axes parses as
`Ellipsis` followed by a comment, so the API reference showed `Bool[Array, ...]` instead of
the shape; likewise `"..."` showed as `...`. No real forward reference contains `#`,
starts with a space or is `...`: such strings stay string literals. (A one-axis shape such
as `" seq_q"` still shows unquoted: jaxtyping hands griffe the axis name stripped.)
"""

import builtins

import griffe._internal.expressions as expressions


def _compile(source, filename, *args, **kwargs):
    if filename == "<string-annotation>" and isinstance(source, str) and (
        "#" in source or source.startswith(" ") or source == "..."
    ):
        raise SyntaxError("a jaxtyping shape string, not a forward reference")
    return builtins.compile(source, filename, *args, **kwargs)


expressions.compile = _compile  # pyright: ignore[reportAttributeAccessIssue]
