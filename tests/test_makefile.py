"""The Makefile's targets run what exists: `make demo` a module of the package, `make
bench` a runner whose every benchmark is a script of benchmarks/."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def recipe(target: str) -> list[str]:
    """The command lines of a Makefile target."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    match = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", text, re.MULTILINE)
    assert match, target
    return [line.strip() for line in match.group(1).splitlines()]


def test_make_demo_runs_a_module_of_the_package() -> None:
    [line] = recipe("demo")
    module = line.split(" -m ", 1)[1].split()[0]
    assert importlib.util.find_spec(module) is not None, module


def test_make_bench_runs_benchmarks_that_exist() -> None:
    [line] = recipe("bench")
    script = ROOT / line.split()[1]
    assert script.is_file(), script
    listed = subprocess.run(
        [sys.executable, str(script), "--list"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    names = [entry.split()[0] for entry in listed]
    assert {"core", "claim_burst", "scaletest", "stores"} <= set(names)
    for name in names:
        assert (ROOT / "benchmarks" / f"{name}.py").is_file(), name
    unknown = subprocess.run(
        [sys.executable, str(script), "no-such-benchmark"], capture_output=True, text=True
    )
    assert unknown.returncode == 2 and "unknown benchmark(s) no-such-benchmark" in unknown.stderr


def test_make_docs_writes_the_reference_into_docs_then_builds_the_site_strict() -> None:
    api, build = recipe("docs")
    assert api.endswith("-m stoker.api.reference docs")
    assert build.split()[-3:] == ["build", "--strict", "--clean"]
    assert "/mkdocs " in build


def test_make_docs_serve_serves_the_site() -> None:
    api, serve = recipe("docs-serve")
    assert api.endswith("-m stoker.api.reference docs")
    assert "/mkdocs serve --strict" in serve


def test_ci_builds_the_site() -> None:
    steps = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert "make docs VENV=.venv-ci" in steps
