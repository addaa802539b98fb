"""The informer: what happens to the fleet's pods, learned without a list per claim.

One list, then a watch from the list's resourceVersion, resumed from the last version seen
when the stream ends, a fresh list when the cluster answers `Gone`, and a periodic resync
(list and diff) that emits whatever a missed watch event would have. Pod changes become the
runtime events:

- `worker_ready(id, "http://<podIP>:<port>")` once per pod, when it is Running, Ready and
  has an IP (also for ready pods found by the first list; the pool manager ignores workers
  it does not own);
- `worker_lost(id, reason, detail)` once per pod, when it is deleted (or starts
  terminating), Failed or Succeeded: `"evicted"` for a pod the kubelet evicted, else
  `"lost"`, and how its container ended when it did (`PodView.loss_detail`). A pod whose
  deletion the runtime requested (`expect_deletion`) is never reported;
- `worker_stalled(id, stage, error)` once per pod and stage, while a pod that is not
  ready yet cannot start as it is: no node fits it (`unschedulable`), its image cannot be
  pulled, its container cannot be created (see `PodView.progress`);
- `worker_gone(id, at)` once per pod whose deletion the runtime requested, when it stops
  holding its node share: when the kubelet reports it Succeeded or Failed, or else when
  it leaves the cluster (its DELETED event, or a relist without it). A terminating pod's
  requests stay counted on its node (by the scheduler, the kubelet's admission, an
  autoscaler) until then, whether or not its containers have exited: the ledger counts
  its time up to there. A pod that had ended before its deletion is not reported.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass

from stoker.adapters._deadlines import DeadlinePassed, within
from stoker.adapters._logs import EventLog
from stoker.adapters.runtime_kubernetes._pods import PodView
from stoker.adapters.runtime_kubernetes._unpinned import PinnedByNode, UnpinnedPods
from stoker.domain.errors import RuntimeFailure
from stoker.ports.clock import Clock
from stoker.ports.cluster import ClusterAPI, Gone, Selector, WatchEvent, WatchEventType
from stoker.ports.runtime import RuntimeListener, RuntimeObject

_log = EventLog("stoker.runtime.kubernetes")

#: Backoff of the informer after a failed list or watch: doubles up to the ceiling.
WATCH_BACKOFF_S = 0.5
MAX_WATCH_BACKOFF_S = 30.0


@dataclass(slots=True)
class PodEntry:
    """A cached pod and what has been reported about it."""

    view: PodView
    #: worker_ready was emitted.
    announced: bool = False
    #: worker_lost was emitted, or the pod's end was requested by `stop`: nothing more to say.
    settled: bool = False
    #: What `list_objects` made of `view` last time (rebuilt once the view changes).
    listed: tuple[PodView, RuntimeObject] | None = None
    #: The stages of trouble reported as worker_stalled (each once per pod).
    stalled: frozenset[str] = frozenset()
    #: Its deletion was requested and it holds its node share no more (worker_gone was
    #: emitted, or it had ended already): nothing more to say of its end.
    gone: bool = False


class PodInformer:
    """Keeps a cache of the fleet's pods (workers and placeholders) and reports changes.

    It lists and watches the pods `selector` matches (the fleet's), relists every
    `resync_s`, and gives `wait_synced` callers up to `sync_timeout_s` for the first list.
    `instance_id` is the replica's: its own pods are logged at info, the others' at debug.
    """

    def __init__(
        self,
        cluster: ClusterAPI,
        clock: Clock,
        selector: Selector,
        *,
        instance_id: str,
        resync_s: float,
        sync_timeout_s: float,
    ) -> None:
        self.cluster = cluster
        self.clock = clock
        #: Receives the events (the pool manager, through the runtime's `subscribe`).
        self.listener: RuntimeListener | None = None
        self._selector = selector
        self.instance_id = instance_id
        self.resync_s = resync_s
        self.sync_timeout_s = sync_timeout_s
        #: Every pod of the fleet (workers and placeholders), by name.
        self._cache: dict[str, PodEntry] = {}
        #: Names of the placeholder pods in `_cache` (headroom looks at these only), in the
        #: order they were first seen: a set's order follows the string hash, which differs
        #: from process to process, and headroom deletes and creates in this order.
        self._placeholder_names: dict[str, None] = {}
        #: The live worker pods in `_cache` without a do-not-disrupt pin.
        self.unpinned = UnpinnedPods()
        #: The live pinned worker pods in `_cache`, counted by node.
        self.pinned_by_node = PinnedByNode()
        #: Where the watch resumes; None means list first.
        self._rv: str | None = None
        self._synced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        #: Pods the runtime deleted, with the monotonic time of the request: not losses.
        self._stopping: dict[str, float] = {}
        #: Statistics (for metrics and tests).
        self.lists = 0
        self.watches = 0

    # -- running ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start listing and watching in the background (once)."""
        if self._task is None:
            self._task = asyncio.create_task(self._inform(), name="kubernetes-informer")

    async def close(self) -> None:
        """Stop listing and watching (the cache stays as it was)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def wait_synced(self) -> None:
        """Return once the first list is in; `RuntimeFailure` if it takes too long."""
        if self._synced.is_set():
            return
        if self._task is None:
            raise RuntimeFailure("the kubernetes runtime is not started")
        try:
            await within(self.clock, self._synced.wait(), self.sync_timeout_s)
        except DeadlinePassed:
            raise RuntimeFailure(
                f"no list of the fleet's pods within {self.sync_timeout_s:g}s"
            ) from None

    # -- what the runtime reads and tells -------------------------------------------------

    def entry(self, name: str) -> PodEntry | None:
        """The cached pod `name`, if any."""
        return self._cache.get(name)

    def worker_entries(self) -> Iterator[PodEntry]:
        """The cached worker pods (placeholders left out)."""
        return (entry for entry in self._cache.values() if entry.view.is_worker)

    def placeholder_views(self) -> Iterator[PodView]:
        """The cached placeholder pods."""
        return (self._cache[name].view for name in self._placeholder_names)

    def expect_deletion(self, name: str) -> PodEntry | None:
        """The runtime deletes pod `name`: its end is no loss. Returns its entry, if cached."""
        self._stopping[name] = self.clock.monotonic()
        entry = self._cache.get(name)
        if entry is not None:
            entry.settled = True
            entry.gone = entry.view.finished
        return entry

    def deletion_requested(self, name: str) -> bool:
        """Whether the runtime deleted pod `name` (the cache may not show it yet)."""
        return name in self._stopping

    def deletion_failed(self, name: str, entry: PodEntry | None) -> None:
        """Undo `expect_deletion` after the cluster refused it: the pod lives on."""
        self._stopping.pop(name, None)
        if entry is not None and self._cache.get(name) is entry:
            entry.settled = entry.gone = False

    # -- the loop ---------------------------------------------------------------------------

    async def _inform(self) -> None:
        """List, watch, resume, relist on Gone, resync periodically: until cancelled."""
        failures = 0
        next_resync = 0.0
        while True:
            try:
                if self._rv is None:
                    await self._relist()
                    failures = 0
                    next_resync = self.clock.monotonic() + self.resync_s
                outcome = await self._watch_until(next_resync)
            except asyncio.CancelledError:
                raise
            except Gone as exc:
                # The history the watch needs is compacted away: only a new list helps.
                _log("informer_relist", level=logging.WARNING, reason="gone", error=exc)
                self._rv = None
                continue
            except Exception as exc:
                # An outage or a bug: back off and resume from the last version seen.
                failures += 1
                delay = _backoff(failures)
                _log(
                    "informer_failed",
                    level=logging.WARNING,
                    error=repr(exc),
                    attempt=failures,
                    delay_s=delay,
                )
                await self.clock.sleep(delay)
                continue
            if outcome == "resync":
                self._rv = None
                failures = 0
            elif outcome == "events":
                failures = 0
            else:
                # The stream ended without a single event: do not spin on a server that
                # closes every watch at once.
                failures += 1
                await self.clock.sleep(_backoff(failures))

    async def _relist(self) -> None:
        """List the fleet and diff against the cache, emitting what the watch missed."""
        listing = await self.cluster.list_pods(self._selector)
        self.lists += 1
        listed = set()
        for pod in listing.items:
            listed.add(pod.name)
            self._observe(PodView.of(pod))
        for name in [name for name in self._cache if name not in listed]:
            self._forget(self._cache[name].view)
        # A stop of a pod never seen (its create failed) would otherwise be kept forever.
        horizon = self.clock.monotonic() - self.resync_s
        for name, since in list(self._stopping.items()):
            if name not in self._cache and since < horizon:
                del self._stopping[name]
        self._rv = listing.resource_version
        if not self._synced.is_set():
            _log("informer_synced", pods=len(self._cache), resource_version=self._rv)
        self._synced.set()

    async def _watch_until(self, deadline: float) -> str:
        """Apply watch events until the stream ends or the resync deadline.

        Returns "resync" at the deadline, "events" or "empty" when the stream ended after
        some or no events. The watch runs in a task of its own so that the deadline can
        end it between two events (events are applied without an await, never half-way).
        """
        remaining = deadline - self.clock.monotonic()
        if remaining <= 0 or self._rv is None:
            return "resync"
        stream = self.cluster.watch_pods(self._selector, self._rv)
        self.watches += 1
        try:
            count = await within(self.clock, self._consume(stream), remaining)
        except DeadlinePassed:
            return "resync"
        finally:
            await stream.aclose()
        return "events" if count else "empty"

    async def _consume(self, stream: AsyncGenerator[WatchEvent, None]) -> int:
        count = 0
        async for event in stream:
            self._apply(event)
            count += 1
        return count

    def _apply(self, event: WatchEvent) -> None:
        view = PodView.of(event.pod)
        if event.type is WatchEventType.DELETED:
            self._forget(view)
        else:
            self._observe(view)
        if view.resource_version:
            self._rv = view.resource_version

    # -- turning pod changes into events ----------------------------------------------------

    def _observe(self, view: PodView) -> None:
        """A pod was added or changed: remember it and report what it now means."""
        entry = self._cache.get(view.name)
        if entry is None:
            entry = self._cache[view.name] = PodEntry(view)
            if view.placeholder is not None and view.worker_id is None:
                self._placeholder_names[view.name] = None
            self.unpinned.changed(None, view)
            self.pinned_by_node.changed(None, view)
        else:
            self.unpinned.changed(entry.view, view)
            self.pinned_by_node.changed(entry.view, view)
            entry.view = view
        if view.finished and view.name in self._stopping:
            self._report_gone(entry, view)
        if not view.is_worker or entry.settled:
            return
        if view.name in self._stopping:
            entry.settled = True
            return
        if not view.alive:
            entry.settled = True
            self._report_lost(view)
            return
        if not entry.announced and not view.serving:
            self._report_stall(entry, view)
        elif not entry.announced:
            entry.announced = True
            endpoint = view.endpoint or ""
            _log(
                "worker_ready",
                level=self._level(view, logging.INFO),
                worker=view.worker_id,
                pool=view.pool,
                endpoint=endpoint,
            )
            if self.listener is not None and view.worker_id is not None:
                self.listener.worker_ready(view.worker_id, endpoint)

    def _report_stall(self, entry: PodEntry, view: PodView) -> None:
        """A spawning pod that cannot start as it is (unschedulable, its image cannot be
        pulled): report each such stage once per pod."""
        progress = view.progress
        if progress is None or progress.failure is None or progress.stage in entry.stalled:
            return
        entry.stalled |= {progress.stage}
        _log(
            "worker_stalled",
            level=self._level(view, logging.WARNING),
            worker=view.worker_id,
            pool=view.pool,
            stage=progress.stage,
            detail=progress.detail,
        )
        if self.listener is not None and view.worker_id is not None:
            self.listener.worker_stalled(view.worker_id, progress.stage, progress.failure)

    def _forget(self, view: PodView) -> None:
        """A pod is gone from the cluster: drop it and report it if it was a live worker."""
        entry = self._cache.pop(view.name, None)
        self._placeholder_names.pop(view.name, None)
        if entry is not None:
            self.unpinned.changed(entry.view, None)
            self.pinned_by_node.changed(entry.view, None)
        stopped = self._stopping.pop(view.name, None) is not None
        if not view.is_worker:
            return
        if stopped:
            self._report_gone(entry, view)
            return
        if entry is not None and entry.settled:
            return
        # `view` is the pod's last state: it tells an eviction from any other end.
        self._report_lost(view)

    def _report_gone(self, entry: PodEntry | None, view: PodView) -> None:
        """A pod whose deletion the runtime requested holds its node share no more."""
        if entry is not None:
            if entry.gone:
                return
            entry.gone = True
        if self.listener is not None and view.is_worker and view.worker_id is not None:
            self.listener.worker_gone(view.worker_id, self.clock.now())

    def _report_lost(self, view: PodView) -> None:
        if view.worker_id is None:
            return
        reason = view.loss_reason
        # A pod deleted through the API (another replica's janitor retiring it, or an
        # operator) is no surprise: the pool manager retires its row or fails its claim
        # and says so. Evictions and pods that died on their own are warnings.
        expected = view.terminating and reason != "evicted" and not view.finished
        _log(
            "worker_lost",
            level=self._level(view, logging.INFO if expected else logging.WARNING),
            worker=view.worker_id,
            pool=view.pool,
            phase=view.phase,
            reason=reason,
        )
        if self.listener is not None:
            self.listener.worker_lost(view.worker_id, reason, view.loss_detail)

    def _level(self, view: PodView, level: int) -> int:
        """`level` for this replica's own pods; every replica watches the whole fleet, so
        the others' pods (which their own replica reports) are logged at debug level."""
        return level if view.instance == self.instance_id else logging.DEBUG


def _backoff(failures: int) -> float:
    """The pause after `failures` failed lists or watches in a row."""
    return min(WATCH_BACKOFF_S * 2.0 ** (failures - 1), MAX_WATCH_BACKOFF_S)
