"""The documentation in the repository points at what exists: every relative link of the
README and docs/ names a file of the tree, and every metric the operations guide alerts on
is one that stoker exports."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from stoker.control.metrics import Metrics

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_names_a_file(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    targets = [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]
    for target in targets:
        path = target.split("#", 1)[0]
        if path:
            assert (page.parent / path).exists(), f"{page.name} links to missing {target}"


#: Markdown files stoker writes (a scale test's report, `make docs`' API reference): named
#: in the code as outputs, not as documents to read.
WRITTEN = {"report.md", "api.md", "DIR/api.md", "backtest.md"}


def test_every_document_the_code_cites_is_in_the_repository() -> None:
    cited = {
        (source.relative_to(ROOT), name)
        for source in (ROOT / "src").rglob("*.py")
        for name in re.findall(r"[\w./-]+\.md\b", source.read_text(encoding="utf-8"))
    }
    assert cited
    missing = [
        f"{source} cites {name}"
        for source, name in sorted(cited)
        if name not in WRITTEN
        and not (ROOT / name).exists()
        and not (ROOT / "docs" / name).exists()
    ]
    assert missing == []


def test_the_docs_hold_architecture_operations_and_the_protocol() -> None:
    names = {p.name for p in PAGES}
    assert {"architecture.md", "operations.md", "worker-protocol.md", "api.md"} <= names


def exported() -> set[str]:
    """Every series name `/metrics` can show, counters with their `_total`."""
    metrics = Metrics()
    names = set()
    for family in metrics.registry.collect():
        names.add(family.name)
        names.add(f"{family.name}_total")
        names |= {f"{family.name}_{s}" for s in ("bucket", "sum", "count")}
    assert generate_latest(metrics.registry)
    return names


def test_every_metric_of_the_operations_guide_is_exported() -> None:
    text = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    named = set(re.findall(r"\bstoker_[a-z_]+", text))
    assert len(named) >= 10
    missing = named - exported()
    assert not missing, missing
