"""Templates as the store keeps them: rows written by every release load, and a template's
revision does not depend on the name its command line is stored under."""

from __future__ import annotations

from stoker.domain.pools import template_from_json, template_json
from stoker.domain.specs import ProcessTemplate, revision_of

TEMPLATE = ProcessTemplate(argv=("worker", "--port", "{port}"), env={"A": "1"}, memory_mb=128)


def test_a_process_template_is_stored_under_argv_which_every_release_reads() -> None:
    body = template_json(TEMPLATE)
    assert body["kind"] == "process" and body["argv"] == ["worker", "--port", "{port}"]
    assert template_from_json(body) == TEMPLATE


def test_a_row_that_names_the_command_line_command_loads_as_the_same_template() -> None:
    row = {"kind": "process", "command": ["worker", "--port", "{port}"], "env": {"A": "1"}}
    loaded = template_from_json({**row, "memory_mb": 128})
    assert loaded == TEMPLATE
    assert revision_of(loaded) == revision_of(TEMPLATE)


def test_a_row_without_a_kind_is_a_process_template() -> None:
    # Rows of the first releases with stored pools carried no kind.
    assert template_from_json({"argv": ["w"]}) == ProcessTemplate(argv=("w",))
