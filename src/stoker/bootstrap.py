"""Composition root: builds a `ControlPlane` from a validated config, and sets up logging.

The one module that imports adapters and control together: it picks the store adapter
from the store URL and the runtime from the `runtime` section.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any, TextIO

from stoker.adapters.runtime_local import LocalProcessRuntime
from stoker.adapters.store_sqlite import SqliteStore
from stoker.config import StokerConfig, to_domain
from stoker.control.ids import Ids
from stoker.control.plane import ControlPlane
from stoker.ports.clock import Clock, LoopClock
from stoker.ports.runtime import Runtime
from stoker.ports.store import Store


def build_store(config: StokerConfig) -> Store:
    """SqliteStore for `sqlite:///...`, PostgresStore for `postgresql://...`."""
    if config.is_postgres:
        # Imported here: psycopg is heavy, and most servers run on SQLite.
        from stoker.adapters.store_postgres import PostgresStore

        opts = config.store_options
        return PostgresStore(
            config.store,
            schema=opts.db_schema,
            min_size=opts.min_pool_size,
            max_size=opts.max_pool_size,
            prepare_threshold=opts.prepare_threshold,
        )
    return SqliteStore(config.sqlite_path())


def build_control_plane(
    config: StokerConfig,
    *,
    clock: Clock | None = None,
    ids: Ids | None = None,
    store: Store | None = None,
    runtime: Runtime | None = None,
) -> ControlPlane:
    """A control plane (not started) for `config`.

    `store` and `runtime` replace the ones the config names (tests use an in-memory runtime).
    """
    domain = to_domain(config)
    clock = clock or LoopClock()
    ids = ids or Ids()
    instance_id = ids.instance()
    if runtime is None:
        runtime = LocalProcessRuntime(
            clock=clock,
            fleet=config.fleet_name(),
            instance_id=instance_id,
            memory_budget_mb=config.runtime.memory_budget_mb,
            log_dir=config.runtime.log_dir,
        )
    return ControlPlane(
        store=store or build_store(config),
        runtime=runtime,
        pools=domain.pools,
        orgs=domain.orgs,
        settings=domain.settings,
        clock=clock,
        ids=ids,
        instance_id=instance_id,
    )


# -- logging --------------------------------------------------------------------------------


def parse_kv(message: str) -> dict[str, str]:
    """The fields of a `key=value` log line (values quoted as `stoker.control.logs` quotes them)."""
    fields: dict[str, str] = {}
    i, n = 0, len(message)
    while i < n:
        while i < n and message[i] == " ":
            i += 1
        eq = message.find("=", i)
        if eq < 0:
            break
        key = message[i:eq]
        i = eq + 1
        if i < n and message[i] == '"':
            i += 1
            chars = []
            while i < n and message[i] != '"':
                if message[i] == "\\" and i + 1 < n:
                    i += 1
                chars.append(message[i])
                i += 1
            i += 1
            fields[key] = "".join(chars)
        else:
            end = message.find(" ", i)
            end = n if end < 0 else end
            fields[key] = message[i:end]
            i = end
    return fields


class KvFormatter(logging.Formatter):
    """`ts=... level=... logger=... <message>`: stoker's messages already are key=value."""

    def format(self, record: logging.LogRecord) -> str:
        """One line per record."""
        ts = self.formatTime(record, "%Y-%m-%dT%H:%M:%S")
        text = record.getMessage()
        if "=" not in text.split(" ", 1)[0]:
            text = "msg=" + json.dumps(text, ensure_ascii=False)
        line = f"ts={ts}.{int(record.msecs):03d} level={record.levelname.lower()} "
        line += f"logger={record.name} {text}"
        if record.exc_info:
            line += " exc=" + json.dumps(self.formatException(record.exc_info))
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per record, with the key=value fields of the message as members."""

    def format(self, record: logging.LogRecord) -> str:
        """One line per record."""
        ts = self.formatTime(record, "%Y-%m-%dT%H:%M:%S")
        body: dict[str, Any] = {
            "ts": f"{ts}.{int(record.msecs):03d}",
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        text = record.getMessage()
        if text.startswith("event="):
            body.update(parse_kv(text))
        else:
            body["msg"] = text
        if record.exc_info:
            body["exc"] = self.formatException(record.exc_info)
        return json.dumps(body, ensure_ascii=False)


class _DropStartupNoise(logging.Filter):
    """uvicorn's own startup-failure line repeats what stoker already says in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Application startup failed")


def configure_logging(level: str = "info", fmt: str = "kv", stream: TextIO | None = None) -> None:
    """Send every log line to `stream` (stderr) in the `kv` or `json` format."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KvFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # Per-request lines of the HTTP server and of the activation client would drown the
    # state-change events; their warnings and errors still show.
    for name in ("uvicorn", "uvicorn.error", "httpx", "httpcore"):
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
    logging.getLogger("uvicorn.access").disabled = True
    uvicorn_error = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _DropStartupNoise) for f in uvicorn_error.filters):
        uvicorn_error.addFilter(_DropStartupNoise())
