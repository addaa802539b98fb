"""The container image's Dockerfile: lint-clean, and buildable by construction.

No container engine runs where these tests run, so the image is never built here.
Instead each thing a build relies on is checked with the real parts: hadolint (the
linter's own binary, from the dev dependencies) passes; every file the build context
must hold exists and is admitted by `.dockerignore`; a wheel built from exactly those
files (as the builder stage builds it) carries the package and the `stoker` console
script the entry point names; and the image's own environment, entry point and
HEALTHCHECK command, run here against a real `stoker serve`, start a server that the
health check finds ready (and report a stopped one as unhealthy).
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from servers import environment, kill_fleet, start_server, wait_until
from stoker.config import StokerConfig

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
HADOLINT = Path(sys.executable).with_name("hadolint")
#: The Deployment's securityContext runs the container as this user and group.
DEPLOYMENT_UID = 10001


@dataclass
class Instruction:
    keyword: str
    arguments: str

    def exec_form(self) -> list[str]:
        """The JSON array of an exec-form ENTRYPOINT/CMD (failing on the shell form)."""
        value = json.loads(self.arguments)
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), value
        return value


def instructions(text: str) -> list[Instruction]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    found: list[Instruction] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        whole = (pending + stripped).strip()
        pending = ""
        keyword, _, arguments = whole.partition(" ")
        found.append(Instruction(keyword.upper(), arguments.strip()))
    return found


def stages() -> list[list[Instruction]]:
    """The instructions of each build stage, each list starting with its FROM."""
    result: list[list[Instruction]] = []
    for instruction in instructions(DOCKERFILE.read_text()):
        if instruction.keyword == "FROM":
            result.append([])
        if result:
            result[-1].append(instruction)
    return result


def final_stage() -> list[Instruction]:
    return stages()[-1]


def only(stage: list[Instruction], keyword: str) -> Instruction:
    matches = [i for i in stage if i.keyword == keyword]
    assert len(matches) == 1, f"expected one {keyword}, found {len(matches)}"
    return matches[0]


def context_sources() -> list[str]:
    """What the COPY instructions take from the build context (not from another stage)."""
    sources = []
    for instruction in instructions(DOCKERFILE.read_text()):
        if instruction.keyword in ("COPY", "ADD"):
            words = shlex.split(instruction.arguments)
            if any(w.startswith("--from=") for w in words):
                continue
            sources += [w for w in words if not w.startswith("--")][:-1]
    return sources


def admitted(path: str, patterns: list[str]) -> bool:
    """Whether `.dockerignore` lets `path` into the build context (the last matching
    pattern wins; a pattern on a folder covers what is inside it)."""
    parts = path.strip("/").split("/")
    keep = True
    for pattern in patterns:
        negated = pattern.startswith("!")
        body = pattern.lstrip("!").strip("/")
        prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
        if any(fnmatch.fnmatchcase(p, body) for p in prefixes) or fnmatch.fnmatchcase(
            "/".join(parts), body.removeprefix("**/")
        ):
            keep = negated
    return keep


def ignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


# -- lint ------------------------------------------------------------------------------------


def test_hadolint_passes() -> None:
    result = subprocess.run(
        [str(HADOLINT), "--no-color", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_rejects_what_it_should(tmp_path: Path) -> None:
    """The linter is live: an unpinned apt install that keeps its lists is reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text(DOCKERFILE.read_text() + "RUN apt-get update && apt-get install curl\n")
    result = subprocess.run(
        [str(HADOLINT), "--no-color", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert "DL3008" in result.stdout and "DL3009" in result.stdout


# -- the shape of the image ------------------------------------------------------------------


def test_a_builder_stage_and_a_final_stage_from_the_same_slim_python() -> None:
    """Two stages from one base (the virtual environment's interpreter path must exist in
    both); the base is a slim Python 3.11 image."""
    builder, final = stages()
    base = shlex.split(builder[0].arguments)[0]
    assert shlex.split(final[0].arguments) == [base]
    assert shlex.split(builder[0].arguments)[1:] == ["AS", "builder"]
    [default] = [
        i.arguments.partition("=")[2]
        for i in instructions(DOCKERFILE.read_text())
        if i.keyword == "ARG" and i.arguments.startswith("PYTHON_IMAGE=")
    ]
    assert base == "${PYTHON_IMAGE}"
    assert default.startswith("python:3.11-slim")


def test_the_final_stage_installs_nothing_and_runs_as_the_deployments_user() -> None:
    """No package manager, compiler or pip runs in the final stage; it only copies the
    built environment, and runs as a non-root user with the Deployment's uid and gid."""
    final = final_stage()
    for instruction in final:
        if instruction.keyword == "RUN":
            for tool in ("pip", "apt-get", "apt ", "gcc", "setuptools", "wheel"):
                assert tool not in instruction.arguments, instruction.arguments
    [copy] = [i for i in final if i.keyword == "COPY"]
    assert copy.arguments.split() == ["--from=builder", "/opt/stoker", "/opt/stoker"]
    user = only(final, "USER").arguments
    assert user == f"{DEPLOYMENT_UID}:{DEPLOYMENT_UID}"


def test_the_build_context_holds_what_the_copies_need() -> None:
    """Every COPY source exists in the repository and is admitted by .dockerignore, and
    .dockerignore keeps the virtual environments, tests and git history out."""
    patterns = ignore_patterns()
    sources = context_sources()
    assert sorted(sources) == ["README.md", "pyproject.toml", "requirements/all.lock", "src"]
    for source in sources:
        assert (ROOT / source).exists(), source
        assert admitted(source, patterns), source
        assert admitted(f"{source}/stoker/cli/__init__.py" if source == "src" else source, patterns)
    for kept_out in (".venv", ".git", "tests", "stoker.db", "src/stoker/__pycache__"):
        assert not admitted(kept_out, patterns), kept_out


def test_the_wheel_builds_from_the_context_alone(tmp_path: Path) -> None:
    """Build the wheel from a copy of just the COPY sources (as the builder stage does):
    it holds the package, and its `stoker` console script is the entry point's command."""
    context = tmp_path / "context"
    context.mkdir()
    for source in context_sources():
        (context / source).parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / source).is_dir():
            shutil.copytree(
                ROOT / source,
                context / source,
                ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
            )
        else:
            shutil.copy(ROOT / source, context / source)
    wheels = tmp_path / "wheels"
    result = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"),
            *("-q", "--wheel-dir", str(wheels), str(context)),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    [wheel] = wheels.glob("stoker-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        [entry_points] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = archive.read(entry_points).decode()
    assert {"stoker/cli/__init__.py", "stoker/api/app.py", "stoker/demo_worker.py"} <= names
    command = only(final_stage(), "ENTRYPOINT").exec_form()
    assert command == ["stoker", "serve"]
    assert "[console_scripts]\nstoker = stoker.cli:main" in scripts


def install_step() -> str:
    """The builder stage's RUN that builds and installs the package."""
    [builder, _] = stages()
    [run] = [i.arguments for i in builder if i.keyword == "RUN" and "pip" in i.arguments]
    return run


def test_the_image_installs_the_extras_a_kubernetes_deployment_needs() -> None:
    """The wheel is installed with the postgres, kubernetes and tracing extras (tracing is
    off until configured), which the package declares (and not the simulator's)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = set(project["optional-dependencies"])
    match = re.search(r'"\$1\[([a-z,]+)\]"', install_step())
    assert match, install_step()
    assert match.group(1).split(",") == ["postgres", "kubernetes", "tracing"]
    assert {"postgres", "kubernetes", "tracing"} <= declared


def test_the_lock_file_becomes_pinned_constraints(tmp_path: Path) -> None:
    """The install step's sed turns the hashed lock file into one `name==version` pin a
    line (the constraints pip installs with), covering the extras' packages."""
    command = install_step().partition(" > ")[0]
    assert command.startswith("sed ")
    result = subprocess.run(
        ["sh", "-c", command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    pins = [Requirement(line) for line in result.stdout.splitlines()]
    assert pins and all(
        len(p.specifier) == 1 and next(iter(p.specifier)).operator == "==" for p in pins
    )
    names = {p.name for p in pins}
    assert {"fastapi", "uvicorn", "psycopg", "lightkube"} <= names


# -- the image's environment, entry point and health check, run for real -------------------


def image_environment() -> dict[str, str]:
    """The final stage's ENV (PATH left out: the test runs the venv's `stoker`)."""
    values: dict[str, str] = {}
    for instruction in final_stage():
        if instruction.keyword == "ENV":
            for word in shlex.split(instruction.arguments):
                key, _, value = word.partition("=")
                values[key] = value
    values.pop("PATH")
    return values


def healthcheck(port: int) -> subprocess.CompletedProcess[str]:
    """Run the HEALTHCHECK's command as Docker would, with the image's environment."""
    instruction = only(final_stage(), "HEALTHCHECK")
    _, _, command = instruction.arguments.partition(" CMD ")
    argv = json.loads(command)
    assert argv[0] == "python" and "curl" not in command and "wget" not in command
    assert "/readyz" in command
    return subprocess.run(
        [sys.executable, *argv[1:]],
        env=environment(**(image_environment() | {"STOKER_API__PORT": str(port)})),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.mark.processes
def test_the_image_starts_a_server_its_health_check_finds_ready(tmp_path: Path) -> None:
    """With the image's ENV (listening on all interfaces, so tokens are required) and an
    admin token, `stoker serve` (the entry point) starts on the built-in defaults, and
    the HEALTHCHECK command exits 0 once /readyz answers; after the server stops it fails."""
    port = free_port()
    env = environment(
        **image_environment()
        | {
            "STOKER_API__PORT": str(port),
            "STOKER_API__ADMIN_TOKENS": "image-test-admin-token-0123456789",
        }
    )
    fleet = StokerConfig(store=f"sqlite:///{tmp_path}/stoker.db").fleet_name()
    server = start_server(tmp_path, env=env, args=["--stop-workers"])
    try:
        assert server.url.endswith(f":{port}")
        assert wait_until(lambda: healthcheck(port).returncode == 0, timeout=60, interval=0.5)
    finally:
        assert server.stop(signal.SIGTERM) == 0
        kill_fleet(fleet)
    failed = healthcheck(port)
    assert failed.returncode != 0
    assert "Connection refused" in failed.stderr


def test_the_image_refuses_to_listen_openly_without_tokens(tmp_path: Path) -> None:
    """The image listens on all interfaces: without a token `stoker serve` says so in one
    line and exits 1 (the README's `docker run` passes one)."""
    result = subprocess.run(
        [str(Path(sys.executable).with_name("stoker")), "serve"],
        cwd=tmp_path,
        env=environment(**(image_environment() | {"STOKER_API__PORT": str(free_port())})),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert "no tokens are configured" in result.stderr
    assert "Traceback" not in result.stderr
