"""stoker: keeps a fleet of workers warm, scales it with demand, gives idle capacity back.

The package root is the SDK (`stoker.Client`, `stoker.AsyncClient`, the exceptions and
results): every name of `stoker.sdk.__all__`, loaded on first use, so importing `stoker`
stays light (demo workers import it) and the public names are listed once, in the SDK.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from stoker._version import __version__ as __version__


def __getattr__(name: str) -> Any:
    # Tools probe modules for dunders (`__wrapped__`, ...): only `__all__` loads the SDK.
    if name.startswith("__") and name != "__all__":
        raise AttributeError(f"module 'stoker' has no attribute {name!r}")
    sdk = importlib.import_module("stoker.sdk")
    if name == "__all__":
        return ["__version__", *sdk.__all__]
    if name in sdk.__all__:
        return getattr(sdk, name)
    raise AttributeError(f"module 'stoker' has no attribute {name!r}")


if TYPE_CHECKING:
    from stoker.sdk import *  # noqa: F403
