"""The MkDocs hook of the documentation site (`hooks:` in mkdocs.yml).

At every build it adds the reference pages generated from the code (`stoker.reference`)
to the site, so they can never drift from the code, and once the site is built it checks
every link of every page: a relative link must name a file of the built site and an
anchor (`page.html#id`) an element of that page. A broken one fails the build, strict or
not. The HTTP API's page is the committed `docs/api.md` (`python -m stoker.api.reference
docs`), which a test keeps equal to the routes.
"""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path, PurePosixPath
from urllib.parse import unquote, urlsplit

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

from stoker.reference import pages


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the generated reference pages to the site's files."""
    for path, text in pages().items():
        files.append(File.generated(config, path, content=text))
    return files


class _Links(HTMLParser):
    """The ids and the link targets (href, src) of one HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.targets: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name in ("id", "name"):
                self.ids.add(value)
            elif name in ("href", "src"):
                self.targets.append(value)


def broken_links(site: Path) -> list[str]:
    """Every relative link of the built site at `site` that names no file or no anchor."""
    parsed: dict[Path, _Links] = {}

    def parse(page: Path) -> _Links:
        if page not in parsed:
            links = _Links()
            links.feed(page.read_text(encoding="utf-8", errors="replace"))
            parsed[page] = links
        return parsed[page]

    broken = []
    for page in sorted(site.rglob("*.html")):
        for target in parse(page).targets:
            parts = urlsplit(target)
            if parts.scheme or parts.netloc or target.startswith(("data:", "mailto:")):
                continue
            path = unquote(parts.path)
            if path.startswith("/"):
                where = site / path.lstrip("/")
            else:
                where = page.parent / PurePosixPath(path) if path else page
            if where.is_dir():
                where = where / "index.html"
            where = where.resolve()
            name = page.relative_to(site)
            if not where.is_file():
                broken.append(f"{name}: {target} (no such file)")
            elif (
                parts.fragment
                and where.suffix == ".html"
                and unquote(parts.fragment) not in parse(where).ids
            ):
                broken.append(f"{name}: {target} (no such anchor)")
    return broken


def on_post_build(config: MkDocsConfig) -> None:
    """Fail the build on a broken link of the built site."""
    broken = broken_links(Path(config.site_dir))
    if broken:
        raise PluginError(
            f"{len(broken)} broken link(s) in the built site:\n  " + "\n  ".join(broken)
        )
