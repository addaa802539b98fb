"""The doc comments of settings: the `#:` lines above a field where it is declared.

A setting is documented once, beside its declaration (a domain dataclass's field, a config
model's field). The config models' descriptions, the command line's help for the settings
it changes and the site's configuration reference all read them from here.
"""

from __future__ import annotations

import functools
import inspect


@functools.cache
def attribute_comments(cls: type) -> dict[str, str]:
    """The `#:` comments above the attributes of `cls`'s own body, by attribute name.

    This is how a setting is documented where it is declared (a dataclass field or a
    model field); the reference pages and the fields' JSON schema descriptions read them.
    """
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    comments: dict[str, str] = {}
    pending: list[str] = []
    for line in lines[1:]:
        text = line.strip()
        if text.startswith("#:"):
            pending.append(text[2:].strip())
            continue
        head = text.split(":", 1)[0].split("=", 1)[0].strip()
        if pending and head.isidentifier() and line[: len(line) - len(line.lstrip())]:
            comments.setdefault(head, " ".join(pending))
        pending = []
    return comments


def field_description(cls: type, name: str) -> str | None:
    """The doc comment of field `name`, from the first class of `cls`'s MRO that has one."""
    for klass in cls.__mro__:
        found = attribute_comments(klass).get(name)
        if found:
            return found
    return None
