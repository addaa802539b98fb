"""The API server's change feed: every pod change, its history, the watches and listeners.

Each write to a pod is one `PodChange`. The feed keeps a bounded history of them, so
that a watch can resume from a resourceVersion (`Gone` when it is older than the history
kept), delivers each change to the open watches as the watch cache would (a pod whose
labels stop matching a selector is DELETED from that watch, one that starts matching is
ADDED), then to the listeners, in resourceVersion order. Delivery order never depends on
object addresses: watches are kept in insertion-ordered dicts. With a `latency_s`, a
watch hands each change to its client that much later than the write (the same delay for
every change, so the order holds); listeners, the cluster's own controllers, get it at once.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from stoker.ports.clock import Clock
from stoker.ports.cluster import Gone, Invalid, Pod, Selector, WatchEvent, WatchEventType


def matches(labels: Mapping[str, str], selector: Selector) -> bool:
    """Whether `labels` carry every pair of `selector`."""
    return all(labels.get(key) == value for key, value in selector.items())


@dataclass(frozen=True, slots=True)
class PodChange:
    """One write to a pod: its state before (None when created) and after.

    For a deletion `after` is the last state, stamped with the deletion's resourceVersion.
    Listeners (`FakeApiServer.add_listener`) receive every change in order.
    """

    rv: int
    type: WatchEventType
    before: Pod | None
    after: Pod

    def seen_through(self, selector: Selector) -> WatchEvent | None:
        """The event a watch with `selector` receives, as the watch cache computes it."""
        now = matches(self.after.labels, selector)
        was = self.before is not None and matches(self.before.labels, selector)
        if self.type is WatchEventType.MODIFIED:
            if was and now:
                return WatchEvent(WatchEventType.MODIFIED, self.after)
            if now:
                return WatchEvent(WatchEventType.ADDED, self.after)
            if was:
                return WatchEvent(WatchEventType.DELETED, self.after)
            return None
        return WatchEvent(self.type, self.after) if now else None


#: A selector in a hashable, order-independent form: watches with equal selectors share
#: one match per change.
_SelectorKey = tuple[tuple[str, str], ...]

#: Called with every change, after the watches got it; must not write to the server.
PodListener = Callable[[PodChange], None]


@dataclass(slots=True, eq=False)  # compared by identity: each open watch is its own
class Watch:
    """One open watch: its selector, who opened it, and the events waiting for it."""

    selector: Selector
    #: Who opened it (a client view's name), so that faults can drop one client's watches.
    owner: str | None = None
    # (deliver at, event); None ends the watch: the server dropped it.
    queue: asyncio.Queue[tuple[float, WatchEvent] | None] = field(default_factory=asyncio.Queue)


class ChangeFeed:
    """The history of pod changes, and the watches and listeners they are delivered to."""

    def __init__(
        self,
        history_size: int,
        *,
        latency_s: float = 0.0,
        clock: Clock | None = None,
    ) -> None:
        if history_size < 1:
            raise ValueError("history_size must be >= 1")
        if latency_s < 0 or (latency_s > 0 and clock is None):
            raise ValueError("latency_s must be >= 0, and needs a clock")
        self._history_size = history_size
        self._latency_s = latency_s
        self._clock = clock
        self._history: deque[PodChange] = deque()
        # A watch from any rv >= this one misses nothing; older ones get Gone.
        self._oldest_rv = 0
        # Insertion-ordered dicts, not sets: delivery order must not depend on addresses.
        self._watches: dict[_SelectorKey, dict[Watch, None]] = {}
        self._listeners: list[PodListener] = []

    @property
    def open_watches(self) -> int:
        """How many watches are streaming right now."""
        return sum(len(group) for group in self._watches.values())

    def add_listener(self, listener: PodListener) -> None:
        """Call `listener` with every change, after the watches got it."""
        self._listeners.append(listener)

    async def watch(
        self,
        selector: Selector,
        resource_version: str,
        *,
        owner: str | None,
        enter: Callable[[str], Awaitable[None]],
        pods: Mapping[str, Pod],
    ) -> AsyncGenerator[WatchEvent, None]:
        """A watch of the pods `selector` matches: from `resource_version` ("" or "0": every
        such pod in `pods` as ADDED) through the history, then live. `enter` is the API
        server's entry of a `watch_pods` call."""
        await enter("watch_pods")
        selector = dict(selector)
        # Choosing the backlog and subscribing happen with no await in between, so no
        # change can fall between them or be delivered twice.
        backlog: list[WatchEvent]
        if resource_version in ("", "0"):
            backlog = [
                WatchEvent(WatchEventType.ADDED, pod)
                for _, pod in sorted(pods.items())
                if matches(pod.labels, selector)
            ]
        else:
            try:
                since = int(resource_version)
            except ValueError:
                raise Invalid(f"invalid resourceVersion {resource_version!r}", status=400) from None
            backlog = self.since(selector, since)
        watch = self.subscribe(selector, owner)
        try:
            for event in backlog:
                yield event
            while (live := await watch.queue.get()) is not None:
                due, event = live
                if self._clock is not None and (wait := due - self._clock.monotonic()) > 0:
                    await self._clock.sleep(wait)
                yield event
        finally:
            self.unsubscribe(watch)

    def since(self, selector: Selector, rv: int) -> list[WatchEvent]:
        """What a watch with `selector` resuming after `rv` replays; `Gone` if too old."""
        if rv < self._oldest_rv:
            raise Gone(f"too old resource version: {rv} ({self._oldest_rv})", status=410)
        # From the newest back to `rv`: a watch resumes near the head, and walking the
        # whole history for each resume cost more than everything else it does.
        newer = list(itertools.takewhile(lambda c: c.rv > rv, reversed(self._history)))
        return [
            event
            for change in reversed(newer)
            if (event := change.seen_through(selector)) is not None
        ]

    def subscribe(self, selector: Selector, owner: str | None) -> Watch:
        """A new watch, delivered every change from now on (until `unsubscribe`)."""
        watch = Watch(selector, owner)
        self._watches.setdefault(_selector_key(selector), {})[watch] = None
        return watch

    def unsubscribe(self, watch: Watch) -> None:
        """Stop delivering to `watch`."""
        key = _selector_key(watch.selector)
        group = self._watches.get(key)
        if group is not None:
            group.pop(watch, None)
            if not group:
                del self._watches[key]

    def record(self, change: PodChange) -> None:
        """Keep `change` in the history and deliver it to the watches, then the listeners."""
        self._history.append(change)
        while len(self._history) > self._history_size:
            self._oldest_rv = self._history.popleft().rv
        due = self._clock.monotonic() + self._latency_s if self._clock is not None else 0.0
        for group in self._watches.values():
            # All watches of a group share the selector: match once, deliver to each.
            event = change.seen_through(next(iter(group)).selector)
            if event is not None:
                for watch in group:
                    watch.queue.put_nowait((due, event))
        for listener in self._listeners:
            listener(change)

    def compact(self, rv: int) -> None:
        """Forget the whole history: a watch from before `rv` gets Gone."""
        self._history.clear()
        self._oldest_rv = rv

    def drop(self, owner: str | None = None) -> None:
        """End every open watch (or only `owner`'s)."""
        for group in self._watches.values():
            for watch in group:
                if owner is None or watch.owner == owner:
                    watch.queue.put_nowait(None)


def _selector_key(selector: Selector) -> _SelectorKey:
    return tuple(sorted(selector.items()))
