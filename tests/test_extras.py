"""A feature whose extra is not installed says which one to install, never a traceback.

The extras are installed in the test environment, so their absence is simulated: a module
set to None in `sys.modules` fails to import exactly as a missing one does (in this process
through monkeypatch, in a `stoker` process through a one-line wrapper of its entry point).
"""

from __future__ import annotations

import importlib.abc
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import pytest

from servers import environment
from stoker.bootstrap import build_control_plane, build_store
from stoker.config import load_config
from stoker.domain.errors import ConfigError
from stoker.extras import EXTRAS, missing_extra

#: Runs `stoker ARGS` with the comma-separated modules of argv[1] made unimportable.
WITHOUT = (
    "import sys; sys.modules.update(dict.fromkeys(sys.argv.pop(1).split(','))); "
    "from stoker.cli import main; main()"
)


def stoker_without(
    modules: Sequence[str], args: Sequence[str], cwd: Path
) -> subprocess.CompletedProcess[str]:
    """Run the `stoker` command with `modules` missing."""
    return subprocess.run(
        [sys.executable, "-c", WITHOUT, ",".join(modules), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        env=environment(),
        stdin=subprocess.DEVNULL,
        check=False,
    )


def block(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_an_installed_extra_is_not_missing(extra: str) -> None:
    assert missing_extra(extra, "it") is None


@pytest.mark.parametrize(("extra", "module"), [(e, m) for e, ms in EXTRAS.items() for m in ms])
def test_a_missing_module_names_its_extra(
    monkeypatch: pytest.MonkeyPatch, extra: str, module: str
) -> None:
    block(monkeypatch, module)
    assert missing_extra(extra, "the feature") == (
        f"the feature needs the '{extra}' extra: pip install 'stoker[{extra}]'"
    )


class _Broken(importlib.abc.MetaPathFinder):
    """Finds psycopg and fails to load it, as psycopg does without a libpq."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> None:
        if fullname == "psycopg":
            raise ImportError("no pq wrapper available")
        return None


def test_an_extra_that_does_not_load_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "psycopg", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_Broken(), *sys.meta_path])
    problem = missing_extra("postgres", "the postgres store")
    assert problem == (
        "the postgres store needs the 'postgres' extra, which does not load "
        "(no pq wrapper available): pip install 'stoker[postgres]'"
    )


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "stoker.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_a_postgres_store_without_psycopg_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load_config(
        _config(
            tmp_path,
            "store: postgresql://postgres@127.0.0.1:1/none\n"
            "activation: {key: 'kkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkk'}\n",
        )
    ).config
    block(monkeypatch, "psycopg_pool")
    message = "config error: store: the postgres store needs the 'postgres' extra: " + (
        "pip install 'stoker[postgres]'"
    )
    with pytest.raises(ConfigError) as built:
        build_control_plane(config)
    assert str(built.value) == message
    with pytest.raises(ConfigError) as store:
        build_store(config)
    assert str(store.value) == message


def test_a_kubernetes_runtime_without_lightkube_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load_config(
        _config(
            tmp_path,
            "runtime: {kind: kubernetes}\npools:\n  - {name: db, pod: {image: 'worker:1'}}\n",
        )
    ).config
    block(monkeypatch, "lightkube")
    with pytest.raises(ConfigError) as built:
        build_control_plane(config)
    assert str(built.value) == (
        "config error: runtime.kind: the kubernetes runtime needs the 'kubernetes' extra: "
        "pip install 'stoker[kubernetes]'"
    )


@pytest.mark.processes
def test_serve_on_postgres_without_psycopg_is_one_line(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        "store: postgresql://postgres@127.0.0.1:1/none\napi: {port: 0}\n"
        "activation: {key: 'kkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkk'}\n",
    )
    result = stoker_without(["psycopg", "psycopg_pool"], ["serve", "-c", str(config)], tmp_path)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [
        "config error: store: the postgres store needs the 'postgres' extra: "
        f"pip install 'stoker[postgres]' (from {config})"
    ]
    assert "listening" not in result.stdout


@pytest.mark.processes
def test_scaletest_without_matplotlib_is_one_line_before_the_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = stoker_without(["matplotlib"], ["scaletest", "cold-ramp", "--out", str(out)], tmp_path)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [
        "stoker: the scale test needs the 'sim' extra: pip install 'stoker[sim]'"
    ]
    assert not out.exists()


@pytest.mark.processes
@pytest.mark.slow
def test_scaletest_runs_with_the_sim_extra_alone(tmp_path: Path) -> None:
    # `pip install 'stoker[sim]'`: no lightkube, psycopg or OpenTelemetry. The simulator
    # runs the Kubernetes runtime's code, which must not need the Kubernetes library.
    others = [m for extra, ms in EXTRAS.items() if extra != "sim" for m in ms]
    result = stoker_without(
        [*others, "lightkube.utils.quantity"],
        ["scaletest", "cold-ramp", "--short", "--out", "r", "--no-progress", "-p", "stoker"],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert (tmp_path / "r" / "summary.json").is_file()


#: Which of stoker's modules may fail to import without an extra, by the extra they need:
#: the adapters that are the extra's whole point, loaded only after `missing_extra` said yes.
NEEDS_AN_EXTRA = {
    "stoker.adapters.cluster_lightkube": "kubernetes",
    "stoker.adapters.elector_k8s": "kubernetes",
    "stoker.adapters.tracing_otel": "tracing",
}
AUDIT = """
import importlib, pkgutil, sys
sys.modules.update(dict.fromkeys(sys.argv[1].split(',')))
import stoker
failed = []
for info in pkgutil.walk_packages(stoker.__path__, 'stoker.'):
    if info.name.endswith('__main__'):
        continue
    try:
        importlib.import_module(info.name)
    except ImportError as exc:
        failed.append(info.name)
print('\\n'.join(sorted(set(failed))))
"""


def test_only_the_extras_own_adapters_need_an_extra_to_import() -> None:
    # Every optional library missing at once: the rest of stoker imports, so that a
    # feature that lacks one reaches its one-line `missing_extra` check, not a traceback.
    # (OpenTelemetry's API comes with FastAPI in the base install; its SDK is the extra.)
    blocked = ["psycopg", "psycopg_pool", "lightkube", "matplotlib"]
    blocked += ["opentelemetry.sdk", "opentelemetry.exporter"]
    result = subprocess.run(
        [sys.executable, "-c", AUDIT, ",".join(blocked)],
        capture_output=True,
        text=True,
        timeout=120,
        env=environment(),
        check=True,
    )
    failed = set(result.stdout.split())
    allowed = {m for m in failed if m.startswith("stoker.adapters.postgres")}
    assert failed - allowed <= set(NEEDS_AN_EXTRA), result.stdout
