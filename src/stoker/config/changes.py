"""What an admin changes in a stored pool, validated by the config's own models.

A pool's template is one model whatever its source (`ProcessConfig` for a local process,
`PodConfig` for a pod): the config file builds it through `template_of`, and a rollout's
new template is the stable one's fields (`template_fields`, in the config's words:
`command`, `env`, ...) with the changed fields laid over them, validated again as a whole
(`changed_template`). A pool's tunable settings change through `SettingsChange`, whose
fields are `PoolSpec`'s with their bounds. Both models are strict, so nothing that is
accepted can fail later in a janitor pass or a spawn.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import ConfigDict, Field, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from stoker.config.pools import PodConfig, ProcessConfig
from stoker.config.schema import DerivedSection, derived_section, spec_values
from stoker.domain.pools import GENERATION_MAX, TUNABLE_SETTINGS
from stoker.domain.specs import PodTemplate, PoolSpec, ProcessTemplate, RuntimeTemplate

#: Names a template field had before it was renamed, and what it is called now.
RENAMED_FIELDS = {"argv": "command"}


def template_of(model: ProcessConfig | PodConfig) -> RuntimeTemplate:
    """The domain's template of a validated `ProcessConfig` or `PodConfig`."""
    if isinstance(model, ProcessConfig):
        process = spec_values(model, ProcessTemplate, omit={"argv"})
        return ProcessTemplate(argv=tuple(model.command), **process)
    values = spec_values(model, PodTemplate)
    for name in ("command", "args", "tolerations"):
        values[name] = tuple(values[name])
    return PodTemplate(**values)


def template_fields(template: RuntimeTemplate) -> dict[str, Any]:
    """A template's fields in the config's words (a process's `command`, a pod's keys)."""
    if isinstance(template, ProcessTemplate):
        return {
            "command": list(template.argv),
            "env": dict(template.env),
            "cwd": template.cwd,
            "memory_mb": template.memory_mb,
        }
    return {
        "image": template.image,
        "command": list(template.command),
        "args": list(template.args),
        "env": dict(template.env),
        "cpu": template.cpu,
        "memory": template.memory,
        "port": template.port,
        "node_selector": dict(template.node_selector),
        "tolerations": [dict(t) for t in template.tolerations],
        "priority_class": template.priority_class,
        "service_account": template.service_account,
        "labels": dict(template.labels),
        "annotations": dict(template.annotations),
    }


def changed_template(stable: RuntimeTemplate, changes: Mapping[str, Any]) -> RuntimeTemplate:
    """The stable template with `changes` laid over it, validated as a whole by the model
    of its kind; `ValidationError` (its locations are the changed fields') otherwise."""
    model: type[ProcessConfig] | type[PodConfig] = (
        ProcessConfig if isinstance(stable, ProcessTemplate) else PodConfig
    )
    renamed = [
        InitErrorDetails(
            type=PydanticCustomError(
                "renamed_field",
                "is not a known field: a process's command line is `{now}`",
                {"now": RENAMED_FIELDS[name]},
            ),
            loc=(name,),
            input=changes[name],
        )
        for name in changes
        if model is ProcessConfig and name in RENAMED_FIELDS
    ]
    if renamed:
        raise ValidationError.from_exception_data("template", renamed)
    return template_of(model.model_validate({**template_fields(stable), **changes}))


class _SettingsBase(DerivedSection):
    model_config = ConfigDict(strict=True)

    #: The generation the change was made from (or send `If-Match`); a stale one is a 412.
    generation: int | None = Field(None, ge=1, le=GENERATION_MAX)


def _settings_fields() -> dict[str, Any]:
    """`PoolSpec`'s tunable settings, each optional (left out: it keeps its value)."""
    hints = typing.get_type_hints(PoolSpec, include_extras=True)
    return {name: (hints[name] | None, Field(None)) for name in TUNABLE_SETTINGS}


if TYPE_CHECKING:
    SettingsChange = _SettingsBase
else:
    SettingsChange = derived_section(
        "PoolPatch",
        _SettingsBase,
        """The tunable settings to change (docs/guides/rollouts.md); those left out
        keep their value, and so do those sent as null but for `hot_idle_ttl`, which null
        sets back to the default (60 s). Types and bounds are the config file's, strictly:
        `true` or `"3"` is not a number.""",
        _settings_fields(),
    )
