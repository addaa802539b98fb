"""Group commit: the writes of one kind asked for in one iteration of the event loop go to
PostgreSQL as one statement, one round trip and one commit for all of them.

In a burst of claims many reservations, and later many binds, are asked for together;
each was a round trip and a commit that waited for the WAL of its own. A batch gives each
caller the answer its own statement would have given. Writes that cannot share a
statement (another group, or one that touches a row or an org another of the batch
touches) run alone, and so does each write of a batch that fails (an Idempotency-Key
taken, a lost connection): its own statement then says what went wrong for it alone.
An error reaches the caller whose write raised it, never a task nobody awaits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Iterable
from typing import Generic, TypeVar

P = TypeVar("P")
R = TypeVar("R")


class LoopBatches(Generic[P, R]):
    """Collects the writes of one loop iteration; runs each group of them as one statement.

    `group(params)` names the statement a write may share (None: it runs alone);
    `claims(params)` the rows or keys it touches, which no other write of its batch may
    touch; `batch(params...)` answers a group in order, and `one(params)` a write alone.
    """

    def __init__(
        self,
        *,
        batch: Callable[[list[P]], Awaitable[list[R]]],
        one: Callable[[P], Awaitable[R]],
        group: Callable[[P], Hashable | None],
        claims: Callable[[P], Iterable[Hashable]],
    ) -> None:
        self._batch = batch
        self._one = one
        self._group = group
        self._claims = claims
        self._waiting: list[tuple[P, asyncio.Future[R]]] = []
        self._running: set[asyncio.Task[None]] = set()

    async def run(self, params: P) -> R:
        """The write's answer, as its own statement would give it."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[R] = loop.create_future()
        if not self._waiting:
            loop.call_soon(self._flush)
        self._waiting.append((params, answer))
        return await answer

    def _flush(self) -> None:
        waiting, self._waiting = self._waiting, []
        groups: dict[Hashable, list[tuple[P, asyncio.Future[R]]]] = {}
        alone = []
        for params, answer in waiting:
            key = self._group(params)
            if key is None:
                alone.append((params, answer))
            else:
                groups.setdefault(key, []).append((params, answer))
        for members in groups.values():
            if len(members) > 1:
                self._start(self._run_group(members))
            else:
                alone.extend(members)  # nothing to share: straight to its own statement
        for params, answer in alone:
            self._start(self._answer_one(params, answer))

    def _start(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run_group(self, members: list[tuple[P, asyncio.Future[R]]]) -> None:
        together, alone = self._disjoint(members)
        work = [self._answer_one(p, answer) for p, answer in alone]
        if len(together) > 1:
            work.append(self._run_batch(together))
        else:
            work.extend(self._answer_one(p, answer) for p, answer in together)
        await asyncio.gather(*work)

    def _disjoint(
        self, members: list[tuple[P, asyncio.Future[R]]]
    ) -> tuple[list[tuple[P, asyncio.Future[R]]], list[tuple[P, asyncio.Future[R]]]]:
        """The members that touch nothing an earlier one touches, and the others."""
        seen: set[Hashable] = set()
        together, alone = [], []
        for member in members:
            touched = list(self._claims(member[0]))
            if seen.isdisjoint(touched):
                seen.update(touched)
                together.append(member)
            else:
                alone.append(member)
        return together, alone

    async def _run_batch(self, members: list[tuple[P, asyncio.Future[R]]]) -> None:
        try:
            results = await self._batch([p for p, _ in members])
        except asyncio.CancelledError:
            for _, answer in members:
                answer.cancel()
            raise
        except Exception:
            # Each on its own: each gets its own statement's answer.
            await asyncio.gather(*(self._answer_one(p, answer) for p, answer in members))
            return
        for (_, answer), result in zip(members, results, strict=True):
            if not answer.done():
                answer.set_result(result)

    async def _answer_one(self, params: P, answer: asyncio.Future[R]) -> None:
        try:
            result = await self._one(params)
        except asyncio.CancelledError:
            answer.cancel()
            raise
        except Exception as exc:
            if not answer.done():
                answer.set_exception(exc)
            return
        if not answer.done():
            answer.set_result(result)
