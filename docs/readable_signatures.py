"""Readable signatures in the API reference (a griffe extension and a signature layout,
installed by `docs/hooks.py`).

The annotations eqx_flash checks at call time are not what a reader needs to see: an
array argument is a union of JAX and NumPy arrays, batched and bare, that hippogriffe
prints as a `Union[...]` of four; an option whose check `make_options` does is `Any` at
run time. `ReadableSignatures` re-renders every annotation of the package's functions
from the objects themselves:

- jaxtyping arrays as `Float[Array, "*batch heads seq_q dim"]` (a NumPy twin of a JAX
  array type is the same entry: the functions take both);
- `Annotated[..., Documented(T)]` (`eqx_flash._core.types`) as `T`, the type accepted;
- unions as `A | B | None`, builtins and eqx_flash's public classes by their short name,
  a long `Callable[...]` as `Callable` (the docstring gives its arguments).

An annotation with anything else keeps hippogriffe's rendering. `packed_signature` then
lays a signature out on lines of `line_length`, several short parameters to a line, so
that `flash_attention`'s 27 parameters fit on one screen.
"""

import collections.abc
import inspect
import re
import types
import typing
from typing import Any

import griffe
import jax
import jaxtyping
import numpy as np

import eqx_flash
import eqx_flash.testing
from eqx_flash._core.types import Documented

_LONG_CALLABLE = 60  # characters: past this, a `Callable[[...], ...]` shows as `Callable`
_BUILTINS = (bool, int, float, complex, str, bytes, type(None), object)


class _Unknown(Exception):
    """An annotation this renderer does not know: hippogriffe's rendering stays."""


def render(annotation: Any) -> str:
    """The annotation as the reader sees it, or `_Unknown`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        shown = [m.type for m in annotation.__metadata__ if isinstance(m, Documented)]
        return render(shown[0] if shown else args[0])
    if annotation is None or annotation is type(None):
        return "None"
    if annotation is Ellipsis:
        return "..."
    if annotation is typing.Any:
        return "Any"
    if isinstance(annotation, str):  # a forward reference: as written
        return annotation
    if origin in (typing.Union, types.UnionType):
        return _union(args)
    if isinstance(annotation, type) and issubclass(annotation, jaxtyping.AbstractArray):
        return f'{annotation.dtype.__name__}[Array, "{annotation.dim_str.strip()}"]'
    if origin is tuple:
        return "tuple[" + ", ".join(render(a) for a in args) + "]" if args else "tuple"
    if origin is collections.abc.Callable:
        return _callable(args)
    if origin is typing.Literal:
        return "Literal[" + ", ".join(repr(a) for a in args) + "]"
    if origin is type:
        return f"type[{render(args[0])}]"
    if origin is not None and args:  # Sequence[int], dict[str, int], ...
        return f"{render(origin)}[{', '.join(render(a) for a in args)}]"
    if annotation is jax.Array or annotation is np.ndarray:
        return "Array"
    if isinstance(annotation, type) and _known(annotation):
        return annotation.__name__
    raise _Unknown(annotation)


# Classes shown by their bare name: builtins, the standard library's abstract types, and
# the public classes of eqx_flash and of the libraries its signatures use.
_KNOWN_MODULES = ("builtins", "collections", "typing", "jax", "numpy", "equinox",
                  "hypothesis")


def _known(cls: type) -> bool:
    if cls in _BUILTINS:
        return True
    for namespace in (eqx_flash, eqx_flash.testing):
        if getattr(namespace, cls.__name__, None) is cls:
            return True
    return cls.__module__.split(".")[0] in _KNOWN_MODULES and not cls.__name__.startswith("_")


# Unions shown by the name their library gives them.
_NAMED_UNIONS = {"PRNGKeyArray": jaxtyping.PRNGKeyArray, "DTypeLike": jaxtyping.DTypeLike,
                 "ArrayLike": jaxtyping.ArrayLike}


def _union(args: tuple[Any, ...]) -> str:
    members, parts = list(args), []
    for name, union in _NAMED_UNIONS.items():
        alternatives = typing.get_args(union)
        if all(a in members for a in alternatives):
            members = [m for m in members if m not in alternatives]
            parts.append(name)
    for member in members:
        text = render(member)
        if text not in parts:
            parts.append(text)
    if "None" in parts:  # last, as written
        parts.remove("None")
        parts.append("None")
    return " | ".join(parts)


def _callable(args: tuple[Any, ...]) -> str:
    if not args:
        return "Callable"
    params, result = args
    text = ("Callable[..., " if params is Ellipsis else
            "Callable[[" + ", ".join(render(p) for p in params) + "], ") + render(result) + "]"
    if text == "Callable[..., Any]" or len(text) > _LONG_CALLABLE:
        return "Callable"
    return text


def _readable(annotation: Any) -> str | None:
    if annotation is inspect.Signature.empty:
        return None
    try:
        return render(annotation)
    except _Unknown:
        return None


def _functions(obj: griffe.Object) -> collections.abc.Iterator[griffe.Function]:
    """Every function and method defined in `obj` (aliases, which point elsewhere, not
    followed: each object is reached where it is defined)."""
    for member in obj.members.values():
        if member.is_alias:
            continue
        if isinstance(member, griffe.Function):
            yield member
        elif isinstance(member, griffe.Class | griffe.Module):
            yield from _functions(member)


class ReadableSignatures(griffe.Extension):
    """Take each function's signature from the object itself, and once the package is
    loaded re-render the annotations of every function defined in it."""

    def on_function_instance(self, *, node: Any, func: griffe.Function, **kwargs: Any
                             ) -> None:
        del kwargs
        try:
            func.extra["readable_signatures"]["signature"] = inspect.signature(node.obj)
        except (AttributeError, TypeError, ValueError):  # no object, or no signature
            pass

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        del kwargs
        for function in _functions(pkg):
            signature = function.extra.get("readable_signatures", {}).get("signature")
            if signature is None:
                continue
            for parameter in signature.parameters.values():
                text = _readable(parameter.annotation)
                if text is not None and parameter.name in function.parameters:
                    function.parameters[parameter.name].annotation = text
            text = _readable(signature.return_annotation)
            if text is not None and function.name != "__init__":
                function.returns = text

    # griffe before 1.x (mkdocstrings-python's oldest supported) calls it this.
    on_package_loaded = on_package


def packed_signature(name: str, signature: str, line_length: int) -> str:
    """`name` and `signature` (`"(a: int, *, b: str = 'x') -> int"`) on lines of at most
    `line_length` where it can: on one line if it fits, else one line per group of
    parameters that fit together, four spaces in; a long return annotation goes on lines
    of its own, split at its top-level `|`."""
    name, signature = str(name).strip(), signature.strip()
    if len(name + signature) <= line_length:
        return name + signature
    close = _closing_paren(signature)
    parameters = [p.strip() for p in _split_top_level(signature[1:close], ",") if p.strip()]
    returns = signature[close + 1:].strip()
    lines, current = [name + "("], ""
    for parameter in parameters:
        piece = parameter + ","
        if current and len("    " + current + " " + piece) <= line_length:
            current += " " + piece
        else:
            if current:
                lines.append("    " + current)
            current = piece
    if current:
        lines.append("    " + current)
    tail = ")" + (" " + returns if returns else "")
    alternatives = _split_top_level(returns.removeprefix("->").strip(), "|")
    if len(tail) > line_length and len(alternatives) > 1:
        lines.append(") -> (")
        lines += ["    " + ("| " if i else "") + a.strip() for i, a in enumerate(alternatives)]
        lines.append(")")
    else:
        lines.append(tail)
    return "\n".join(lines)


def _closing_paren(text: str) -> int:
    depth = 0
    for i, char in enumerate(_mask_strings(text)):
        depth += char in "([{"
        depth -= char in ")]}"
        if depth == 0:
            return i
    raise ValueError(f"unbalanced signature: {text}")


def _split_top_level(text: str, separator: str) -> list[str]:
    """`text` split at each `separator` outside brackets and string literals."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(_mask_strings(text)):
        depth += char in "([{"
        depth -= char in ")]}"
        if char == separator and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _mask_strings(text: str) -> str:
    """`text` with the inside of its string literals blanked (brackets there are text)."""
    return re.sub(r"\"[^\"]*\"|'[^']*'", lambda m: m[0][0] + " " * (len(m[0]) - 2) + m[0][0],
                  text)
