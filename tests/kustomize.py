"""The kustomize overlays of deploy/kubernetes/, rendered as `kubectl apply -k` would.

Shared by the manifest and monitoring tests. `kubectl kustomize` renders each overlay
once per test session; without kubectl the tests that render are skipped, except under
CI=true, where a missing kubectl fails them.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("single", "ha")


def kubectl() -> str:
    """kubectl's path (on PATH, or installed into this virtual environment by .ci/run);
    skips the test where kubectl is missing, unless CI=true."""
    found = shutil.which("kubectl") or shutil.which("kubectl", path=Path(sys.executable).parent)
    if found is not None:
        return found
    if os.environ.get("CI") == "true":
        pytest.fail("kubectl is not installed: CI renders the kustomize overlays with it")
    pytest.skip("kubectl is not installed: `kubectl kustomize` renders the overlays")


@functools.cache
def _rendered(overlay: str) -> str:
    result = subprocess.run(
        [kubectl(), "kustomize", str(DEPLOY / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def documents(overlay: str = "ha") -> list[dict[str, Any]]:
    """Every object `kubectl kustomize` renders for `overlay`, in its order (a fresh copy)."""
    return [doc for doc in yaml.safe_load_all(_rendered(overlay)) if doc is not None]


def one(kind: str, name: str | None = None, overlay: str = "ha") -> dict[str, Any]:
    """The one object of `kind` (named `name`, or with a generated name `name-<hash>`)."""
    matches = [
        doc
        for doc in documents(overlay)
        if doc["kind"] == kind
        and (
            name is None
            or doc["metadata"]["name"] == name
            or re.fullmatch(rf"{re.escape(name)}-[a-z0-9]{{10}}", doc["metadata"]["name"])
        )
    ]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


def stoker_yaml(overlay: str = "ha") -> dict[str, Any]:
    """The configuration file the overlay mounts (the generated ConfigMap's stoker.yaml)."""
    text = one("ConfigMap", "stoker-config", overlay)["data"]["stoker.yaml"]
    config: dict[str, Any] = yaml.safe_load(text)
    return config
