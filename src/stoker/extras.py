"""The optional parts of the install (pyproject's extras) and the one message for a missing one.

The base install runs `stoker serve` on the embedded defaults (SQLite, local worker
processes) and the SDK. A feature that needs more names its extra here, and says which
one to install when its modules are missing, instead of failing with a traceback.
"""

from __future__ import annotations

import importlib

#: The modules each extra brings (its distributions' import names), checked in order.
EXTRAS: dict[str, tuple[str, ...]] = {
    "postgres": ("psycopg", "psycopg_pool"),
    "kubernetes": ("lightkube", "lightkube.models"),
    "sim": ("matplotlib",),
    "tracing": ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter"),
}


def missing_extra(extra: str, feature: str) -> str | None:
    """None when `extra`'s modules import; else one line saying `feature` needs it.

    Example: "the postgres store needs the 'postgres' extra: pip install 'stoker[postgres]'".
    """
    for module in EXTRAS[extra]:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError:
            return f"{feature} needs the {extra!r} extra: pip install 'stoker[{extra}]'"
        except ImportError as exc:
            # Installed but broken (a native library missing): say so, with the reason.
            return (
                f"{feature} needs the {extra!r} extra, which does not load ({exc}): "
                f"pip install 'stoker[{extra}]'"
            )
    return None
