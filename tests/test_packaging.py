"""What a `pip install` of stoker brings, and what an application importing it loads.

The wheel is built from this tree (with the locked build backend, no download) and read as
pip reads it; the lock files are checked against pyproject's ranges; the SDK import and the
shipped scenarios are checked in fresh `python` / `stoker` processes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
import zipfile
from email.message import Message
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from servers import STOKER, environment

ROOT = Path(__file__).resolve().parents[1]
LOCKS = ("dev", "all")
PIP_WHEEL = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
SCALETEST = ["scaletest", "cold-ramp", "--short", "--policy", "stoker", "--no-progress"]
#: What the base install must not bring: the store, cluster and plotting libraries.
HEAVY = {"psycopg", "psycopg-binary", "psycopg-pool", "lightkube", "lightkube-models"}
HEAVY |= {"matplotlib", "numpy", "pillow"}


@pytest.fixture(scope="module")
def metadata(tmp_path_factory: pytest.TempPathFactory) -> tuple[Message, list[str]]:
    """The METADATA of a wheel built from this tree, and the wheel's file names."""
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy: setuptools leaves build/ behind, whose stale files a later wheel
    # built in place would ship.
    tree = tmp_path_factory.mktemp("tree")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "src", tree / "src", ignore=ignore)
    subprocess.run(
        [*PIP_WHEEL, "-w", str(out), str(tree)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    [wheel] = out.glob("stoker-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        [meta] = [n for n in names if n.endswith(".dist-info/METADATA")]
        text = archive.read(meta).decode()
    return Parser().parsestr(text), names


def platform() -> dict[str, str]:
    """This interpreter's marker environment (as `Marker.evaluate` takes it)."""
    return {key: str(value) for key, value in default_environment().items()}


def requires(meta: Message, extra: str | None) -> set[str]:
    """The distributions a `pip install stoker[extra]` (None: no extra) asks for, on Linux
    and Python 3.11, following `stoker[...]` self-references."""
    env = platform() | {"sys_platform": "linux", "python_version": "3.11"}
    wanted, todo = {"", *([extra] if extra else [])}, True
    names: set[str] = set()
    while todo:
        todo = False
        for line in meta.get_all("Requires-Dist") or []:
            req = Requirement(line)
            if not any(
                req.marker is None or req.marker.evaluate(env | {"extra": e}) for e in wanted
            ):
                continue
            if canonicalize_name(req.name) == "stoker":
                todo |= not req.extras <= wanted
                wanted |= req.extras
            else:
                names.add(canonicalize_name(req.name))
    return names


def test_the_base_install_brings_no_store_cluster_or_plot_library(
    metadata: tuple[Message, list[str]],
) -> None:
    meta, _ = metadata
    base = requires(meta, None)
    assert {"fastapi", "uvicorn", "httpx", "pydantic", "typer"} <= base
    assert not base & HEAVY, base & HEAVY


@pytest.mark.parametrize(
    ("extra", "brings"),
    [
        ("postgres", {"psycopg", "psycopg-pool"}),
        ("kubernetes", {"lightkube", "lightkube-models"}),
        ("sim", {"matplotlib"}),
        ("all", {"psycopg", "psycopg-pool", "lightkube", "matplotlib"}),
        ("dev", {"psycopg", "lightkube", "matplotlib", "pytest", "mypy"}),
    ],
)
def test_each_extra_brings_its_libraries(
    metadata: tuple[Message, list[str]], extra: str, brings: set[str]
) -> None:
    meta, _ = metadata
    assert brings <= requires(meta, extra)


def test_tracing_is_an_extra_of_its_own(metadata: tuple[Message, list[str]]) -> None:
    meta, _ = metadata
    otel = {"opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http"}
    assert not requires(meta, None) & otel
    assert otel <= requires(meta, "tracing") and otel <= requires(meta, "all")


def test_no_dependency_is_pinned_exactly(metadata: tuple[Message, list[str]]) -> None:
    meta, _ = metadata
    reqs = [Requirement(r) for r in meta.get_all("Requires-Dist") or []]
    assert len(reqs) > 20
    pinned = [str(r) for r in reqs if any(s.operator in ("==", "===") for s in r.specifier)]
    assert pinned == []


def test_the_wheel_carries_the_readme_as_its_long_description(
    metadata: tuple[Message, list[str]],
) -> None:
    # What PyPI shows on the project's page: the README, as Markdown.
    meta, _ = metadata
    assert meta["Description-Content-Type"] == "text/markdown"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert str(meta.get_payload()).strip() == readme.strip()


def test_the_version_is_written_in_one_place(metadata: tuple[Message, list[str]]) -> None:
    # pyproject reads it from stoker/_version.py; the wheel, the package, the command
    # and the changelog say the same.
    from stoker import __version__

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]
    meta, _ = metadata
    assert meta["Version"] == __version__
    shown = subprocess.run(
        [STOKER, "--version"], capture_output=True, text=True, check=True, env=environment()
    )
    assert shown.stdout.strip() == f"stoker {__version__}"
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert "## [Unreleased]" in changelog
    assert f"## [{__version__}] - " in changelog


def test_the_wheel_ships_the_scenarios_and_the_type_marker(
    metadata: tuple[Message, list[str]],
) -> None:
    _, names = metadata
    shipped = {Path(n).stem for n in names if n.startswith("stoker/sim/scenarios/")}
    assert {"cold-ramp", "claim-burst", "leader-blip"} <= shipped
    assert "stoker/py.typed" in names


def test_the_wheel_ships_the_pages_static_files(metadata: tuple[Message, list[str]]) -> None:
    _, names = metadata
    static = "stoker/api/static/"
    for name in (
        "ui/index.html",
        "ui/dashboard.js",
        "ui/dashboard.css",
        "vendor/swagger-ui/swagger-ui-bundle.js",
        "vendor/swagger-ui/swagger-ui.css",
        "vendor/swagger-ui/LICENSE",
        "vendor/redoc/redoc.standalone.js",
        "vendor/redoc/LICENSE",
    ):
        assert static + name in names, name


def locked(name: str) -> dict[str, list[tuple[Version, Requirement]]]:
    """The pins of requirements/NAME.lock: name -> [(version, the pin with its marker)]."""
    pins: dict[str, list[tuple[Version, Requirement]]] = {}
    text = (ROOT / "requirements" / f"{name}.lock").read_text(encoding="utf-8")
    for line in text.splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            req = Requirement(line.rstrip(" \\"))
            [spec] = req.specifier
            assert spec.operator == "==", line
            pins.setdefault(canonicalize_name(req.name), []).append((Version(spec.version), req))
    return pins


def declared(extra: str) -> list[Requirement]:
    """pyproject's requirements of the base install plus `extra` (and what it includes)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    todo, seen = [extra], set()
    while todo:
        name = todo.pop()
        seen.add(name)
        for line in project["optional-dependencies"][name]:
            req = Requirement(line)
            if req.name == "stoker":
                todo += [e for e in req.extras if e not in seen]
            else:
                reqs.append(req)
    return reqs


@pytest.mark.parametrize("lock", LOCKS)
def test_the_lock_satisfies_every_range_of_pyproject(lock: str) -> None:
    """A range changed in pyproject without `make lock` fails here, not on a fresh machine."""
    pins = locked(lock)
    for req in declared(lock):
        versions = pins.get(canonicalize_name(req.name))
        assert versions, f"{req.name} is not in requirements/{lock}.lock: run make lock"
        for version, _ in versions:
            assert req.specifier.contains(version, prereleases=True), (
                f"requirements/{lock}.lock pins {req.name} {version}, outside {req.specifier}: "
                "run make lock"
            )


@pytest.mark.parametrize("lock", LOCKS)
def test_every_pin_has_hashes(lock: str) -> None:
    """pip installs a lock with hashes in hash-checking mode: a pin without one fails there."""
    lines = (ROOT / "requirements" / f"{lock}.lock").read_text(encoding="utf-8").splitlines()
    pins = [i for i, line in enumerate(lines) if line and not line[0].isspace() and line[0] != "#"]
    assert pins
    for i in pins:
        assert lines[i + 1].startswith("    --hash=sha256:"), lines[i]


def test_the_installed_environment_matches_the_lock() -> None:
    """`make install` installed exactly the pins of requirements/dev.lock (this platform's)."""
    from importlib.metadata import distributions

    env = platform()
    installed: dict[str, Version] = {
        canonicalize_name(d.metadata["Name"]): Version(d.version) for d in distributions()
    }
    for name, versions in locked("dev").items():
        wanted = [v for v, req in versions if req.marker is None or req.marker.evaluate(env)]
        if wanted:
            assert installed.get(name) in wanted, (name, installed.get(name), wanted)


def test_importing_the_sdk_loads_no_server_store_or_cluster_library() -> None:
    code = (
        "import json, sys, stoker\n"
        "stoker.Client, stoker.AsyncClient, stoker.StokerError\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    loaded = set(json.loads(result.stdout))
    assert "httpx" in loaded and "stoker" in loaded
    forbidden = {"fastapi", "uvicorn", "starlette", "psycopg", "psycopg_pool", "lightkube"}
    forbidden |= {"matplotlib", "numpy", "aiohttp", "sqlite3", "psutil", "uvloop"}
    assert not loaded & forbidden, loaded & forbidden


@pytest.mark.processes
def test_scaletest_finds_a_shipped_scenario_from_an_empty_directory(tmp_path: Path) -> None:
    result = subprocess.run(
        [STOKER, *SCALETEST, "--out", "report"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=environment(),
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "scaletest cold-ramp (short)" in result.stdout
    summary = json.loads((tmp_path / "report" / "summary.json").read_text(encoding="utf-8"))
    assert summary
    assert (tmp_path / "report" / "report.md").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]
