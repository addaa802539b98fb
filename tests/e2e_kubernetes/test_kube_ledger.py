"""The ledger (docs/warmth.md) and the claim log (docs/claim-log.md) of a Kubernetes pool,
checked against what the API server itself recorded, not against stoker's own view.

Real: kube-apiserver and kube-scheduler, `stoker serve` with the manifests' Role (its pod
informer, its creates and deletes, the leader's headroom placeholder), and the CLI
(`stoker claims export`, `stoker backtest --url`) against that server.
Fake: the kubelet (fake_kubelet.py). A bound pod becomes a local demo-worker process on
a loopback address, reported Ready once its port accepts; requests are only what the
scheduler sees (no cgroups), which is all the ledger prices: requests x time.

What the API server shows, and the test reads: each pod's create and delete requests
(stoker's, then the kubelet's final one once the worker exited, `--stop-delay` after its
SIGTERM) and the kubelet's status patches (the audit log, to the microsecond), its Ready condition
(whole seconds), the requests in its spec. The clients' own view of their claims
(the `source` each got, when each was sent and answered) checks the claim counts and the
hot and parked time. One server and one scenario serve every check (the tier's time).
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from e2e_support import ADMIN, INTERVALS, StartStoker, Stoker, pod_template, pool
from kube_control_plane import AuditEvent, ControlPlane, stoker_user, until
from prometheus_client.parser import text_string_to_metric_families

import stoker
from servers import STOKER, environment

pytestmark = [pytest.mark.e2e_kubernetes, pytest.mark.timeout(180)]

#: Prices of the pool (any currency); distinct, so that a cpu/memory mix-up shows.
PER_CPU_HOUR, PER_GIB_HOUR = 0.36, 0.072
#: A placeholder of 1.1 CPUs and 256 MiB: room for 4 workers of 250m and 64 MiB (4.4 by
#: CPU, 4 by memory), so that worker slots x a worker's requests (1 CPU) would misprice
#: what it holds on its node (1.1 CPUs).
PLACEHOLDER_CPU, PLACEHOLDER_MEMORY = "1100m", "256Mi"
#: A pass of the replica that writes the ledger (every fallback-reaper pass).
PASS_S = float(INTERVALS["reaper_interval_s"])
#: What one worker's span may run past its pod's create request, and its draining time
#: past its pod's termination: the store write before each (the slot's, the drain's).
WRITE_SLACK_S = 0.5
#: How far one of stoker's stamps may be off: its clock is the event loop's, read once per
#: loop iteration (uvloop: in milliseconds), and an iteration on a loaded machine takes
#: tens of milliseconds.
CLOCK_S = 0.05
#: How long a worker takes to exit on SIGTERM (`--stop-delay`), within its pool's
#: `stop_grace_s`: its pod terminates, holding its requests on the node, that long.
STOP_DELAY_S, STOP_GRACE_S = 1.5, 5
#: The demo worker's arguments: it exits `STOP_DELAY_S` after SIGTERM.
WORKER_ARGS = [
    *("--port", "{port}", "--worker-id", "{worker_id}", "--host", "0.0.0.0"),
    *("--stop-delay", str(STOP_DELAY_S)),
]
#: Where the `stoker` package under test lives.
SOURCE = str(Path(stoker.__file__).resolve().parents[1])
#: How late stoker may hear of a pod's removal: the watch's delivery of its DELETED event.
WATCH_S = 0.25
#: Worker states of the ledger (placeholders apart).
WORKER_STATES = ("warm_s", "hot_s", "hot_idle_s", "starting_s", "draining_s")


def quantity(text: str) -> float:
    """A Kubernetes quantity of the forms this test uses ("250m", "64Mi", "2")."""
    for suffix, scale in (("m", 1e-3), ("Ki", 2.0**10), ("Mi", 2.0**20), ("Gi", 2.0**30)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text)


def rfc3339(text: str) -> float:
    """Unix seconds of a Kubernetes time ("2026-12-07T12:00:00Z")."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@dataclass
class PodLife:
    """One pod as the API server recorded it."""

    name: str
    cpu: float
    gib: float
    #: The Ready condition's transition to True (whole seconds), None while not seen.
    ready_at: float | None = None
    created: float = math.nan
    #: When the API server answered the create (stoker's spawn-to-ready starts after).
    create_answered: float = math.nan
    #: The kubelet's last status patch before stoker's delete: the one that made it Ready.
    readied: float = math.nan
    #: Stoker's delete request (the pod terminates from here).
    deleted: float = math.nan
    #: Its removal (the kubelet's final delete once the process is gone).
    removed: float = math.nan

    @property
    def held_s(self) -> float:
        """From its create to stoker's delete."""
        return self.deleted - self.created

    @property
    def lived_s(self) -> float:
        """From its create to its removal: it holds its requests on the node till then."""
        return self.removed - self.created

    @property
    def terminating_s(self) -> float:
        """From stoker's delete to its removal."""
        return self.removed - self.deleted


class PodRecord:
    """The fleet's pods as the admin client sees them, polled: each pod's requests and
    Ready time, kept after the pod is gone; creates and deletes from the audit log."""

    def __init__(self, kube: ControlPlane, fleet: str) -> None:
        assert kube.admin is not None
        self.kube, self.admin, self.fleet = kube, kube.admin, fleet
        self.workers: dict[str, PodLife] = {}
        self.placeholders: dict[str, PodLife] = {}

    def poll(self) -> int:
        """Look at the fleet's pods now; how many worker pods exist."""
        alive = 0
        for pod in self.admin.pods(f"stoker.dev/fleet={self.fleet}"):
            labels = pod["metadata"].get("labels", {})
            name = pod["metadata"]["name"]
            kept = self.placeholders if "stoker.dev/placeholder" in labels else self.workers
            if kept is self.workers:
                alive += 1
            life = kept.get(name)
            if life is None:
                requests = pod["spec"]["containers"][0]["resources"]["requests"]
                life = kept[name] = PodLife(
                    name, quantity(requests["cpu"]), quantity(requests["memory"]) / 2**30
                )
            for condition in pod.get("status", {}).get("conditions", []):
                if condition["type"] == "Ready" and condition["status"] == "True":
                    life.ready_at = life.ready_at or rfc3339(condition["lastTransitionTime"])
        return alive

    def read_audit(self, since: float) -> None:
        """Each pod's create, stoker's delete and its removal, from the audit log."""
        events: list[AuditEvent] = [
            e
            for e in self.kube.audit_events()
            if e.at >= since and e.resource == "pods" and e.subresource in ("", "status")
        ]
        for life in [*self.workers.values(), *self.placeholders.values()]:
            mine = [e for e in events if e.name == life.name]
            creates = [
                e for e in mine if e.verb == "create" and e.status == 201 and not e.subresource
            ]
            assert len(creates) == 1, (life.name, creates)
            life.created, life.create_answered = creates[0].at, creates[0].answered
            deletes = [e for e in mine if e.verb == "delete" and e.status == 200]
            by_stoker = [e.at for e in deletes if e.user == stoker_user()]
            if by_stoker:
                life.deleted = by_stoker[0]
            if deletes:
                life.removed = deletes[-1].at
            patched = [
                e.at
                for e in mine
                if e.subresource == "status"
                and e.status == 200
                and (math.isnan(life.deleted) or e.at < life.deleted)
            ]
            if patched:
                life.readied = patched[-1]


@dataclass
class Held:
    """One claim as its client saw it."""

    id: str
    org: str
    source: str
    worker: str
    sent: float
    answered: float
    release_sent: float = math.nan
    released: float = math.nan


def claim(stoker: Stoker, org: str, **extra: Any) -> Held:
    """Claim a worker of `duck` for `org`; the claim as its client saw it."""
    sent = time.time()
    response = stoker.claim(org, **extra)
    answered = time.time()
    assert response.status_code == 201, response.text
    body = response.json()
    return Held(body["id"], org, body["source"], body["worker"]["id"], sent, answered)


def release(stoker: Stoker, held: Held) -> None:
    """Release the claim, noting when."""
    held.release_sent = time.time()
    assert stoker.release(held.id).status_code in (200, 204)
    held.released = time.time()


def ledger(stoker: Stoker, since: float, by: str | None = None) -> dict[str, Any]:
    """`GET /v1/pools/duck/ledger` from `since` (unix seconds) to now."""
    params = {"since": f"{since:.0f}"} | ({"by": by} if by else {})
    response = stoker.http.get("/v1/pools/duck/ledger", params=params)
    assert response.status_code == 200, response.text
    return dict(response.json())


def worker_s(row: dict[str, Any]) -> float:
    """A ledger row's worker-seconds, placeholders apart."""
    return sum(float(row[name]) for name in WORKER_STATES)


def cli(*args: str, url: str) -> subprocess.CompletedProcess[str]:
    """The `stoker` CLI against the server at `url` (`--url` before the command) with the
    admin token."""
    return subprocess.run(
        [STOKER, "--url", url, "--token", ADMIN, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=environment(),
        stdin=subprocess.DEVNULL,
        check=False,
    )


def test_the_ledger_and_the_claim_log_match_the_api_server(
    kube: ControlPlane, start_stoker: StartStoker, fleet: str
) -> None:
    started = time.time()
    stoker = start_stoker(
        [
            pool(
                kube,
                warm_target=2,
                hot_idle_ttl=3,
                max_workers_per_org=1,
                headroom_nodes=1,
                # Workers that take a while to exit on SIGTERM: their pods terminate.
                # The demo worker of the checkout under test (the kubelet passes on no
                # environment of its own).
                pod=pod_template(kube, args=WORKER_ARGS, env={"PYTHONPATH": SOURCE}),
                timeouts={"spawn_s": 30, "stop_grace_s": STOP_GRACE_S, "activation_s": 10},
                # A constant headroom (one placeholder throughout), and no warm workers on
                # top of the target from the few claims here (so that the wind-down ends).
                demand={"headroom": "constant", "quantile": 0.5, "forecast": False},
                cost={"per_cpu_hour": PER_CPU_HOUR, "per_gib_hour": PER_GIB_HOUR},
            )
        ],
        runtime={"placeholder_size": {"cpu": PLACEHOLDER_CPU, "memory": PLACEHOLDER_MEMORY}},
    )
    record = PodRecord(kube, fleet)
    until(lambda: record.poll() >= 2 and stoker.pool()["counts"]["warm"] == 2, 60, "two warm")
    until(lambda: record.placeholders, 30, "the placeholder created")

    # Warm workers idle a while; then a warm claim, parked on release (reuse: same_org),
    # and a cold one (a spawn for the claim), parked too; both parked workers retire at
    # their TTL.
    time.sleep(3)
    record.poll()
    warm = claim(stoker, "org-a")
    time.sleep(2)
    release(stoker, warm)
    record.poll()
    cold = claim(stoker, "org-b", mode="cold")
    record.poll()
    # org-b holds its one worker (`max_workers_per_org`): a claim that waits for nothing
    # is refused.
    refused = stoker.claim("org-b", timeout_s=0)
    assert refused.status_code == 429, refused.text
    time.sleep(1)
    release(stoker, cold)
    assert (warm.source, cold.source) == ("warm", "cold")

    # Wind down: a drained pool's warm workers retire (at once, without a scale-down
    # delay), and its headroom goes (it spawns for no claim any more): every pod goes.
    patched = stoker.http.patch("/v1/pools/duck", json={"scale_down_delay": 0})
    assert patched.status_code == 200, patched.text
    drained = stoker.http.post("/v1/pools/duck/drain")
    assert drained.status_code == 200, drained.text
    until(lambda: record.poll() == 0, 30, "every worker pod gone")
    admin, placeholders = record.admin, f"stoker.dev/fleet={fleet},stoker.dev/placeholder"
    until(lambda: not admin.pods(placeholders), 10, "the placeholder deleted")
    # Every retirement is written by the flush after it: the ledger stops growing.
    last: list[float] = []

    def settled() -> dict[str, Any] | None:
        total = ledger(stoker, started)["total"]
        last.append(worker_s(total))
        return total if len(last) > 2 and last[-1] == last[-3] else None

    until(settled, 10, "the ledger settled", interval=PASS_S)
    total = ledger(stoker, started)["total"]
    by_org = {row["group"]: row for row in ledger(stoker, started, by="org")["rows"]}
    record.read_audit(started)

    workers = record.workers
    # Every worker pod was created, became Ready and was deleted, as the API server saw.
    assert len(workers) >= 4, workers  # two warm, the refill, the cold one
    for life in workers.values():
        assert life.ready_at is not None, life
        assert life.created <= life.deleted <= life.removed, life
    a_pod, b_pod = workers[warm.worker], workers[cold.worker]

    # -- worker-seconds against the pods' lifetimes --------------------------------------
    # Each worker is counted from its spawn slot (written just before its pod's create)
    # to its pod's removal (the kubelet's final delete, once the worker exited on SIGTERM,
    # as stoker's watch hears of it): its pod's whole life on its node, plus the slot's
    # write and the watch's delivery.
    for life in workers.values():
        assert STOP_DELAY_S <= life.terminating_s < STOP_GRACE_S, life
    lives = sum(life.lived_s for life in workers.values())
    counted = worker_s(total)
    slack = (WRITE_SLACK_S + WATCH_S) * len(workers)
    clock = CLOCK_S * len(workers)
    assert lives - clock <= counted <= lives + slack, (counted, lives, slack)
    # Draining: from the drain (just before stoker's delete) through the termination.
    terminating = sum(life.terminating_s for life in workers.values())
    assert terminating - clock <= total["draining_s"] <= terminating + slack, (
        total["draining_s"],
        terminating,
    )

    # Per org: a worker is the org's from its reservation (the claim) to its pod's removal.
    org_a = by_org["org-a"]
    assert a_pod.removed - warm.answered - CLOCK_S <= worker_s(org_a)
    assert worker_s(org_a) <= a_pod.removed - warm.sent + WRITE_SLACK_S + WATCH_S
    # A cold spawn is the claim's org's from its start.
    org_b = by_org["org-b"]
    assert b_pod.lived_s - CLOCK_S <= worker_s(org_b)
    assert worker_s(org_b) <= b_pod.removed - cold.sent + WRITE_SLACK_S + WATCH_S
    # Neutral time: every other pod's whole life, and the warm pod's until its claim.
    neutral = lives - a_pod.lived_s - b_pod.lived_s + (warm.sent - a_pod.created)
    assert neutral - clock <= worker_s(by_org[""]) <= neutral + slack
    # Hot: from the claim's answer (or earlier) to the release (or its answer).
    hot_low = sum(h.release_sent - h.answered for h in (warm, cold))
    hot_high = sum(h.released - h.sent for h in (warm, cold))
    assert hot_low - 2 * CLOCK_S <= total["hot_s"] <= hot_high, (total["hot_s"], hot_low)
    # Parked: from the release to the drain that precedes stoker's delete of the pod.
    parked_low = sum(p.deleted - h.released for p, h in ((a_pod, warm), (b_pod, cold)))
    parked_high = sum(p.deleted - h.release_sent for p, h in ((a_pod, warm), (b_pod, cold)))
    assert parked_low - 2 * WRITE_SLACK_S <= total["hot_idle_s"] <= parked_high
    assert total["hot_idle_s"] >= 2 * 3.0  # two TTLs of 3 s
    # Warm: from Ready (stoker hears of the kubelet's patch, then writes) to the drain
    # before stoker's delete, or to the claim (the cold spawn never was warm).
    others = [life for life in workers.values() if life not in (a_pod, b_pod)]
    warm_high = sum(life.deleted - life.readied for life in others)
    warm_high += warm.answered - a_pod.readied + clock
    warm_low = warm_high - (warm.answered - warm.sent) - slack - 2 * clock
    assert warm_low <= total["warm_s"] <= warm_high, (total["warm_s"], warm_low, warm_high)
    assert total["starting_s"] > 0 and total["draining_s"] > 0

    # -- resource-seconds and money -------------------------------------------------------
    cpus = {life.cpu for life in workers.values()}
    gibs = {life.gib for life in workers.values()}
    assert (cpus, gibs) == ({0.25}, {64 / 1024})  # the template's requests, as created
    cpu, gib = cpus.pop(), gibs.pop()
    assert total["cpu_s"] == pytest.approx(counted * cpu, rel=1e-9)
    assert total["gib_s"] == pytest.approx(counted * gib, rel=1e-9)
    per_worker_s = (cpu * PER_CPU_HOUR + gib * PER_GIB_HOUR) / 3600
    assert total["idle_warm_cost"] == pytest.approx(total["warm_s"] * per_worker_s, rel=1e-9)
    assert total["idle_parked_cost"] == pytest.approx(total["hot_idle_s"] * per_worker_s, rel=1e-9)

    # -- the headroom placeholder -----------------------------------------------------------
    # One placeholder stood from the start until the drain: stoker deleted it.
    (held,) = record.placeholders.values()
    assert held.created < held.deleted, held
    # Room for 4 workers: by CPU 1.1 / 0.25 = 4.4, by memory 256 / 64 = 4.
    assert (held.cpu, held.gib) == pytest.approx((1.1, 0.25))
    slots = min(int(held.cpu / cpu), int(held.gib / gib))
    assert slots == 4
    # Counted from the leader's pass that asked for it (just before its create) to the
    # pass that dropped it (just before its delete).
    standing = total["placeholder_s"] / slots
    assert abs(standing - held.held_s) <= PASS_S, (standing, held.held_s)
    # Priced as what it holds on its node: its own requests.
    per_placeholder_s = (held.cpu * PER_CPU_HOUR + held.gib * PER_GIB_HOUR) / 3600
    assert total["headroom_cost"] == pytest.approx(standing * per_placeholder_s, rel=1e-6)
    assert total["total_cost"] == pytest.approx(
        counted * per_worker_s + total["headroom_cost"], rel=1e-9
    )
    # The metrics count the same (one replica, from its start), at the same prices.
    metered = {
        (sample.name, sample.labels.get("state") or sample.labels.get("kind")): sample.value
        for family in text_string_to_metric_families(stoker.http.get("/metrics").text)
        for sample in family.samples
        if sample.labels.get("pool") == "duck"
    }
    for state in ("warm", "hot", "hot_idle", "starting", "draining", "placeholder"):
        seconds = metered[("stoker_ledger_worker_seconds_total", state)]
        assert seconds == pytest.approx(total[f"{state}_s"], rel=1e-6), state
    for kind, field in (("warm", "idle_warm_cost"), ("parked", "idle_parked_cost")):
        assert metered[("stoker_ledger_idle_cost_total", kind)] == pytest.approx(total[field])
    headroom = metered[("stoker_ledger_idle_cost_total", "headroom")]
    assert headroom == pytest.approx(total["headroom_cost"], rel=1e-6)

    # -- spawns, readiness, claims ------------------------------------------------------------
    assert total["spawns"] == len(workers)
    assert total["ready"] == len(workers) == sum(total["ready_hist"])
    # Spawn-to-ready of each pod: stoker times it from its create's answer (a wait for the
    # client's budget before is the queue of other spawns) to when its informer hears of
    # the kubelet's Ready patch: at least the answer to the patch's arrival, at most the
    # create's arrival to the patch's plus the watch's delivery.
    for life in workers.values():
        # The last status patch is the Ready one: its condition's stamp is the second in
        # which the kubelet wrote it, and the API server receives it a little later (past
        # that second's end on a loaded machine).
        assert life.ready_at is not None
        assert life.ready_at <= life.readied < life.ready_at + 1 + WRITE_SLACK_S, life
    low = [life.readied - life.create_answered for life in workers.values()]
    high = [life.readied - life.created + WRITE_SLACK_S for life in workers.values()]
    assert sum(low) - clock <= total["ready_sum_s"] <= sum(high), (total["ready_sum_s"], low)
    assert (total["claims_warm"], total["claims_cold"], total["claims_reuse"]) == (1, 1, 0)
    assert total["failed"] == 1
    # A cold claim waits for its pod from before the create until after it is Ready.
    assert low[list(workers).index(b_pod.name)] - CLOCK_S <= total["wait_cold_s"]
    assert total["wait_cold_s"] <= cold.answered - cold.sent

    # -- the claim log, exported with the CLI -------------------------------------------------
    exported = cli(
        "claims", "export", "--since", f"{started:.0f}", "--pool", "duck", url=stoker.server.url
    )
    assert exported.returncode == 0, exported.stderr
    log = [json.loads(line) for line in exported.stdout.splitlines()]
    assert [(e["org"], e["mode"], e["source"], e["outcome"]) for e in log] == [
        ("org-a", "prefer_warm", "warm", "released"),
        ("org-b", "cold", "cold", "released"),
        ("org-b", "prefer_warm", None, "org_cap"),
    ]
    # Each arrived while its client waited, and was held from its answer to its release.
    for entry, held_by in zip(log, (warm, cold), strict=False):
        assert held_by.sent - CLOCK_S <= entry["at"] <= held_by.answered + CLOCK_S
        assert held_by.release_sent - held_by.answered - 2 * CLOCK_S <= entry["held_s"]
        assert entry["held_s"] <= held_by.released - held_by.sent + 2 * CLOCK_S

    # -- the backtest, with the spawn time the ledger measured --------------------------------
    replayed = subprocess.run(
        [STOKER, "backtest", "--url", stoker.server.url, "--token", ADMIN, "--since",
         f"{started:.0f}", "--pool", "duck", "--json", "--no-progress"],
        capture_output=True, text=True, timeout=60, env=environment(), check=False,
    )  # fmt: skip
    assert replayed.returncode == 0, replayed.stderr
    spawn = json.loads(replayed.stdout)["spawn_s"]
    assert spawn["source"] == "the server's ledger"
    assert spawn["p50"] == pytest.approx(total["mean_ready_s"])
    assert min(low) - CLOCK_S <= spawn["p50"] <= max(high), (spawn, low)
