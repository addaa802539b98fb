"""The PostgreSQL store (see `store`): one database shared by several replicas."""

from stoker.adapters.postgres.store import PostgresStore

__all__ = ["PostgresStore"]
