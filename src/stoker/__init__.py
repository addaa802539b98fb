"""stoker: keeps a fleet of workers warm, scales it with demand, gives idle capacity back.

The package root stays light (demo workers import it): the public names load lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stoker._version import __version__

__all__ = [
    "AsyncClient",
    "CapacityError",
    "ClaimConflict",
    "ClaimInfo",
    "Client",
    "Forbidden",
    "InvalidRequest",
    "NotFound",
    "OrgCapError",
    "PoolInfo",
    "ServerError",
    "ServerUnreachable",
    "Session",
    "StokerError",
    "Unauthorized",
    "Unavailable",
    "WorkerInfo",
    "__version__",
]

#: Public names and the module each one loads from on first use: the SDK.
_LAZY: dict[str, str] = dict.fromkeys((n for n in __all__ if n != "__version__"), "stoker.sdk")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'stoker' has no attribute {name!r}")


if TYPE_CHECKING:
    from stoker.sdk import (
        AsyncClient,
        CapacityError,
        ClaimConflict,
        ClaimInfo,
        Client,
        Forbidden,
        InvalidRequest,
        NotFound,
        OrgCapError,
        PoolInfo,
        ServerError,
        ServerUnreachable,
        Session,
        StokerError,
        Unauthorized,
        Unavailable,
        WorkerInfo,
    )
