"""The documentation site's reference pages, generated from the code.

- `config`: every key of the configuration file, from the config models;
- `commands`: every command and option of the `stoker` command line, from its definitions;
- `metrics`: every series `/metrics` exports, from the Prometheus registry;
- `site`: the MkDocs hook that adds these pages (and the HTTP API's, from
  `stoker.api.reference`) to the site at build time and checks the built site's links.

`pages()` renders them all, by their path in the site. Each module also lists what lacks a
description (`undocumented`): the tests fail while that list is not empty.
"""

from __future__ import annotations

from stoker.reference import commands, config, metrics

#: Where the generated pages sit in the site (relative to docs/).
CONFIG_PAGE = "reference/configuration.md"
CLI_PAGE = "reference/cli.md"
METRICS_PAGE = "reference/metrics.md"


def pages() -> dict[str, str]:
    """The generated reference pages, by path relative to the docs directory."""
    return {
        CONFIG_PAGE: config.markdown(),
        CLI_PAGE: commands.markdown(),
        METRICS_PAGE: metrics.markdown(),
    }


__all__ = ["CLI_PAGE", "CONFIG_PAGE", "METRICS_PAGE", "pages"]
