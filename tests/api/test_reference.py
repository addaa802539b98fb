"""The API reference in docs/ is the one the routes give: regenerated, it is the same.

A route, a model or a description changed without `make docs` fails here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stoker.api.reference import MARKDOWN_FILE, OPENAPI_FILE, main, markdown, rendered

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.fixture(scope="module")
def fresh() -> dict[str, str]:
    return rendered()


@pytest.mark.parametrize("name", [OPENAPI_FILE, MARKDOWN_FILE])
def test_the_reference_in_docs_is_up_to_date(fresh: dict[str, str], name: str) -> None:
    committed = (DOCS / name).read_text(encoding="utf-8")
    assert committed == fresh[name], f"docs/{name} is stale: run `make docs`"


def test_the_page_documents_every_operation_and_schema(fresh: dict[str, str]) -> None:
    document = json.loads(fresh[OPENAPI_FILE])
    page = fresh[MARKDOWN_FILE]
    operations = [
        f"### {method.upper()} {path}"
        for path, item in document["paths"].items()
        for method in item
    ]
    assert len(operations) >= 10
    for heading in operations:
        assert heading in page.splitlines(), heading
    for name in document["components"]["schemas"]:
        assert f"### {name}" in page.splitlines(), name
    assert "| `pool` |" in page and "[ClaimOut](#claimout)" in page


def test_the_page_renders_schemas_in_words() -> None:
    document = {
        "openapi": "3.1.0",
        "info": {"version": "9", "summary": "S."},
        "paths": {},
        "components": {
            "schemas": {
                "Thing": {
                    "properties": {
                        "n": {"type": "integer", "minimum": 1, "description": "how | many"},
                        "tags": {"type": "array", "items": {"$ref": "#/components/schemas/Tag"}},
                        "mode": {"enum": ["a", "b"], "default": "a"},
                    },
                    "required": ["n"],
                }
            }
        },
    }
    lines = markdown(document).splitlines()
    assert "| `n` | integer (>= 1) | yes | how \\| many |" in lines
    assert "| `tags` | array of [Tag](#tag) | no |  |" in lines
    assert '| `mode` | one of `"a"`, `"b"` | no | (default `"a"`) |' in lines


def test_main_writes_both_files(tmp_path: Path, fresh: dict[str, str]) -> None:
    main([str(tmp_path / "out")])
    for name, text in fresh.items():
        assert (tmp_path / "out" / name).read_text(encoding="utf-8") == text
