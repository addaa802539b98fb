"""The HTTP API (docs/concepts/claims.md): FastAPI app factory and the server that runs it."""

from __future__ import annotations

from stoker.api.app import StokerApp, create_app
from stoker.api.asgi import ApiState, Principal

__all__ = ["ApiState", "Principal", "StokerApp", "create_app"]
