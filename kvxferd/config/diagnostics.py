"""Turn pydantic validation errors into one operator-facing line per problem.

Each line names the source, the path of the offending value as written in the
file, what was given and what is allowed; an unknown key gets the closest valid
key, or the section where it belongs when it was nested in the wrong place.
This module knows nothing of kvxferd's models: it walks whatever root model it
is given, so the same wording serves files and peer advertisements.
"""

from __future__ import annotations

import datetime
import difflib
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any, Literal, Union

from annotated_types import Ge, Gt
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

Loc = tuple[str | int, ...]
# Maps a kvxferd location to where that value sits in the file (None: nowhere).
ToFile = Callable[[Loc], "Loc | None"]
LineOf = Callable[[Loc], "int | None"]

_NAME_PATTERN_WORDS = "only letters, digits, '_', '.' and '-'"


def show(value: object) -> str:
    """A value the way a YAML file would write it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return type(value).__name__


def describe(value: object) -> str:
    """A value plus its kind, for type errors: "'60000' (a string)"."""
    kinds = {bool: "a boolean", str: "a string", float: "a number with a fraction"}
    if isinstance(value, datetime.date):
        return f"{value.isoformat()}, a date"
    kind = kinds.get(type(value))
    return f"{show(value)}, {kind}" if kind else show(value)


def dotted(loc: Loc) -> str:
    # No setting of kvxferd is a list: an integer in a location is a mapping key.
    return ".".join(str(part) for part in loc)


# ---------------------------------------------------------------- annotations


def _unwrap(annotation: Any) -> tuple[Any, bool, list[Any]]:
    """(inner type, nullable, constraint metadata) of a field annotation."""
    nullable = False
    metadata: list[Any] = []
    origin = typing.get_origin(annotation)
    if origin is Union or origin is types.UnionType:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        nullable = len(args) < len(typing.get_args(annotation))
        annotation = args[0] if len(args) == 1 else annotation
    while typing.get_origin(annotation) is typing.Annotated:
        inner, *extras = typing.get_args(annotation)
        for extra in extras:
            metadata.extend(extra.metadata if isinstance(extra, FieldInfo) else [extra])
        annotation = inner
    return annotation, nullable, metadata


def _model_of(annotation: Any) -> type[BaseModel] | None:
    inner, _, _ = _unwrap(annotation)
    return inner if isinstance(inner, type) and issubclass(inner, BaseModel) else None


def _field_at(root: type[BaseModel], loc: Loc) -> FieldInfo | None:
    """The field a location points at (dict keys are stepped over)."""
    model: type[BaseModel] | None = root
    field: FieldInfo | None = None
    index = 0
    while index < len(loc):
        if model is None or not isinstance(loc[index], str):
            return None
        field = model.model_fields.get(str(loc[index]))
        if field is None:
            return None
        index += 1
        inner, _, _ = _unwrap(field.annotation)
        if typing.get_origin(inner) is dict and index < len(loc):
            # loc[index] is a key of the mapping: describe the value type.
            if index + 1 != len(loc):
                return None
            return FieldInfo.from_annotation(typing.get_args(inner)[1])
        model = _model_of(field.annotation)
    return field


def _model_at(root: type[BaseModel], loc: Loc) -> type[BaseModel] | None:
    if not loc:
        return root
    field = _field_at(root, loc)
    return None if field is None else _model_of(field.annotation)


def _sections(root: type[BaseModel], loc: Loc = ()) -> Iterator[tuple[Loc, type[BaseModel]]]:
    yield loc, root
    for name, field in root.model_fields.items():
        sub = _model_of(field.annotation)
        if sub is not None:
            yield from _sections(sub, (*loc, name))


def allowed(field: FieldInfo | None) -> str | None:
    """In words, what a field accepts: "an integer greater than 0, or null"."""
    if field is None:
        return None
    extra = field.json_schema_extra
    if isinstance(extra, dict) and isinstance(extra.get("allowed"), str):
        return str(extra["allowed"])
    inner, nullable, metadata = _unwrap(field.annotation)
    metadata = [*metadata, *field.metadata]
    if typing.get_origin(inner) is Literal:
        text = "one of " + ", ".join(repr(v) for v in typing.get_args(inner))
    elif inner is bool:
        text = "true or false"
    elif inner is int:
        text = "an integer"
        for item in metadata:
            if isinstance(item, Gt):
                text += f" greater than {item.gt}"
            elif isinstance(item, Ge):
                text += f" greater than or equal to {item.ge}"
    elif inner is str:
        text = "a string"
    elif typing.get_origin(inner) is dict or _model_of(inner) is not None:
        text = "a mapping of keys to values"
    else:
        return None
    return f"{text}, or null" if nullable else text


# ---------------------------------------------------------------- messages


def _unknown_key(root: type[BaseModel], loc: Loc, to_file: ToFile) -> str:
    key, parent = loc[-1], loc[:-1]
    has_sections = any(_model_of(f.annotation) for f in root.model_fields.values())
    where = "top-level key" if not parent and has_sections else "key"
    head = f"unknown {where} {show(key)}"
    model = _model_at(root, parent)
    valid = list(model.model_fields) if model else []
    if isinstance(key, str):
        for section, sub in _sections(root):
            if section != parent and key in sub.model_fields:
                target = to_file((*section, key))
                if target is None:
                    continue
                if len(target) == 1:
                    return f"{head}: it is a top-level section, not part of this one"
                return (
                    f"{head}: it belongs in the {dotted(target[:-1])}: section "
                    f"(write it as {dotted(target)})"
                )
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        if close:
            return f"{head} (did you mean {close[0]!r}?)"
        qualified = {
            dotted(target): name
            for section, sub in _sections(root)
            for name in sub.model_fields
            if section != parent and (target := to_file((*section, name))) is not None
        }
        by_name = difflib.get_close_matches(key, list(qualified.values()), n=1, cutoff=0.75)
        if by_name:
            where_to = next(q for q, n in qualified.items() if n == by_name[0])
            return f"{head} (did you mean {where_to}?)"
    return f"{head}; allowed here: {', '.join(valid)}" if valid else head


def _not_a_string_key(key: object) -> str:
    why = " (YAML reads yes, no, on and off as booleans)" if isinstance(key, bool) else ""
    return f"the key {show(key)} is not a string{why}; quote it"


def _message(err: ErrorDetails, root: type[BaseModel], to_file: ToFile) -> str:
    kind, loc, value = err["type"], tuple(err["loc"]), err.get("input")
    ctx = err.get("ctx") or {}
    field = _field_at(root, loc)
    nullable = field is not None and _unwrap(field.annotation)[1]
    if kind == "extra_forbidden":
        return _unknown_key(root, loc, to_file)
    if kind == "greater_than":
        return f"must be greater than {ctx['gt']} (got {show(value)})"
    if kind == "greater_than_equal":
        return f"must be greater than or equal to {ctx['ge']} (got {show(value)})"
    if kind == "literal_error":
        choices = typing.get_args(_unwrap(field.annotation)[0]) if field else ()
        options = ", ".join(repr(c) for c in choices) or ctx.get("expected", "?")
        text = f"must be one of {options}{', or null' if nullable else ''} (got {show(value)})"
        if isinstance(value, str):
            same = [c for c in choices if isinstance(c, str) and c.lower() == value.lower()]
            if same:
                text += f"; values are case-sensitive: did you mean {same[0]!r}?"
        return text
    if kind == "string_pattern_mismatch":
        words = _NAME_PATTERN_WORDS if "A-Za-z0-9_.-" in str(ctx.get("pattern")) else None
        rule = f"contain {words}" if words else f"match {ctx.get('pattern')}"
        return f"must {rule} (got {show(value)})"
    if kind == "string_too_short":
        return "must not be empty"
    if kind in ("value_error", "assertion_error"):
        return str(ctx.get("error", err["msg"]))
    if kind == "invalid_key":
        return _not_a_string_key(value)
    if kind == "missing":
        return "is required"
    want = allowed(field)
    if want == "a string" and isinstance(value, int | float | datetime.date):
        # YAML turns 10:20 into 620, 2024-01-01 into a date, yes into true.
        return f"must be a string (got {describe(value)}); quote it to keep it as text"
    if want:
        return f"must be {want} (got {describe(value)})"
    return f"{err['msg']} (got {describe(value)})"


def format_validation_error(
    exc: ValidationError,
    *,
    root: type[BaseModel],
    source: str,
    to_file: ToFile | None = None,
    line_of: LineOf | None = None,
) -> list[str]:
    """One "source: path: problem (line N)" line per error in `exc`."""

    def identity(loc: Loc) -> Loc | None:
        return loc

    mapper = to_file or identity
    lines: list[tuple[int, str]] = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        message = _message(err, root, mapper)
        if loc and loc[-1] == "[key]":
            loc = loc[:-1]
            if err["type"] == "string_type":
                message = _not_a_string_key(loc[-1])
            else:
                message = f"name {message}"
        file_loc = mapper(loc)
        path = dotted(file_loc) if file_loc is not None else f"{dotted(loc)} (kvxferd setting)"
        line = line_of(file_loc) if (line_of and file_loc is not None) else None
        where = f" (line {line})" if line else ""
        text = f"{source}: {path}: {message}{where}" if path else f"{source}: {message}"
        lines.append((line or 1 << 30, text))
    # In file order: easier to fix from top to bottom.
    return [text for _, text in sorted(lines, key=lambda item: item[0])]
