"""How a config section is declared: the base every section shares, and sections derived
from the domain's dataclasses.

A setting's type, default, bounds and doc are declared once, on its domain dataclass
(`stoker.domain.specs`, bounds as `annotated_types` metadata). `derived_section` turns
those fields into a pydantic model, so the config repeats none of them; `refine` narrows a
field's type where the config checks more than the domain does (Kubernetes names,
quantities), and `spec_values` reads a section back as the dataclass's arguments.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, create_model

from stoker.domain.comments import field_description

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

SectionT = TypeVar("SectionT", bound="Section")


class Section(BaseModel):
    """Base of every config section: unknown keys and NaN/infinity are errors."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)


class DerivedSection(Section):
    """Base of a section whose fields come from a domain dataclass (`derived_section`)."""

    if TYPE_CHECKING:
        # The derived fields are made at import time, out of the type checker's sight: they
        # read as Any here. Code that needs them typed reads the domain object instead.
        def __getattr__(self, name: str) -> Any: ...


def spec_fields(
    spec: type[DataclassInstance],
    *,
    omit: Collection[str] = (),
    refine: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Pydantic field definitions for the fields of `spec`, but those in `omit`.

    Each keeps its annotation (with its bounds), its default and its doc comment (as the
    field's description); `refine` replaces the annotation of the fields it names.
    """
    hints = typing.get_type_hints(spec, include_extras=True)
    refine = refine or {}
    definitions: dict[str, Any] = {}
    for field in dataclasses.fields(spec):
        if field.name in omit:
            continue
        about = field_description(spec, field.name)
        if field.default is not dataclasses.MISSING:
            default = Field(field.default, description=about)
        elif field.default_factory is not dataclasses.MISSING:
            default = Field(default_factory=field.default_factory, description=about)
        else:
            default = Field(description=about)
        definitions[field.name] = (refine.get(field.name, hints[field.name]), default)
    return definitions


def derived_section(
    name: str, base: type[SectionT], doc: str, fields: Mapping[str, Any]
) -> type[SectionT]:
    """The model `base` plus `fields` (from `spec_fields`), named `name`."""
    model: type[SectionT] = create_model(
        name, __base__=base, __doc__=doc, __module__=base.__module__, **fields
    )
    return model


def spec_values(
    section: BaseModel, spec: type[DataclassInstance], *, omit: Collection[str] = ()
) -> dict[str, Any]:
    """The values of `section` for the fields of `spec` (but `omit`), by name."""
    return {
        field.name: getattr(section, field.name)
        for field in dataclasses.fields(spec)
        if field.name not in omit
    }
