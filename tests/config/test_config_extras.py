"""A part the config selects whose extra is not installed: the error names the key that
selected it and where it was set, as the other checks after loading do.

The extras are installed in the test environment: a module set to None in `sys.modules`
fails to import exactly as a missing one does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from stoker.bootstrap import build_control_plane, check_extras
from stoker.config import load_config
from stoker.domain.errors import ConfigError

KEY = "activation: {key: 'kkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkk'}\n"
POSTGRES = "store: postgresql://postgres@127.0.0.1:1/none\n"
POD_POOL = "pools:\n  - {name: db, pod: {image: 'worker:1'}}\n"


def missing(extra: str, feature: str) -> str:
    return f"{feature} needs the {extra!r} extra: pip install 'stoker[{extra}]'"


def error_of(tmp_path: Path, text: str, env: dict[str, str], *modules: str) -> str:
    """The message of the checks after loading `text` (as `stoker.yaml`) with `modules`
    made unimportable, the file's path shown as `stoker.yaml`."""
    path = tmp_path / "stoker.yaml"
    path.write_text(text, encoding="utf-8")
    loaded = load_config(path, env)
    with pytest.MonkeyPatch.context() as patch:
        for module in modules:
            patch.setitem(sys.modules, module, None)
        with pytest.raises(ConfigError) as info, loaded.checking():
            check_extras(loaded.config)
        # `serve` builds the plane under the same checks: the same line.
        with pytest.raises(ConfigError) as built, loaded.checking():
            build_control_plane(loaded.config)
    assert str(built.value) == str(info.value)
    return str(info.value).replace(str(path), "stoker.yaml")


@pytest.mark.parametrize(
    ("text", "env", "module", "expected"),
    [
        (
            POSTGRES + KEY,
            {},
            "psycopg_pool",
            "config error: store: "
            + missing("postgres", "the postgres store")
            + " (from stoker.yaml)",
        ),
        (
            KEY,
            {"STOKER_STORE": "postgresql://postgres@127.0.0.1:1/none"},
            "psycopg_pool",
            "config error: store: "
            + missing("postgres", "the postgres store")
            + " (from STOKER_STORE)",
        ),
        (
            "runtime: {kind: kubernetes}\n" + POD_POOL,
            {},
            "lightkube",
            "config error: runtime.kind: "
            + missing("kubernetes", "the kubernetes runtime")
            + " (from stoker.yaml)",
        ),
        (
            POD_POOL,
            {"STOKER_RUNTIME__KIND": "kubernetes"},
            "lightkube",
            "config error: runtime.kind: "
            + missing("kubernetes", "the kubernetes runtime")
            + " (from STOKER_RUNTIME__KIND)",
        ),
        (
            "tracing: {enabled: true}\n",
            {},
            "opentelemetry.sdk.trace",
            "config error: tracing.enabled: "
            + missing("tracing", "tracing")
            + " (from stoker.yaml)",
        ),
    ],
)
def test_a_missing_extra_names_the_key_that_selected_it(
    tmp_path: Path, text: str, env: dict[str, str], module: str, expected: str
) -> None:
    assert error_of(tmp_path, text, env, module) == expected
