"""The configuration reference: every key of the config file, from `StokerConfig` down.

Each key's type and bounds come from its annotation, its default from the model, its
description from the field (or the `#:` comment where it is declared: the model's, or the
domain dataclass a section derives from). Nothing here is written by hand per key.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

from stoker.config import StokerConfig
from stoker.domain.comments import field_description


@dataclass(frozen=True)
class Key:
    """One key of the config file."""

    #: Dotted path: `api.port`, `pools[].demand.quantile`, `runtime.namespace`.
    path: str
    #: The top-level section it belongs to (its heading on the page).
    section: str
    type: str
    default: str
    description: str | None
    #: The variant of a section that is one of several shapes (`runtime.kind: kubernetes`).
    variant: str = ""


_BOUNDS: tuple[tuple[type[Any], str, str], ...] = (
    (annotated_types.Ge, "ge", ">="),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "<="),
    (annotated_types.Lt, "lt", "<"),
    (annotated_types.MinLen, "min_length", "length >="),
    (annotated_types.MaxLen, "max_length", "length <="),
)


def _bounds(metadata: list[Any]) -> list[str]:
    found = []
    for item in metadata:
        if isinstance(item, FieldInfo):
            found += _bounds(list(item.metadata))
            continue
        for kind, attribute, sign in _BOUNDS:
            if isinstance(item, kind):
                found.append(f"{sign} {getattr(item, attribute)}")
        pattern = getattr(item, "pattern", None)
        if isinstance(pattern, str):
            found.append(f"matching `{pattern}`")
    return found


def _strip(annotation: Any) -> tuple[Any, list[Any]]:
    """The annotation without `Annotated`, and the metadata it carried."""
    metadata: list[Any] = []
    while typing.get_origin(annotation) is Annotated:
        annotation, *extra = typing.get_args(annotation)
        metadata += extra
    return annotation, metadata


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and (
        issubclass(annotation, BaseModel) or dataclasses.is_dataclass(annotation)
    )


def _describe(annotation: Any) -> str:
    """A type in a few words, its bounds in parentheses."""
    annotation, metadata = _strip(annotation)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    bounds = _bounds(metadata)
    if origin in (Union, types.UnionType):
        text = " or ".join(_describe(arg) for arg in args if arg is not type(None))
        if type(None) in args:
            text += " or null"
    elif origin is Literal:
        text = "one of " + ", ".join(f"`{value}`" for value in args)
    elif origin in (list, tuple, frozenset, set):
        inner = _describe(args[0]) if args else "any"
        text = "list of sections" if inner == "section" else f"list of {inner}"
    elif origin in (dict, Mapping) or origin is typing.get_origin(Mapping[str, str]):
        text = f"mapping of {_describe(args[0])} to {_describe(args[1])}"
    elif isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        text = "one of " + ", ".join(f"`{member.value}`" for member in annotation)
    elif _is_section(annotation):
        text = "section"
    elif annotation is Any:
        text = "any"
    else:
        text = getattr(annotation, "__name__", str(annotation))
        text = {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}.get(
            text, text
        )
    return f"{text} ({', '.join(bounds)})" if bounds else text


def _default(value: Any) -> str:
    if value is PydanticUndefined or value is dataclasses.MISSING:
        return "required"
    plain = to_jsonable_python(value)
    if isinstance(plain, list) and plain and isinstance(plain[0], dict):
        return f"{len(plain)} built-in entr{'y' if len(plain) == 1 else 'ies'}"
    if isinstance(plain, dict) and plain:
        return "its keys' defaults"
    return f"`{json.dumps(plain)}`"


def _fields(owner: type[Any]) -> Iterator[tuple[str, Any, Any, str | None]]:
    """(key, annotation, default, description) of each field of a model or dataclass."""
    if issubclass(owner, BaseModel):
        for name, info in owner.model_fields.items():
            annotation: Any = info.annotation
            if info.metadata:
                annotation = Annotated[(annotation, *info.metadata)]
            default = (
                info.get_default(call_default_factory=True, validated_data={})
                if info.default_factory is not None
                else info.default
            )
            about = info.description or field_description(owner, name)
            yield info.alias or name, annotation, default, about
        return
    hints = typing.get_type_hints(owner, include_extras=True)
    for field in dataclasses.fields(owner):
        if field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = field.default
        yield field.name, hints[field.name], default, field_description(owner, field.name)


def _sections(annotation: Any) -> tuple[str, list[type[Any]]]:
    """The model or dataclass types a key holds, and `[]` when it holds a list of them."""
    annotation, _ = _strip(annotation)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        found = [_strip(arg)[0] for arg in args]
        return "", [arg for arg in found if _is_section(arg)]
    if origin in (list, tuple) and args:
        inner, _ = _strip(args[0])
        return ("[]", [inner]) if _is_section(inner) else ("", [])
    return ("", [annotation]) if _is_section(annotation) else ("", [])


def _variant(owner: type[Any]) -> str:
    if issubclass(owner, BaseModel) and "kind" in owner.model_fields:
        kind = owner.model_fields["kind"].annotation
        if typing.get_origin(kind) is Literal and len(typing.get_args(kind)) == 1:
            return f"kind: {typing.get_args(kind)[0]}"
    return ""


def _section_doc(owner: type[Any]) -> str | None:
    """The first paragraph of a section's own docstring (not one dataclass makes up)."""
    doc = owner.__dict__.get("__doc__") or ""
    if dataclasses.is_dataclass(owner) and doc.startswith(f"{owner.__name__}("):
        return None
    return doc.split("\n\n", 1)[0].strip() or None


def all_keys(model: type[Any] = StokerConfig, prefix: str = "", variant: str = "") -> list[Key]:
    """Every key under `model`, depth first, in declaration order."""
    found: list[Key] = []
    for key, annotation, default, about in _fields(model):
        path = f"{prefix}{key}"
        section = path.split(".", 1)[0].split("[", 1)[0]
        suffix, inner = _sections(annotation)
        shown = "see below" if inner and not suffix else _default(default)
        if not about and len(inner) == 1:
            about = _section_doc(inner[0])
        found.append(Key(path, section, _describe(annotation), shown, about, variant))
        for owner in inner:
            found += all_keys(owner, f"{path}{suffix}.", _variant(owner) or variant)
    return found


def undocumented(model: type[Any] = StokerConfig) -> list[str]:
    """The keys under `model` that have no description (a test fails while there is one)."""
    return [key.path for key in all_keys(model) if not key.description]


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def markdown() -> str:
    """The configuration reference page."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from the config models (stoker.reference.config) at every build of "
        "the site; edit the models' doc comments, not this page. -->",
        "",
        "Every key of the configuration file (`stoker serve --config FILE`), with its type, "
        "bounds, default and meaning. A key left out takes its default; an unknown key is "
        "an error that names it. Each key can also be set from the environment: "
        "`STOKER_` + the path in capitals with `__` between levels (`api.port` is "
        "`STOKER_API__PORT`), a list's entry by its index (`STOKER_POOLS__0__WARM_TARGET`). "
        "`stoker config check -c FILE` validates a file and prints the result. `[]` marks "
        "the entries of a list (`pools[].warm_target` is each pool's). How to put a "
        "configuration together: [Running locally](../guides/local.md).",
        "",
    ]
    by_section: dict[str, list[Key]] = {}
    for key in all_keys():
        by_section.setdefault(key.section, []).append(key)
    for section, entries in by_section.items():
        lines += [f"## `{section}`", ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for key in entries:
            about = key.description or ""
            if key.variant:
                about = f"({key.variant}) {about}"
            lines.append(
                f"| `{key.path}` | {_cell(key.type)} | {_cell(key.default)} | {_cell(about)} |"
            )
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"
