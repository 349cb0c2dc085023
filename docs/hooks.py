"""mkdocs hook: keep jaxtyping shape strings such as `"... #seq_q #seq_k"` as written.

griffe parses string constants in annotations as forward references. A jaxtyping shape
string that starts with `...` and goes on with `#`-prefixed (broadcastable) axes parses as
`Ellipsis` followed by a comment, so the API reference showed `Bool[Array, ...]` instead of
the shape. No real forward reference contains `#`: such strings stay string literals.
"""

import builtins

import griffe._internal.expressions as expressions


def _compile(source, filename, *args, **kwargs):
    if filename == "<string-annotation>" and isinstance(source, str) and "#" in source:
        raise SyntaxError("a jaxtyping shape string, not a forward reference")
    return builtins.compile(source, filename, *args, **kwargs)


expressions.compile = _compile  # pyright: ignore[reportAttributeAccessIssue]
