"""The Python SDK: `Client` and `AsyncClient` over the HTTP API, with typed results and
one exception per kind of error. It depends on httpx only, never on the server's code."""

from __future__ import annotations

from stoker.sdk._async_client import AsyncClaim, AsyncClient, AsyncSession
from stoker.sdk._calls import (
    ClaimFilters,
    ClaimOptions,
    PoolChanges,
    TemplateChanges,
    WorkerFilters,
)
from stoker.sdk._client import Client, Session
from stoker.sdk._errors import (
    CapacityError,
    ClaimConflict,
    Forbidden,
    InvalidRequest,
    NotFound,
    OrgCapError,
    PoolInUse,
    ServerError,
    ServerUnreachable,
    SessionLost,
    StaleGeneration,
    StokerError,
    Unauthorized,
    Unavailable,
    error_from_response,
)
from stoker.sdk._models import (
    ClaimInfo,
    DeletedPool,
    Listing,
    PoolInfo,
    RolloutInfo,
    WorkerInfo,
    WorkerRef,
)
from stoker.sdk._retry import Retries

__all__ = [
    "AsyncClaim",
    "AsyncClient",
    "AsyncSession",
    "CapacityError",
    "ClaimConflict",
    "ClaimFilters",
    "ClaimInfo",
    "ClaimOptions",
    "Client",
    "DeletedPool",
    "Forbidden",
    "InvalidRequest",
    "Listing",
    "NotFound",
    "OrgCapError",
    "PoolChanges",
    "PoolInUse",
    "PoolInfo",
    "Retries",
    "RolloutInfo",
    "ServerError",
    "ServerUnreachable",
    "Session",
    "SessionLost",
    "StaleGeneration",
    "StokerError",
    "TemplateChanges",
    "Unauthorized",
    "Unavailable",
    "WorkerFilters",
    "WorkerInfo",
    "WorkerRef",
    "error_from_response",
]
