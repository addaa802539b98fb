"""The config's sections derived from the domain's specs: every setting is offered, with the
domain's default and bounds, and the config package reads no adapter."""

from __future__ import annotations

import ast
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import annotated_types
import pytest
from pydantic import TypeAdapter, ValidationError

from stoker.config import PodConfig, PoolConfig, StokerConfig, load_config
from stoker.config.names import LabelValue, is_dns_subdomain, is_label_value
from stoker.domain.errors import ConfigError
from stoker.domain.specs import (
    OrgSpec,
    PlaneSettings,
    PodTemplate,
    PoolSpec,
    ProcessTemplate,
    Timeouts,
)

CONFIG_PACKAGE = Path(__file__).resolve().parents[2] / "src" / "stoker" / "config"
SPECS = (PoolSpec, Timeouts, OrgSpec, PlaneSettings, ProcessTemplate, PodTemplate)
#: The fields of each spec that are not settings: identity and the worker template.
NOT_SETTINGS = {"name", "template", "revision", "argv"}


def _numeric_fields(spec: type[Any]) -> list[tuple[str, Any]]:
    """The int and float fields of `spec`, each with its annotation (`Annotated[...]` when
    it is bounded; the first member of `X | None`)."""
    hints = typing.get_type_hints(spec, include_extras=True)
    out = []
    for field in dataclasses.fields(spec):
        hint = hints[field.name]
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            hint = typing.get_args(hint)[0]
        plain = typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Annotated else hint
        if plain in (int, float):
            out.append((field.name, hint))
    return out


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.__name__)
def test_every_numeric_setting_has_a_lower_bound(spec: type[Any]) -> None:
    """A number the config accepts can never be negative unless its spec says so."""
    for name, annotated in _numeric_fields(spec):
        metadata = typing.get_args(annotated)[1:]
        assert any(isinstance(m, annotated_types.Ge | annotated_types.Gt) for m in metadata), (
            f"{spec.__name__}.{name} has no lower bound"
        )


@pytest.mark.parametrize(
    ("section", "specs"),
    [(PoolConfig, (PoolSpec, ProcessTemplate)), (PodConfig, (PodTemplate,))],
    ids=["PoolConfig", "PodConfig"],
)
def test_a_derived_section_offers_every_setting_with_its_default(
    section: Any, specs: tuple[type[Any], ...]
) -> None:
    for spec in specs:
        for field in dataclasses.fields(spec):
            if field.name in NOT_SETTINGS:
                continue
            assert field.name in section.model_fields, f"{spec.__name__}.{field.name}"
            if field.default is not dataclasses.MISSING:
                default = section.model_fields[field.name].get_default(call_default_factory=True)
                assert default == field.default, f"{spec.__name__}.{field.name}"


POOL_BOUNDS = [
    (name, annotated)
    for name, annotated in _numeric_fields(PoolSpec)
    if typing.get_origin(annotated) is typing.Annotated
]


@pytest.mark.parametrize(("name", "annotated"), POOL_BOUNDS, ids=[n for n, _ in POOL_BOUNDS])
def test_a_domain_bound_is_a_config_error_that_names_the_key(name: str, annotated: Any) -> None:
    [lower] = [
        m
        for m in typing.get_args(annotated)[1:]
        if isinstance(m, annotated_types.Ge | annotated_types.Gt)
    ]
    bound: Any = lower.ge if isinstance(lower, annotated_types.Ge) else lower.gt
    below = bound - 1 if isinstance(lower, annotated_types.Ge) else bound
    with pytest.raises(ConfigError) as info:
        load_config(None, {f"STOKER_POOLS__0__{name.upper()}": str(below)})
    op = ">=" if isinstance(lower, annotated_types.Ge) else ">"
    assert str(info.value).splitlines() == [
        f"config error: pools[0].{name}: must be {op} {bound:g} "
        f"(from STOKER_POOLS__0__{name.upper()})"
    ]


def test_orgs_intervals_and_timeouts_are_the_domain_objects() -> None:
    config = StokerConfig.model_validate(
        {
            "orgs": [{"name": "acme", "max_workers": 3}],
            "intervals": {"janitor_interval_s": 1},
            "pools": [{"name": "p", "command": ["x"], "timeouts": {"spawn_s": 9}}],
        }
    )
    assert config.orgs == [OrgSpec(name="acme", max_workers=3)]
    assert config.intervals == PlaneSettings(janitor_interval_s=1)
    assert config.pools[0].timeouts == Timeouts(spawn_s=9)
    assert config.intervals_given() == {"janitor_interval_s"}


def test_names() -> None:
    assert is_label_value("a.b-c_d") and not is_label_value("") and not is_label_value("a-")
    assert (
        is_dns_subdomain("a.b-c") and not is_dns_subdomain("A") and not is_dns_subdomain("a" * 254)
    )
    labels = TypeAdapter(LabelValue)
    # An empty label value is valid in Kubernetes: "no value" in a selector.
    assert labels.validate_python("") == ""
    with pytest.raises(ValidationError, match="is not a valid Kubernetes label value"):
        labels.validate_python("-a")


def test_the_config_package_imports_no_adapter() -> None:
    """The config reads domain constants (the janitor's lease), never an adapter's."""
    for path in sorted(CONFIG_PACKAGE.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("stoker.adapters"), (path.name, node.module)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith("stoker.adapters"), (path.name, alias.name)
