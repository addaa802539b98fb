"""Headroom placeholders: low-priority pause pods that keep the node autoscaler holding
spare nodes, so that a burst of worker pods preempts them instead of waiting for nodes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

from stoker.adapters._logs import EventLog
from stoker.adapters.runtime_kubernetes._informer import PodInformer
from stoker.adapters.runtime_kubernetes._pods import placeholder_pods, valid_label_value
from stoker.domain.errors import RuntimeFailure
from stoker.domain.quantities import parse_quantity
from stoker.domain.specs import PodTemplate, PoolSpec
from stoker.ports.clock import Clock
from stoker.ports.cluster import ClusterAPI, Conflict, Forbidden, Invalid, Pod

_log = EventLog("stoker.runtime.kubernetes")

#: After the API server refuses to create a placeholder (a ResourceQuota without room, a
#: LimitRange's maximum, a spec it finds invalid: answers that do not change from one
#: pass to the next), that placeholder is not asked for again for this long, doubled per
#: refusal in a row up to `REFUSED_MAX_S`.
REFUSED_FIRST_S = 5.0
REFUSED_MAX_S = 120.0


@dataclass(frozen=True)
class Placeholders:
    """How placeholder pods are made: at `priority_class` (required: without a class below
    the workers' they would never be preempted), running `image`, sized `size` = (cpu,
    memory), else as a worker of the pool."""

    priority_class: str | None
    image: str
    size: tuple[str, str] | None


class Headroom:
    """Keeps each pool's `headroom_nodes` placeholder pods of `fleet`, made as `placeholders`
    says, and never touches workers."""

    def __init__(
        self,
        cluster: ClusterAPI,
        informer: PodInformer,
        *,
        clock: Clock,
        fleet: str,
        placeholders: Placeholders,
    ) -> None:
        self.cluster = cluster
        self.informer = informer
        self.clock = clock
        self.fleet = fleet
        self.placeholders = placeholders
        #: Placeholder pods by pool name, with the (template, count) they were made from
        #: (their digest is costly to compute on every pass).
        self._pods: dict[str, tuple[tuple[PodTemplate, int], list[Pod]]] = {}
        #: `slots` by the placeholder's and a worker's (cpu, memory): exact fractions,
        #: asked for by the janitor and the sizing every pass.
        self._slots: dict[tuple[tuple[str, str], tuple[str, str]], int] = {}
        #: Placeholders the API server refused, by name: when to ask again (monotonic
        #: seconds) and the pause that led there.
        self._refused: dict[str, tuple[float, float]] = {}

    async def reconcile(self, pools: Sequence[PoolSpec]) -> None:
        """Create the placeholders `pools` want and delete the others (see the runtime's
        `reconcile_headroom`); `RuntimeFailure` after the other pools when one cannot be
        kept (no priority class, a pool name that is no label value, a refused call).

        A placeholder whose create the API server refused is not asked for again until
        its pause is over (`REFUSED_FIRST_S`, doubling): a quota without room is not sent
        a create every pass, nor the log a warning. A new spec is a new name, tried at once.
        """
        await self.informer.wait_synced()
        wanted: dict[str, Pod] = {}
        problems: list[str] = []
        for pool in pools:
            if pool.headroom_nodes <= 0 or not isinstance(pool.template, PodTemplate):
                continue
            if self.placeholders.priority_class is None:
                problems.append(
                    f"pool {pool.name!r} wants {pool.headroom_nodes} headroom placeholders, but "
                    "no placeholder priority class is set: they would never be preempted"
                )
                continue
            if not valid_label_value(pool.name):
                problems.append(f"pool {pool.name!r} is not a valid Kubernetes label value")
                continue
            for pod in self._placeholders(pool, pool.template):
                wanted[pod.name] = pod
        present: set[str] = set()
        doomed: list[str] = []
        for view in self.informer.placeholder_views():
            if view.terminating:
                continue
            if view.name in wanted and not view.finished:
                present.add(view.name)
            else:
                # Not wanted any more, or finished (evicted): delete, so that a finished
                # placeholder's name is free to be created again on the next pass.
                doomed.append(view.name)
        now = self.clock.monotonic()
        self._refused = {
            name: refused
            for name, refused in self._refused.items()
            if name in wanted and name not in present
        }
        calls: list[Awaitable[Any]] = [self.cluster.delete_pod(name, 0.0) for name in doomed]
        calls += [
            self._create(pod)
            for name, pod in wanted.items()
            if name not in present and self._refused.get(name, (now, 0.0))[0] <= now
        ]
        # Most passes find every placeholder in place: nothing to gather.
        results = await asyncio.gather(*calls, return_exceptions=True) if calls else []
        failures = [r for r in results if isinstance(r, BaseException)]
        for failure in failures:
            if not isinstance(failure, Exception):
                raise failure
            problems.append(str(failure))
        if doomed or len(calls) > len(doomed):
            _log(
                "headroom_reconciled",
                wanted=len(wanted),
                deleted=len(doomed),
                created=len(calls) - len(doomed),
                failed=len(failures),
            )
        if problems:
            raise RuntimeFailure("headroom: " + "; ".join(problems))

    def slots(self, pool: PoolSpec) -> int:
        """Workers of `pool` one placeholder makes room for: 1 when placeholders are sized
        as a worker, else how many workers fit in one by CPU and by memory."""
        size, template = self.placeholders.size, pool.template
        if size is None or not isinstance(template, PodTemplate):
            return 1
        asked = (template.cpu, template.memory)
        slots = self._slots.get((size, asked))
        if slots is None:
            fits = []
            for held, needed in zip(size, asked, strict=True):
                have, need = parse_quantity(held), parse_quantity(needed)
                if need:
                    fits.append(int(have / need))
            slots = self._slots[size, asked] = max(1, min(fits, default=1))
        return slots

    def requests(self, pool: PoolSpec) -> tuple[float, float]:
        """(CPUs, GiB) one placeholder of `pool` requests: its size, else a worker's;
        (0, 0) for a pool without a pod template (it has no placeholders)."""
        template = pool.template
        if not isinstance(template, PodTemplate):
            return 0.0, 0.0
        cpu, memory = self.placeholders.size or (template.cpu, template.memory)
        return float(parse_quantity(cpu)), float(parse_quantity(memory) / 2**30)

    def _placeholders(self, pool: PoolSpec, template: PodTemplate) -> list[Pod]:
        made_from = (template, pool.headroom_nodes)
        cached = self._pods.get(pool.name)
        if cached is not None and cached[0] == made_from:
            return cached[1]
        pods = list(
            placeholder_pods(
                pool,
                template,
                fleet=self.fleet,
                image=self.placeholders.image,
                priority_class=self.placeholders.priority_class,
                size=self.placeholders.size,
            )
        )
        self._pods[pool.name] = (made_from, pods)
        return pods

    async def _create(self, pod: Pod) -> None:
        try:
            await self.cluster.create_pod(pod)
        except Conflict:
            pass  # created by another leader, or by us before the cache saw it
        except (Forbidden, Invalid):
            _, pause = self._refused.get(pod.name, (0.0, 0.0))
            pause = min(REFUSED_MAX_S, 2 * pause or REFUSED_FIRST_S)
            self._refused[pod.name] = (self.clock.monotonic() + pause, pause)
            raise
        self._refused.pop(pod.name, None)
