"""The Activator port: how a reserved worker is handed its org and late-bound config.

Activation is one protocol whatever runs the worker (`docs/worker-protocol.md`): the
control plane sends `(worker id, org, epoch, token, config)` and the worker accepts it or
rejects it (second org, stale epoch). A Runtime only starts, watches and stops workers; an
Activator speaks to them once they are ready. Adapters: HTTP (local processes and pods
alike, signing each activation) and the simulator's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from stoker.domain.records import Worker


@dataclass(frozen=True, slots=True)
class ActivationPayload:
    """What a worker receives at activation (`docs/worker-protocol.md`, "The activation body")."""

    worker_id: str
    org: str
    epoch: int
    token: str
    config: Mapping[str, Any] = field(default_factory=dict)


class Activator(Protocol):
    """Hands a ready worker its org; raises `ActivationRejected` or `RuntimeFailure`."""

    async def activate(self, worker: Worker, payload: ActivationPayload, timeout: float) -> None:
        """Activate `worker` (at `worker.endpoint`) with `payload` within `timeout` seconds."""
        ...

    async def close(self) -> None:
        """Release connections held for activations."""
        ...
