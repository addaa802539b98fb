"""The documentation site: its hook checks every link of the built site, and `mkdocs build
--strict` builds it with the generated reference pages; a broken link fails the build."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stoker.reference import CLI_PAGE, CONFIG_PAGE, METRICS_PAGE
from stoker.reference.site import broken_links

ROOT = Path(__file__).resolve().parents[2]
MKDOCS = Path(sys.executable).parent / "mkdocs"


def test_broken_links_names_missing_files_and_anchors(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "index.html").write_text('<h1 id="top">t</h1><a href="../a.html">a</a>')
    (tmp_path / "b.html").write_text('<h2 id="here">b</h2><img src="logo.png">')
    (tmp_path / "a.html").write_text(
        '<a href="b.html#here">ok</a> <a href="b.html#gone">anchor</a> '
        '<a href="c.html">file</a> <a href="sub/">dir</a> <a href="sub/#top">dir anchor</a> '
        '<a href="https://example.org/x.html">external</a> <a href="#self">self</a> '
        '<a id="self"></a> <a href="mailto:x@example.org">mail</a>'
    )
    assert broken_links(tmp_path) == [
        "a.html: b.html#gone (no such anchor)",
        "a.html: c.html (no such file)",
        "b.html: logo.png (no such file)",
    ]


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(MKDOCS), "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True,
        text=True,
        timeout=240,
        env={"PATH": str(MKDOCS.parent), "NO_MKDOCS_2_WARNING": "1", "HOME": str(site.parent)},
        check=False,
    )


@pytest.mark.slow
def test_the_site_builds_strict_with_the_generated_references(tmp_path: Path) -> None:
    result = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stderr
    site = tmp_path / "site"
    for page in (CONFIG_PAGE, CLI_PAGE, METRICS_PAGE):
        assert (site / page.replace(".md", ".html")).is_file(), page
    config = (site / "reference" / "configuration.html").read_text()
    assert "pools[].demand.quantile" in config and "STOKER_API__PORT" in config
    assert "stoker pools set" in (site / "reference" / "cli.html").read_text()
    assert "stoker_claims_total" in (site / "reference" / "metrics.html").read_text()
    assert "POST /v1/claims" in (site / "api.html").read_text()
    for page in ("getting-started", "concepts/fencing", "guides/kubernetes", "benchmarks/index"):
        assert (site / f"{page}.html").is_file(), page


@pytest.mark.slow
def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / "docs").mkdir(parents=True)
    shutil.copy(ROOT / "mkdocs.yml", project / "mkdocs.yml")
    text = (project / "mkdocs.yml").read_text()
    hook = ROOT / "src" / "stoker" / "reference" / "site.py"
    text = text.replace("src/stoker/reference/site.py", str(hook)).split("\nnav:")[0]
    (project / "mkdocs.yml").write_text(text + "\nnav:\n  - index.md\n")
    (project / "docs" / "index.md").write_text("# Home\n\n<a href='nowhere.html'>gone</a>\n")
    result = _build(project / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0
    assert "index.html: nowhere.html (no such file)" in result.stderr
