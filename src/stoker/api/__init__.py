"""The HTTP API (DESIGN.md §7): FastAPI app factory and the server that runs it."""

from __future__ import annotations

from stoker.api.app import ApiState, Principal, StokerApp, create_app

__all__ = ["ApiState", "Principal", "StokerApp", "create_app"]
