"""The Activator contract: the worker side of activation, run against every activator.

The fence (docs/worker-protocol.md, "Fencing") is kept by the worker; each activator must
surface it the same way: a refusal (another worker's payload, a second org, an epoch not
newer than the one held) is `ActivationRejected`, a worker that cannot be reached is a
`RuntimeFailure` that is not a rejection. `tests/adapters/test_activator_http.py` runs
the suite on the HTTP activator against real demo workers (signing every activation, as
those workers require), `tests/test_fakes.py` on `MemoryRuntime` (the control-plane
tests' activator) and on the simulator's `SimActivator`.

A subclass provides a `target` fixture (an `ActivationTarget`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import pytest

from stoker.domain.errors import ActivationRejected, RuntimeFailure
from stoker.domain.records import Worker
from stoker.ports.activator import ActivationPayload, Activator

#: Generous: the bound of a real HTTP round trip on a busy machine.
TIMEOUT_S = 5.0


class ActivationTarget(Protocol):
    """What the contract needs of one activator's test setup."""

    #: The activator under test.
    activator: Activator

    async def ready_worker(self) -> Worker:
        """A ready worker never activated (its endpoint set, as the pool manager's are)."""
        ...

    async def unreachable(self) -> tuple[Activator, Worker]:
        """An activator and a worker it cannot reach (gone, or not answering in time)."""
        ...


def payload(worker: Worker, org: str = "acme", epoch: int = 1) -> ActivationPayload:
    """An activation of `worker` for `org` at `epoch`, with a token and a config."""
    return ActivationPayload(
        worker_id=worker.id, org=org, epoch=epoch, token=f"tok-{epoch}", config={"region": "eu"}
    )


class ActivatorContract:
    """Every Activator adapter behaves the same on these points."""

    @pytest.fixture
    def target(self) -> ActivationTarget:
        raise NotImplementedError("a subclass provides the target")

    async def test_a_ready_worker_accepts_its_org_then_newer_epochs(
        self, target: ActivationTarget
    ) -> None:
        """The first activation binds the org; the same org at a newer epoch (a reuse)
        is accepted too."""
        worker = await target.ready_worker()
        await target.activator.activate(worker, payload(worker, epoch=1), TIMEOUT_S)
        await target.activator.activate(worker, payload(worker, epoch=2), TIMEOUT_S)

    async def test_a_second_org_is_rejected(self, target: ActivationTarget) -> None:
        """Org is written once: another org is refused, even at a newer epoch."""
        worker = await target.ready_worker()
        await target.activator.activate(worker, payload(worker), TIMEOUT_S)
        with pytest.raises(ActivationRejected):
            await target.activator.activate(worker, payload(worker, "globex", 2), TIMEOUT_S)

    async def test_a_stale_epoch_is_rejected(self, target: ActivationTarget) -> None:
        """An epoch not strictly newer than the one held is refused, then a newer one binds."""
        worker = await target.ready_worker()
        await target.activator.activate(worker, payload(worker, epoch=2), TIMEOUT_S)
        for stale in (2, 1):
            with pytest.raises(ActivationRejected):
                await target.activator.activate(worker, payload(worker, epoch=stale), TIMEOUT_S)
        await target.activator.activate(worker, payload(worker, epoch=3), TIMEOUT_S)

    async def test_another_workers_payload_is_rejected(self, target: ActivationTarget) -> None:
        """A payload naming another worker (a misrouted activation) is refused."""
        worker = await target.ready_worker()
        misrouted = replace(payload(worker), worker_id=f"{worker.id}-other")
        with pytest.raises(ActivationRejected):
            await target.activator.activate(worker, misrouted, TIMEOUT_S)
        await target.activator.activate(worker, payload(worker), TIMEOUT_S)

    async def test_an_unreachable_worker_is_a_failure_not_a_rejection(
        self, target: ActivationTarget
    ) -> None:
        """Nothing answered: a `RuntimeFailure` (the worker retires), never a rejection."""
        activator, worker = await target.unreachable()
        with pytest.raises(RuntimeFailure) as failure:
            await activator.activate(worker, payload(worker), 1.0)
        assert not isinstance(failure.value, ActivationRejected)
