"""`checked`: jaxtyping + beartype at a public entry point, with errors that fit on a line.

jaxtyping's `TypeCheckError` names the parameter, but its decisive fact (which axis was
bound to which size, by which argument) sits at the end of several thousand characters of
beartype output. `checked` runs the same check (`jaxtyped(typechecker=beartype)`) and,
when a parameter fails it, raises the same exception type with one first line that says
the argument, what was expected and what came, for example

    flash_attention: parameter 'k' expected float (*batch, kv_heads, seq_k, dim) with
    dim=64 as q has it, got float32[2,2,128,32] (dim=32)

(one line), then the entry point's layout hint when a shape was wrong, then jaxtyping's
own message unchanged. The summary is recomputed from the arguments and the annotations
(the first failing parameter is jaxtyping's); a case it cannot explain keeps a generic
first line with the sizes bound so far. Only the message changes: what is accepted is
what the annotations say, checked by jaxtyping and beartype as before.
"""

import dataclasses
import functools
import inspect
import math
import re
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
from beartype import beartype
from jaxtyping import AbstractArray, TypeCheckError, jaxtyped

F = TypeVar("F", bound=Callable[..., Any])

# jaxtyping's dtype families, as a reader says them.
_DTYPE_WORDS = {"Float": "float", "Integer": "integer", "Int": "signed integer",
                "UInt": "unsigned integer", "Bool": "bool", "Key": "PRNG key", "Shaped": "",
                "Num": "numeric", "Inexact": "inexact", "Real": "real", "Complex": "complex"}


def checked(*, layout: str | None = None, one_example: str | None = None) -> Callable[[F], F]:
    """Decorate a public entry point: `jaxtyped(typechecker=beartype)`, whose failures on a
    parameter begin with a one-line summary (`summary`).

    `layout`: a line added after the summary when an array's shape (not its dtype) was
    wrong: the entry point's layout and where another layout goes. `one_example`: for an
    entry point that takes one example, what to say (on the first line) when an array
    has more axes than it takes, after "takes": `"one example — use jax.vmap for a batch"`.
    """

    def decorate(fn: F) -> F:
        check = jaxtyped(typechecker=beartype)(fn)

        @functools.wraps(fn)
        def entry_point(*args: Any, **kwargs: Any) -> Any:
            try:
                return check(*args, **kwargs)
            except TypeCheckError as error:
                try:
                    lines = summary(fn, args, kwargs, str(error), layout, one_example)
                except Exception:  # noqa: BLE001 - a summary must never hide the error
                    lines = None
                if lines is None:
                    raise
                raise TypeCheckError("\n".join([*lines, "", str(error)])) from error.__cause__

        return typing.cast(F, entry_point)

    return decorate


def summary(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
            message: str, layout: str | None = None,
            one_example: str | None = None) -> list[str] | None:
    """The first line (and the layout line, if any) for jaxtyping's `message` about a
    call `fn(*args, **kwargs)`; None if the message is not about one of `fn`'s own
    parameters (a nested call's error, or the return value's)."""
    qualname = getattr(fn, "__qualname__", "")
    if not message.startswith("Type-check error whilst checking the parameters of "
                              f"{getattr(fn, '__module__', '')}.{qualname}."):
        return None
    found = re.search(r"parameter '(\w+)'", message)
    signature = inspect.signature(fn)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    if found is None or found.group(1) not in bound.arguments:
        return None
    name = found.group(1)
    entry = qualname.removesuffix(".__call__")
    memo = _Memo()
    for other, value in bound.arguments.items():
        if other == name:
            break
        _bind_matching(memo, other, value, signature.parameters[other].annotation)
    value, annotation = bound.arguments[name], signature.parameters[name].annotation
    why, shape_wrong, too_many_axes = _explain(memo, value, annotation)
    if why is None:
        bound_sizes = ", ".join(f"{k}={v}" for k, v in memo.sizes().items())
        why = (f"expected {_describe(annotation)}, got {_got(value)}"
               + (f" (axis sizes so far: {bound_sizes})" if bound_sizes else ""))
    first = f"{entry}: parameter '{name}' {why}"
    if too_many_axes and one_example is not None:
        first += f"; {entry} takes {one_example}"
    lines = [first]
    if shape_wrong and layout is not None:
        lines.append(layout)
    return lines


# The dims of a jaxtyping shape string: what `_match` needs of each.
@dataclasses.dataclass(frozen=True)
class _Dim:
    name: str | None  # None: anonymous (`_`, `...`) or a fixed size
    size: int | None = None  # a fixed size
    variadic: bool = False
    broadcast: bool = False


def _parse(dim_str: str) -> list[_Dim] | None:
    """jaxtyping's dims, or None for a form this summary does not read (expressions)."""
    dims = []
    for token in dim_str.split():
        if token == "...":
            dims.append(_Dim(None, variadic=True))
            continue
        variadic = broadcast = False
        while token[:1] in ("*", "#", "?"):
            variadic |= token[0] == "*"
            broadcast |= token[0] == "#"
            token = token[1:]
        if token.isdigit():
            dims.append(_Dim(None, int(token), variadic, broadcast))
        elif re.fullmatch(r"[A-Za-z_]\w*", token):
            name = None if token.startswith("_") else token
            dims.append(_Dim(name, None, variadic, broadcast))
        else:
            return None
    if sum(d.variadic for d in dims) > 1:
        return None
    return dims


class _Memo:
    """The sizes bound so far, and which argument bound each (as jaxtyping's memo)."""

    def __init__(self) -> None:
        self.single: dict[str, int] = {}
        self.variadic: dict[str, tuple[int, ...]] = {}
        self.origin: dict[str, str] = {}

    def sizes(self) -> dict[str, object]:
        return {**self.single, **{f"*{k}": v for k, v in self.variadic.items()}}


@dataclasses.dataclass(frozen=True)
class _Mismatch:
    rank: bool  # the number of axes is wrong (else: one named axis's size)
    text: str  # "with dim=64 as q has it" / "" (rank)
    got: str  # "(dim=32)" / ""


def _match(memo: _Memo, shape: tuple[int, ...], dims: list[_Dim]
           ) -> tuple[_Mismatch | None, dict[str, Any]]:
    """Whether `shape` fits `dims` given `memo`: (None, the new bindings) or (why not, {})."""
    fixed = [d for d in dims if not d.variadic]
    at = next((i for i, d in enumerate(dims) if d.variadic), None)
    if (at is None and len(shape) != len(fixed)) or len(shape) < len(fixed):
        return _Mismatch(True, "", ""), {}
    after = len(dims) - 1 - at if at is not None else 0
    pairs = list(zip(dims[: at if at is not None else len(dims)], shape, strict=False))
    if at is not None:
        pairs += list(zip(dims[at + 1:], shape[len(shape) - after:], strict=True))
    new: dict[str, Any] = {}
    for dim, size in pairs:
        if dim.size is not None:
            if size != dim.size and not (dim.broadcast and size == 1):
                return _Mismatch(False, "", ""), {}
            continue
        if dim.name is None or (dim.broadcast and size == 1):
            continue
        bound = memo.single.get(dim.name, new.get(dim.name))
        if bound is None:
            new[dim.name] = size
        elif bound != size:
            origin = memo.origin.get(dim.name)
            source = f" as {origin} has it" if origin else ""
            return _Mismatch(False, f"with {dim.name}={bound}{source}",
                             f"({dim.name}={size})"), {}
    if at is not None and (name := dims[at].name) is not None:
        part = tuple(shape[at: len(shape) - after])
        bound = memo.variadic.get(name)
        if bound is None:
            new["*" + name] = part
        elif bound != part and not (dims[at].broadcast and len(bound) == len(part) and all(
                p in (1, b) for p, b in zip(part, bound, strict=True))):
            origin = memo.origin.get("*" + name)
            source = f" as {origin} has it" if origin else ""
            return _Mismatch(False, f"with *{name}={bound}{source}",
                             f"(*{name}={part})"), {}
    return None, new


def _alternatives(annotation: Any) -> list[type]:
    """The jaxtyping array types in `annotation` (a union, possibly `Annotated`)."""
    if typing.get_origin(annotation) is typing.Annotated:
        return _alternatives(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [alt for arg in typing.get_args(annotation) for alt in _alternatives(arg)]
    if isinstance(annotation, type) and issubclass(annotation, AbstractArray):
        return [annotation]
    return []


def _is_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")


def _dtype_fits(value: Any, alt: Any) -> bool:
    """`value`'s dtype and array type are among `alt`'s (its shape aside)."""
    return isinstance(value, alt.dtype[alt.array_type, "..."])


def _bind_matching(memo: _Memo, name: str, value: Any, annotation: Any) -> None:
    """Bind the sizes of an argument that passed, by the first alternative it fits."""
    if not _is_array(value):
        return
    for alt in _alternatives(annotation):
        dims = _parse(alt.dim_str)
        if dims is None or not _dtype_fits(value, alt):
            continue
        mismatch, new = _match(memo, tuple(value.shape), dims)
        if mismatch is None:
            for key, size in new.items():
                if key.startswith("*"):
                    memo.variadic[key[1:]] = size
                else:
                    memo.single[key] = size
                memo.origin.setdefault(key, name)
            return


def _explain(memo: _Memo, value: Any, annotation: Any) -> tuple[str | None, bool, bool]:
    """(why `value` fails `annotation`, whether its shape is what is wrong, whether it has
    more axes than any alternative takes); why is None when this cannot tell."""
    alternatives = [alt for alt in _alternatives(annotation) if _parse(alt.dim_str) is not None]
    if not alternatives:
        return None, False, False
    if not _is_array(value):
        return (f"expected {_expected(alternatives)} (JAX or NumPy), got {_got(value)}",
                False, False)
    fitting = [alt for alt in alternatives if _dtype_fits(value, alt)]
    if not fitting:
        return f"expected {_expected(alternatives)}, got {_got(value)}", False, False
    mismatches = []
    for alt in fitting:
        mismatch, _ = _match(memo, tuple(value.shape), _parse(alt.dim_str) or [])
        if mismatch is None:
            return None, False, False
        mismatches.append((alt, mismatch))
    sized = [(alt, m) for alt, m in mismatches if not m.rank]
    if sized:
        alt, m = sized[0]
        return (f"expected {_expected([alt])}{' ' + m.text if m.text else ''}, got "
                f"{_got(value)}{' ' + m.got if m.got else ''}"), True, False
    too_many = all(len(value.shape) > _most_axes(alt) for alt in fitting)
    return f"expected {_expected(fitting)}, got {_got(value)}", True, too_many


def _most_axes(alt: Any) -> float:
    dims = _parse(alt.dim_str) or []
    return math.inf if any(d.variadic for d in dims) else float(len(dims))


def _expected(alternatives: list[Any]) -> str:
    """"a float array of shape (*batch, heads, seq_q, dim) or (seq_q, dim)"."""
    words = _dtypes(alternatives)
    article = "an" if (words or "array")[0] in "aeiou" else "a"
    return f"{article} {words + ' ' if words else ''}array of shape {_forms(alternatives)}"


def _forms(alternatives: list[Any]) -> str:
    forms = []
    for alt in alternatives:
        dims = alt.dim_str.split()
        form = "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"
        if form not in forms:
            forms.append(form)
    return " or ".join(forms)


def _dtypes(alternatives: list[Any]) -> str:
    words = []
    for alt in alternatives:
        name = alt.dtype.__name__
        word = _DTYPE_WORDS.get(name, name)
        if word not in words:
            words.append(word)
    return "" if "" in words else " or ".join(words)  # Shaped: any dtype


def _got(value: Any) -> str:
    if _is_array(value):
        return f"{np.dtype(value.dtype).name if _is_plain_dtype(value) else value.dtype}" \
               f"[{','.join(str(n) for n in value.shape)}]"
    return f"{type(value).__name__} {value!r}"[:80]


def _is_plain_dtype(value: Any) -> bool:
    try:
        np.dtype(value.dtype)
    except TypeError:
        return False
    return True


def _describe(annotation: Any) -> str:
    alternatives = _alternatives(annotation)
    if alternatives:
        return _expected(alternatives)
    return getattr(annotation, "__name__", repr(annotation))
