"""Only the lifecycle writes a worker or a claim.

The store port has a writer side (`StoreWriter`); `stoker.control.lifecycle` is the one
module that calls it. These tests read the source of the control plane, the API and the
simulator and fail on any call of a writer method on a store anywhere else, and on any
control module besides the composition that even names the writer side.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import stoker
from stoker.ports.store import ReplicaStore, Store, StoreReader, StoreWriter

SRC = Path(stoker.__file__).parent
CONTROL = SRC / "control"
#: The one module allowed to write, and the composition that hands it the writer.
LIFECYCLE = CONTROL / "lifecycle.py"
COMPOSITION = {CONTROL / "parts.py", CONTROL / "plane.py"}


def _methods(protocol: type) -> set[str]:
    return {
        name
        for name, value in vars(protocol).items()
        if not name.startswith("_") and inspect.isfunction(value)
    }


WRITES = _methods(StoreWriter)


def _dotted(node: ast.expr) -> str:
    """`self._store` for an attribute chain; "?" for anything else (a call, a subscript)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def writer_calls(source: str, *, control: bool) -> list[str]:
    """Calls of a writer method in `source`, as `receiver.method` at line N.

    In control code every receiver but the lifecycle counts (its own methods share some
    of the names: `reserve`, `bind`, `end_claim`); elsewhere, receivers named like a store.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in WRITES:
            continue
        receiver = _dotted(node.func.value)
        last = receiver.rsplit(".", 1)[-1].lower()
        if "lifecycle" in last:
            continue
        if control or "store" in receiver.lower():
            found.append(f"{receiver}.{node.func.attr} at line {node.lineno}")
    return found


def _modules(*packages: str) -> list[Path]:
    return sorted(p for package in packages for p in (SRC / package).rglob("*.py"))


def test_the_store_sides_do_not_overlap() -> None:
    reads, replica = _methods(StoreReader), _methods(ReplicaStore)
    assert WRITES, "the writer side lists no methods"
    assert reads <= {name for name in dir(ReplicaStore) if not name.startswith("_")}
    assert not WRITES & (reads | replica)
    # The union is every side, and nothing else: an adapter implements exactly these.
    assert {name for name in dir(Store) if not name.startswith("_")} == WRITES | reads | replica
    assert {"transition", "reserve", "bind", "end_claim", "renew_claim"} <= WRITES


@pytest.mark.parametrize(
    "path", _modules("control", "api", "sim"), ids=lambda p: str(p.relative_to(SRC))
)
def test_no_module_but_the_lifecycle_writes_workers_or_claims(path: Path) -> None:
    if path == LIFECYCLE:
        return
    calls = writer_calls(path.read_text(), control=path.is_relative_to(CONTROL))
    assert calls == [], f"{path.relative_to(SRC)} writes through the store: {calls}"


@pytest.mark.parametrize("path", _modules("control"), ids=lambda p: p.name)
def test_control_parts_are_handed_the_reader_only(path: Path) -> None:
    """Every control part types its store as a reader: only the lifecycle and the
    composition that builds it name the writer side (or the union that includes it)."""
    if path == LIFECYCLE or path in COMPOSITION:
        return
    named = {
        alias.name
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module == "stoker.ports.store"
        for alias in node.names
    }
    assert not named & {"Store", "StoreWriter"}, f"{path.name} imports {named}"


def test_the_check_finds_a_write_outside_the_lifecycle() -> None:
    """The rule above can fail: a write through a store is found, the lifecycle's own
    methods and non-store receivers in other packages are not."""
    control = """
async def settle(self, worker):
    await self._lifecycle.reserve(worker, org="a", org_cap=0, owner="me")
    await self._store.transition(worker.id, expect=worker.state, epoch=1, to=worker.state, now=0)
    await self._reader.bind(worker.id, epoch=1, claim=None, now=0)
"""
    assert writer_calls(control, control=True) == [
        "self._store.transition at line 4",
        "self._reader.bind at line 5",
    ]
    api = """
sock.bind(address)
await plane.store.end_claim("c-1", state=None, worker_to=None, now=0)
"""
    assert writer_calls(api, control=False) == ["plane.store.end_claim at line 3"]
