"""The documentation in the repository points at what exists: every relative link of the
README and docs/ names a file of the tree, every page of docs/ is in the site's navigation,
every benchmark page says how, where and when it measured, and every metric the
operations guide alerts on is one that stoker exports."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest

from stoker.control.metrics import Metrics
from stoker.reference import pages

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_names_a_file(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    targets = [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]
    # The reference pages the site generates at build time (stoker.reference) exist there.
    generated = {(ROOT / "docs" / name).resolve() for name in pages()}
    for target in targets:
        path = target.split("#", 1)[0]
        if path:
            where = page.parent / path
            assert where.exists() or where.resolve() in generated, (
                f"{page.name} links to missing {target}"
            )


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
        and name not in pages()
        and not (ROOT / name).exists()
        and not (ROOT / "docs" / name).exists()
        # the generated pages' own links, relative to docs/reference/
        and not (ROOT / "docs" / "reference" / name).resolve().exists()
    ]
    assert missing == []


def test_the_docs_hold_architecture_operations_and_the_protocol() -> None:
    names = {p.name for p in PAGES}
    assert {"architecture.md", "operations.md", "worker-protocol.md", "api.md"} <= names


def _nav_pages(entries: Any) -> set[str]:
    """The page paths of mkdocs.yml's `nav`."""
    found: set[str] = set()
    for entry in entries:
        values = entry.values() if isinstance(entry, dict) else [entry]
        for value in values:
            found |= _nav_pages(value) if isinstance(value, list) else {value}
    return found


def test_the_site_navigation_holds_every_page_and_the_issues_structure() -> None:
    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=yaml.Loader)
    nav = _nav_pages(config["nav"])
    written = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    # The generated reference pages are added at build time; every written page is in nav.
    assert nav - written == set(pages())
    assert written <= nav
    sections = [next(iter(entry)) for entry in config["nav"] if isinstance(entry, dict)]
    assert sections == [
        "Home",
        "Getting started",
        "Concepts",
        "Guides",
        "Reference",
        "Benchmarks",
    ]
    assert config["strict"] is True
    assert config["theme"]["name"] == "material"


@pytest.mark.parametrize(
    "page",
    sorted(p for p in (ROOT / "docs" / "benchmarks").glob("*.md") if p.name != "index.md"),
    ids=lambda p: p.name,
)
def test_every_benchmark_page_gives_its_command_machine_and_date(page: Path) -> None:
    head = page.read_text(encoding="utf-8").split("\n\n", 3)[1]
    rows = dict(re.findall(r"^\| (command|machine|measured) \| (.+) \|$", head, re.M))
    assert set(rows) == {"command", "machine", "measured"}, page.name
    assert "`" in rows["command"]
    assert "2 cores" in rows["machine"]
    assert re.search(r"\b20\d\d-\d\d-\d\d\b", rows["measured"])


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


def test_the_readme_is_a_newcomers_page_that_leads_into_the_site() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    for command in ("make serve", "make test", "make docs", "make docs-serve"):
        assert command in text, command
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings[:2] == ["Two commands", "A five-minute tour"], headings
    linked = set(LINK.findall(text))
    for page in (
        "docs/index.md",
        "docs/getting-started.md",
        "docs/architecture.md",
        "docs/guides/kubernetes.md",
        "docs/guides/replicas.md",
        "docs/operations.md",
        "docs/api.md",
        "docs/benchmarks/index.md",
    ):
        assert any(target.split("#")[0] == page for target in linked), page
    # The tour: serve, claim, use, release, and the dashboard.
    for step in ("**Claim**", "**Use**", "**Release**", "/ui"):
        assert step in text, step


def test_getting_started_shows_the_tour_the_quick_start_test_runs() -> None:
    text = (ROOT / "docs" / "getting-started.md").read_text(encoding="utf-8")
    for command in (
        "make serve",
        "stoker claim --pool demo --org acme | tee claim.json",
        'curl -H "Authorization: Bearer $TOKEN" "$ENDPOINT/"',
        "stoker release",
        "stoker status",
    ):
        assert command in text, command
