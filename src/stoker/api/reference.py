"""The API reference in `docs/`: the OpenAPI document a server serves, and a page from it.

    python -m stoker.api.reference [DIR]     # writes DIR/openapi.json and DIR/api.md

`make docs` runs it into `docs/`; a test fails while those files differ from what this
module renders, so the reference never drifts from the routes. The document is the one of
a server on the embedded defaults with tokens configured (the bearer scheme shown); the
app is built, never started, and no request is served.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stoker.api.app import create_app
from stoker.bootstrap import build_control_plane
from stoker.config import StokerConfig

#: The files `write_reference` writes, relative to its directory.
OPENAPI_FILE = "openapi.json"
MARKDOWN_FILE = "api.md"
_METHODS = ("get", "put", "post", "delete", "patch")


def reference_document() -> dict[str, Any]:
    """The OpenAPI document of a server on the embedded defaults, with tokens configured."""
    config = StokerConfig.model_validate(
        {
            "store": "sqlite:///:memory:",
            # Placeholders: the app is never started, nothing is signed or authenticated.
            "activation": {"key": "reference-" + "0" * 32},
            "api": {"admin_tokens": ["reference-admin-token"]},
        }
    )
    plane = build_control_plane(config)
    return create_app(plane, config.api, manage_plane=False).openapi()


def openapi_text(document: Mapping[str, Any]) -> str:
    """The document as written to `openapi.json`: sorted keys, two-space indents."""
    return json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _type(schema: Mapping[str, Any]) -> str:
    """A schema in a few words: `string`, `integer (>= 1)`, `[Worker](#worker)`, ..."""
    if "$ref" in schema:
        name = _ref_name(schema["$ref"])
        return f"[{name}](#{name.lower()})"
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return " or ".join(_type(s) for s in schema[key])
    if "enum" in schema:
        return "one of " + ", ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    kind = schema.get("type", "any")
    if kind == "array":
        return f"array of {_type(schema.get('items', {}))}"
    if kind == "object" and "additionalProperties" in schema:
        extra = schema["additionalProperties"]
        values = _type(extra) if isinstance(extra, Mapping) else "any"
        return f"object of {values}"
    bounds = []
    for key, sign in (
        ("minimum", ">="),
        ("exclusiveMinimum", ">"),
        ("maximum", "<="),
        ("exclusiveMaximum", "<"),
        ("minLength", "length >="),
        ("maxLength", "length <="),
    ):
        if key in schema:
            bounds.append(f"{sign} {schema[key]}")
    if "pattern" in schema:
        bounds.append(f"matching `{schema['pattern']}`")
    return f"{kind} ({', '.join(bounds)})" if bounds else str(kind)


def _cell(text: Any) -> str:
    """One Markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _operation(path: str, method: str, op: Mapping[str, Any]) -> list[str]:
    lines = [f"### {method.upper()} {path}", ""]
    summary = op.get("summary")
    if summary:
        lines += [f"**{summary}** (`{op.get('operationId', '')}`)", ""]
    if op.get("description"):
        lines += [str(op["description"]).strip(), ""]
    if op.get("security"):
        lines += ["Needs a bearer token (`Authorization: Bearer ...`).", ""]
    params: Sequence[Mapping[str, Any]] = op.get("parameters", [])
    if params:
        lines += ["| parameter | in | type | required | description |", "|---|---|---|---|---|"]
        for p in params:
            lines.append(
                f"| `{p['name']}` | {p['in']} | {_cell(_type(p.get('schema', {})))} | "
                f"{'yes' if p.get('required') else 'no'} | {_cell(p.get('description', ''))} |"
            )
        lines.append("")
    body = op.get("requestBody")
    if body:
        for media, content in body.get("content", {}).items():
            lines += [f"Request body ({media}): {_type(content.get('schema', {}))}", ""]
    lines += ["| status | description | body |", "|---|---|---|"]
    for status, response in sorted(op.get("responses", {}).items()):
        content = response.get("content", {})
        bodies = ", ".join(
            f"{_type(c.get('schema', {}))} ({media})" for media, c in content.items()
        )
        lines.append(
            f"| {status} | {_cell(response.get('description', ''))} | {_cell(bodies) or '-'} |"
        )
    return [*lines, ""]


def _schema(name: str, schema: Mapping[str, Any]) -> list[str]:
    lines = [f"### {name}", ""]
    if schema.get("description"):
        lines += [" ".join(str(schema["description"]).split()), ""]
    props: Mapping[str, Mapping[str, Any]] = schema.get("properties", {})
    if not props:
        return [*lines, f"Type: {_type(schema)}", ""]
    required = set(schema.get("required", []))
    lines += ["| field | type | required | description |", "|---|---|---|---|"]
    for field, prop in props.items():
        description = prop.get("description", prop.get("title", ""))
        if "default" in prop:
            description = f"{description} (default `{json.dumps(prop['default'])}`)".strip()
        lines.append(
            f"| `{field}` | {_cell(_type(prop))} | {'yes' if field in required else 'no'} | "
            f"{_cell(description)} |"
        )
    return [*lines, ""]


def markdown(document: Mapping[str, Any]) -> str:
    """The API reference page: every operation by tag, then every schema."""
    info = document.get("info", {})
    lines = [
        "# API reference",
        "",
        "<!-- Generated by `make docs` (python -m stoker.api.reference) from the OpenAPI",
        "     document of create_app; do not edit by hand. -->",
        "",
        f"stoker {info.get('version', '')}, OpenAPI {document.get('openapi', '')}. "
        f"{info.get('summary', '')} A running server serves the same document at "
        "`/openapi.json` and renders it at `/docs`; the machine-readable copy is "
        f"[`{OPENAPI_FILE}`]({OPENAPI_FILE}). Errors are problem details "
        "([Problem](#problem), `application/problem+json`).",
        "",
    ]
    by_tag: dict[str, list[tuple[str, str, Mapping[str, Any]]]] = {}
    for path, item in document.get("paths", {}).items():
        for method in _METHODS:
            if method in item:
                op = item[method]
                tag = (op.get("tags") or ["other"])[0]
                by_tag.setdefault(tag, []).append((path, method, op))
    lines += ["## Operations", ""]
    for tag, ops in by_tag.items():
        lines += [f"- {tag}: " + ", ".join(f"`{m.upper()} {p}`" for p, m, _ in ops)]
    lines.append("")
    for tag, ops in by_tag.items():
        lines += [f"## {tag}", ""]
        for path, method, op in ops:
            lines += _operation(path, method, op)
    lines += ["## Schemas", ""]
    for name, schema in sorted(document.get("components", {}).get("schemas", {}).items()):
        lines += _schema(name, schema)
    return "\n".join(lines).rstrip("\n") + "\n"


def rendered() -> dict[str, str]:
    """The reference files by name, as `write_reference` writes them."""
    document = reference_document()
    return {OPENAPI_FILE: openapi_text(document), MARKDOWN_FILE: markdown(document)}


def write_reference(directory: Path) -> list[Path]:
    """Write `openapi.json` and `api.md` into `directory`; returns their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in rendered().items():
        path = directory / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def main(argv: Sequence[str]) -> None:
    """`python -m stoker.api.reference [DIR]` (default: docs)."""
    directory = Path(argv[0]) if argv else Path("docs")
    for path in write_reference(directory):
        print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
