"""The configuration reference is generated from the config models: every key is on the
page with its type, bounds, default and description, and a key without a description is
reported (the test below fails until it gets one)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any

from annotated_types import Ge
from pydantic import Field

from stoker.config import StokerConfig
from stoker.config.schema import Section
from stoker.reference import config


def test_every_config_key_has_a_description() -> None:
    assert config.undocumented() == []


@dataclass(frozen=True)
class _Inner:
    #: Documented.
    told: int = 1
    bare: int = 2


class _Outer(Section):
    #: Documented too.
    told: str = "x"
    bare: Annotated[int, Ge(3)] = 4
    #: The inner section.
    inner: _Inner = Field(default_factory=_Inner)
    items: list[_Inner] = Field(default_factory=list)


def test_a_key_without_a_description_is_reported() -> None:
    # A section key without a comment takes its section's docstring: _Inner has none.
    assert config.undocumented(_Outer) == ["bare", "inner.bare", "items", "items[].bare"]


def _by_path() -> dict[str, list[config.Key]]:
    found: dict[str, list[config.Key]] = {}
    for key in config.all_keys():
        found.setdefault(key.path, []).append(key)
    return found


def test_every_section_of_the_config_and_its_keys_are_listed() -> None:
    paths = _by_path()
    for name, info in StokerConfig.model_fields.items():
        assert (info.alias or name) in paths, name
    # Keys of nested sections, of lists of sections, of both runtimes, by their file names.
    for path in (
        "store_options.schema",
        "api.port",
        "intervals.janitor_interval_s",
        "pools[].warm_target",
        "pools[].demand.quantile",
        "pools[].timeouts.spawn_s",
        "pools[].pod.tolerations[].tolerationSeconds",
        "pools[].rollout.steps",
        "orgs[].max_claim_s",
        "runtime.memory_budget_mb",
        "runtime.namespace",
        "runtime.placeholder_size.cpu",
        "leader_election.lease_duration_s",
    ):
        assert path in paths, path
    assert "store_options.db_schema" not in paths
    [namespace] = paths["runtime.namespace"]
    assert namespace.variant == "kind: kubernetes"
    assert len(paths) > 120


def _value(document: Any, path: str) -> Any:
    for part in path.split("."):
        document = document[part]
    return document


def test_the_defaults_on_the_page_are_the_models() -> None:
    defaults = StokerConfig().model_dump(mode="json", by_alias=True)
    checked = 0
    for key in config.all_keys():
        if "[]" in key.path or key.variant == "kind: kubernetes" or not key.default.startswith("`"):
            continue
        shown = json.loads(key.default.strip("`"))
        assert shown == _value(defaults, key.path), key.path
        checked += 1
    assert checked > 40


def test_the_page_gives_type_bounds_default_and_description() -> None:
    page = config.markdown()
    rows = {line.split(" | ")[0].strip("| `"): line for line in page.splitlines()}
    assert rows["api.port"].startswith("| `api.port` | integer (>= 0, <= 65535) | `8080` | ")
    assert "number (>= 0.5, <= 0.9999) | `0.999` |" in rows["pools[].demand.quantile"]
    assert 'one of `kv`, `json` | `"kv"` |' in rows["log_format"]
    assert "matching `^[A-Za-z_][A-Za-z0-9_]*$`" in rows["store_options.schema"]
    assert "Poisson quantile" in rows["pools[].demand.quantile"]
    assert "(kind: kubernetes)" in rows["runtime.namespace"]
    assert "| `pools` | list of sections (length >= 1) | 1 built-in entry |" in page
    assert "## `intervals`" in page.splitlines()
