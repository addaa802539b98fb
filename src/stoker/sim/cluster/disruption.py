"""PodDisruptionBudgets and the Eviction API's decision.

Kubernetes' API-initiated eviction (the `pods/eviction` subresource a drain uses) answers
200 when the eviction is allowed, 429 when a PodDisruptionBudget would be violated
("retry later") and 500 when several budgets match the pod. A pod with no budget can
always be evicted. The arithmetic follows the disruption controller:

- healthy pods are Ready and not terminating;
- desired healthy is `minAvailable` (a percentage rounds up), or expected minus
  `maxUnavailable` (a percentage rounds up), where expected is the owning controller's
  replica count when known and otherwise the number of matching pods not terminating;
- disruptions allowed = healthy - desired healthy; an eviction of a healthy pod needs
  at least one. An unready pod may always be evicted (`AlwaysAllow`).

Counts are kept up to date from the cluster's change listener, so a check is O(1).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from enum import StrEnum

from stoker.domain.errors import ConfigError
from stoker.sim.cluster.model import PodDisruptionBudget, SimPod, is_healthy


class EvictionVerdict(StrEnum):
    """What the Eviction API answers."""

    ALLOWED = "allowed"  # 200
    BUDGET = "budget"  # 429: a PodDisruptionBudget would be violated
    AMBIGUOUS = "ambiguous"  # 500: more than one budget selects the pod


class DisruptionBudgets:
    """Every PodDisruptionBudget, indexed by one label of its selector."""

    def __init__(self) -> None:
        self._by_name: dict[tuple[str, str], PodDisruptionBudget] = {}
        self._by_label: dict[tuple[str, str, str], list[PodDisruptionBudget]] = {}
        self._select_all: dict[str, list[PodDisruptionBudget]] = {}
        #: Evictions the Eviction API allowed and carried out, and those it refused.
        self.evictions = 0
        self.refusals = 0

    def __iter__(self) -> Iterator[PodDisruptionBudget]:
        return iter(list(self._by_name.values()))

    def get(self, namespace: str, name: str) -> PodDisruptionBudget | None:
        """The budget, or None."""
        return self._by_name.get((namespace, name))

    def add(self, budget: PodDisruptionBudget, pods: Iterable[SimPod]) -> None:
        """Register `budget` and count the matching pods among `pods`."""
        key = (budget.namespace, budget.name)
        if key in self._by_name:
            raise ConfigError(f"PDB {budget.namespace}/{budget.name} already exists")
        self._by_name[key] = budget
        self._bucket(budget).append(budget)
        for pod in pods:
            if budget.matches(pod):
                self._join(budget, pod)

    def remove(self, namespace: str, name: str) -> None:
        """Delete the budget (its pods become freely evictable)."""
        budget = self._by_name.pop((namespace, name), None)
        if budget is None:
            return
        self._bucket(budget).remove(budget)
        for pod in budget.members:
            pod.pdbs.remove(budget)

    def pod_added(self, pod: SimPod) -> None:
        """A new pod: join every budget that selects it."""
        for budget in self._candidates(pod):
            if budget.matches(pod):
                self._join(budget, pod)

    def pod_relabelled(self, pod: SimPod) -> None:
        """The pod's labels changed: leave and join budgets accordingly."""
        for budget in list(pod.pdbs):
            if not budget.matches(pod):
                self._leave(budget, pod)
        for budget in self._candidates(pod):
            if budget not in pod.pdbs and budget.matches(pod):
                self._join(budget, pod)

    def pod_changed(self, pod: SimPod, *, was_healthy: bool, was_terminating: bool) -> None:
        """The pod's readiness or termination changed: adjust the counts."""
        healthy = is_healthy(pod)
        for budget in pod.pdbs:
            budget.healthy += int(healthy) - int(was_healthy)
            budget.terminating += int(pod.terminating) - int(was_terminating)

    def pod_removed(self, pod: SimPod) -> None:
        """The pod is gone."""
        for budget in list(pod.pdbs):
            self._leave(budget, pod)

    def evict(self, pod: SimPod) -> EvictionVerdict:
        """The Eviction API: delete the pod gracefully unless a budget forbids it (429) or
        several budgets select it (500); the verdict either way."""
        verdict = self.verdict(pod)
        if verdict is EvictionVerdict.ALLOWED:
            self.evictions += 1
            pod.server.evict(pod.name, delete=True)
        else:
            self.refusals += 1
        return verdict

    def verdict(self, pod: SimPod) -> EvictionVerdict:
        """The Eviction API's answer for `pod` right now."""
        if len(pod.pdbs) > 1:
            return EvictionVerdict.AMBIGUOUS
        if pod.pdbs and is_healthy(pod) and pod.pdbs[0].disruptions_allowed() < 1:
            return EvictionVerdict.BUDGET
        return EvictionVerdict.ALLOWED

    def _bucket(self, budget: PodDisruptionBudget) -> list[PodDisruptionBudget]:
        if not budget.spec.selector:
            return self._select_all.setdefault(budget.namespace, [])
        key, value = min(budget.spec.selector.items())
        return self._by_label.setdefault((budget.namespace, key, value), [])

    def _candidates(self, pod: SimPod) -> list[PodDisruptionBudget]:
        if not self._by_name:
            return []
        found = list(self._select_all.get(pod.namespace, ()))
        if self._by_label:
            for key, value in pod.labels.items():
                found.extend(self._by_label.get((pod.namespace, key, value), ()))
        return found

    def _join(self, budget: PodDisruptionBudget, pod: SimPod) -> None:
        budget.members[pod] = None
        pod.pdbs.append(budget)
        budget.healthy += int(is_healthy(pod))
        budget.terminating += int(pod.terminating)

    def _leave(self, budget: PodDisruptionBudget, pod: SimPod) -> None:
        del budget.members[pod]
        pod.pdbs.remove(budget)
        budget.healthy -= int(is_healthy(pod))
        budget.terminating -= int(pod.terminating)
