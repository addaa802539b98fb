"""The SQLite store (see `store`): the embedded default."""

from stoker.adapters.sqlite.store import SqliteStore

__all__ = ["SqliteStore"]
