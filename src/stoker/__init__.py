"""stoker: keeps a fleet of workers warm, scales it with demand, gives idle capacity back.

The package root stays light (demo workers import it): the public names load lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["__version__"]

_LAZY: dict[str, str] = {}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'stoker' has no attribute {name!r}")


if TYPE_CHECKING:
    pass
