"""Three real `stoker serve` processes on one PostgreSQL schema: a killed leader, a lease
blip and a stalled leader, failing store writes under a claim workload, and the ledger of
a fleet whose every call goes to any replica.

Every replica is the `stoker` command with its own port, configured through `STOKER_*`
environment overrides (short intervals and lease timings), running local demo workers.
Faults come from outside, as in production: SIGKILL, SIGSTOP/SIGCONT, and a PL/pgSQL
trigger in the test's schema that makes PostgreSQL refuse writes. The tests observe what
an operator would: `/metrics`, `/v1/pools`, `/v1/workers`, `/v1/claims/...`, the worker
processes, and the store read with psycopg. Every wait is a bounded poll of an observable
condition; the in-process versions of these faults are in tests/control/test_multi_replica.py.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from servers import DEMO, STOKER, environment, wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.processes, pytest.mark.slow]

ADMIN = "replicas-admin-token-0123456789"
LIVE = ("spawning", "warm", "reserved", "activating", "hot", "hot_idle", "draining")
IN_FLIGHT = ("spawning", "reserved", "activating", "draining")

#: Lease timings of the janitor's store lease (seconds): a leader steps down 2 s after its
#: last renewal, and nobody else may take the lease before 3 s have passed.
LEASE, RENEW_DEADLINE, RETRY = 3.0, 2.0, 0.5
INTERVALS: dict[str, Any] = {
    "janitor_interval_s": 0.25,
    "reaper_interval_s": 0.25,
    "instance_heartbeat_s": 0.25,
    "instance_expiry_s": 2.0,
    "demand_window_s": 2.0,
    "shutdown_grace_s": 2.0,
}
#: How long after the leader's death another replica leads at the latest: the lease runs
#: out and a survivor's next attempt, one retry period later, takes it (plus two janitor
#: intervals of margin for the polls).
FAILOVER_S = LEASE + RETRY + 2 * INTERVALS["janitor_interval_s"]
#: Allowance for a busy two-core machine on top of every protocol bound below.
SLACK_S = 3.0
#: How long a claim may wait on the server before it answers 503.
CLAIM_TIMEOUT_S = 10


def pool(name: str = "demo", *, start_delay: float = 0.0, **overrides: Any) -> dict[str, Any]:
    """A pool of demo workers (optionally slow to become ready)."""
    command = list(DEMO) + (["--start-delay", str(start_delay)] if start_delay else [])
    spec: dict[str, Any] = {
        "name": name,
        "command": command,
        "memory_mb": 32,
        "warm_target": 2,
        "max_workers": 20,
        "hot_idle_ttl": 60,
        "scale_down_delay": 600,
        "lease_s": 60,
        "claim_timeout_s": CLAIM_TIMEOUT_S,
        "timeouts": {"spawn_s": 20, "stop_grace_s": 1},
    }
    spec.update(overrides)
    return spec


# -- the harness ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Replica:
    """One `stoker serve` on a fixed port; each (re)start is a new instance."""

    index: int
    port: int
    workdir: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    generation: int = 0
    paused: bool = False
    instance: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def serving(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and not self.paused

    def log(self) -> str:
        path = self.workdir / f"serve-{self.generation}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self) -> None:
        """Start a new generation in a process group of its own (see `kill`)."""
        self.generation += 1
        self.instance = ""
        with open(self.workdir / f"serve-{self.generation}.log", "wb") as log:
            self.proc = subprocess.Popen(
                [STOKER, "serve"],
                cwd=self.workdir,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL its process group: no shutdown at all. Its workers (each in a session of
        its own) live on, and its rows stay as they were."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.paused = False
        self.proc.wait(30)

    def pause(self) -> None:
        self.signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.paused:
            self.signal(signal.SIGCONT)
            self.paused = False


@dataclass(frozen=True)
class WorkerProcess:
    """A worker process and the labels the runtime gave it."""

    process: psutil.Process
    worker_id: str
    pool: str
    instance: str


@dataclass
class Sample:
    """One round of leader gauges: replica index -> value (None: stopped or silent)."""

    gauges: dict[int, float | None]
    seconds: float


class Fleet:
    """Three replicas on one schema of their own, with one worker-process label."""

    def __init__(
        self,
        postgres_url: str,
        workdir: Path,
        *,
        pools: list[dict[str, Any]],
        intervals: dict[str, Any] | None = None,
        count: int = 3,
    ) -> None:
        token = uuid.uuid4().hex[:8]
        self.postgres_url = postgres_url
        self.schema = f"stoker_e2e_{token}"
        self.label = f"e2e-{token}"
        self.replicas: list[Replica] = []
        settings = {**INTERVALS, **(intervals or {})}
        for index in range(count):
            env = environment(
                STOKER_STORE=f"{postgres_url}?application_name={self.label}-r{index}",
                STOKER_STORE_OPTIONS__SCHEMA=self.schema,
                STOKER_FLEET=self.label,
                STOKER_API__ADMIN_TOKENS=ADMIN,
                # Replicas of one store share one fleet activation key.
                STOKER_ACTIVATION__KEY=f"{self.label}-activation-key-shared-by-replicas",
                STOKER_INTERVALS=json.dumps(settings),
                STOKER_POOLS=json.dumps(pools),
            )
            env["STOKER_LEADER_ELECTION"] = json.dumps(
                {
                    "kind": "store",
                    "lease_duration_s": LEASE,
                    "renew_deadline_s": RENEW_DEADLINE,
                    "retry_period_s": RETRY,
                }
            )
            port = _free_port()
            env["STOKER_API__PORT"] = str(port)
            workdir.joinpath(f"r{index}").mkdir(parents=True, exist_ok=True)
            self.replicas.append(Replica(index, port, workdir / f"r{index}", env))
        self.http = httpx.Client(headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)

    # -- processes --------------------------------------------------------------------

    def start(self, *replicas: Replica) -> None:
        """Start replicas (all by default) and wait until each one is ready."""
        chosen = list(replicas) or self.replicas
        for replica in chosen:
            replica.start()
        for replica in chosen:
            self.wait_ready(replica)

    def wait_ready(self, replica: Replica, timeout: float = 60.0) -> None:
        def ready() -> bool:
            assert replica.proc is not None
            if replica.proc.poll() is not None:
                raise AssertionError(f"replica {replica.index} exited:\n{replica.log()}")
            try:
                if self.http.get(replica.url + "/readyz", timeout=1).status_code != 200:
                    return False
            except httpx.HTTPError:
                return False
            for line in replica.log().splitlines():
                if "event=control_plane_started" in line:
                    replica.instance = line.split("instance=", 1)[1].split()[0]
            return bool(replica.instance)

        assert wait_until(ready, timeout), f"replica {replica.index} not ready:\n{replica.log()}"

    def processes(self) -> list[WorkerProcess]:
        """Live worker processes of this fleet, with their labels read once (a process may
        exit any time after; the replicas carry the fleet label too, but no worker id)."""
        found = []
        for process in psutil.process_iter():
            try:
                env = process.environ()
                if env.get("STOKER_FLEET") != self.label or "STOKER_WORKER_ID" not in env:
                    continue
                if process.status() == psutil.STATUS_ZOMBIE:
                    continue
            except psutil.Error:
                continue
            found.append(
                WorkerProcess(
                    process,
                    env["STOKER_WORKER_ID"],
                    env.get("STOKER_POOL", ""),
                    env.get("STOKER_INSTANCE", ""),
                )
            )
        return found

    def close(self) -> None:
        """Kill every replica and every worker of the fleet, then drop the schema."""
        try:
            for replica in self.replicas:
                replica.kill()
        finally:
            processes = [w.process for w in self.processes()]
            for process in processes:
                with contextlib.suppress(psutil.Error):
                    process.kill()
            psutil.wait_procs(processes, timeout=10)
            self.http.close()
            with (
                contextlib.suppress(psycopg.Error),
                psycopg.connect(self.postgres_url, autocommit=True) as conn,
            ):
                conn.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')

    # -- HTTP -------------------------------------------------------------------------

    def metrics(self, replica: Replica, client: httpx.Client | None = None) -> dict[str, float]:
        """The replica's unlabelled metrics, plus `name_total` summed over label sets."""
        text = (client or self.http).get(replica.url + "/metrics", timeout=1).text
        values: dict[str, float] = defaultdict(float)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.labels:
                    values[sample.name] += sample.value
                else:
                    values[sample.name] = sample.value
        return values

    def gauges(self, client: httpx.Client | None = None) -> dict[int, float | None]:
        """`stoker_janitor_is_leader` of every replica (None: stopped, dead or silent)."""
        out: dict[int, float | None] = {}
        for replica in self.replicas:
            out[replica.index] = None
            if replica.serving:
                try:
                    out[replica.index] = self.metrics(replica, client)["stoker_janitor_is_leader"]
                except (httpx.HTTPError, KeyError):
                    pass
        return out

    def wait_leader(self, timeout: float, among: list[Replica] | None = None) -> Replica:
        """The one replica that reports itself leader, once there is exactly one."""
        found: list[Replica] = []

        def one() -> bool:
            gauges = self.gauges()
            found[:] = [r for r in self.replicas if gauges[r.index] == 1]
            return len(found) == 1 and (among is None or found[0] in among)

        assert wait_until(one, timeout, interval=0.1), f"no single leader: {self.gauges()}"
        return found[0]

    def claim(self, replica: Replica, org: str, **body: Any) -> dict[str, Any]:
        """A claim that must bind; the client outwaits the server's claim timeout, so a
        failure shows the server's answer, with the end of the replica's log."""
        response = self.http.post(
            replica.url + "/v1/claims",
            json={"pool": "demo", "org": org, **body},
            timeout=CLAIM_TIMEOUT_S + SLACK_S,
        )
        assert response.status_code == 201, f"{response.text}\n{replica.log()[-4000:]}"
        answer: dict[str, Any] = response.json()
        return answer

    def release(self, replica: Replica, claim_id: str) -> dict[str, Any]:
        response = self.http.delete(f"{replica.url}/v1/claims/{claim_id}")
        assert response.status_code == 200, response.text
        answer: dict[str, Any] = response.json()
        return answer

    def workers(self, replica: Replica, **query: str) -> list[dict[str, Any]]:
        """`GET /v1/workers` (admin): live workers, or those in `state`."""
        response = self.http.get(replica.url + "/v1/workers", params=query)
        assert response.status_code == 200, response.text
        workers: list[dict[str, Any]] = response.json()["workers"]
        return workers

    def sized_alike(self, by: Replica, among: list[Replica]) -> bool:
        """Whether every replica of `among` shows each pool as `by` last sized it, one
        publication (`GET /v1/pools`: figures, who sized it and when)."""
        shown = [
            [
                (p["name"], p["desired_warm"], p["demand"], p["sized_by"], p["sized_at"])
                for p in self.http.get(r.url + "/v1/pools").json()["pools"]
            ]
            for r in among
        ]
        return all(s == shown[0] for s in shown) and {p[3] for p in shown[0]} == {by.instance}

    def worker(self, replica: Replica, worker_id: str) -> dict[str, Any] | None:
        """One worker by id, live or retired."""
        for query in ({}, {"state": "retired"}):
            for w in self.workers(replica, **query):
                if w["id"] == worker_id:
                    return w
        return None

    # -- the store, read directly -------------------------------------------------------

    def sql(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.postgres_url, autocommit=True) as conn:
            cur = conn.execute(query.replace("{s}", f'"{self.schema}"'), params or None)
            return list(cur.fetchall()) if cur.description else []


class StoreFaults:
    """Failed writes injected into PostgreSQL: a trigger raises while a setting says so.

    Every injected failure bumps a sequence first (not rolled back with the failed write).
    """

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        fleet.sql(
            "CREATE TABLE {s}.chaos (id int PRIMARY KEY, write_failure_p float8 NOT NULL, "
            "lease_blip bool NOT NULL)"
        )
        fleet.sql("INSERT INTO {s}.chaos VALUES (1, 0, false)")
        fleet.sql("CREATE SEQUENCE {s}.chaos_failures")
        fleet.sql(
            """CREATE FUNCTION {s}.chaos_fail() RETURNS trigger LANGUAGE plpgsql AS $$
            DECLARE c record;
            BEGIN
                SELECT * INTO c FROM {s}.chaos WHERE id = 1;
                IF (TG_TABLE_NAME = 'leases' AND c.lease_blip)
                   OR (TG_TABLE_NAME <> 'leases' AND random() < c.write_failure_p) THEN
                    PERFORM nextval('{s}.chaos_failures');
                    RAISE EXCEPTION 'injected failure of % on %', TG_OP, TG_TABLE_NAME;
                END IF;
                RETURN NEW;
            END $$"""
        )
        for table in ("workers", "claims", "leases"):
            fleet.sql(
                f"CREATE TRIGGER chaos BEFORE INSERT OR UPDATE ON {{s}}.{table} "
                "FOR EACH ROW EXECUTE FUNCTION {s}.chaos_fail()"
            )

    def write_failures(self, p: float) -> None:
        self.fleet.sql("UPDATE {s}.chaos SET write_failure_p = %s", p)

    def lease_blip(self, on: bool) -> None:
        self.fleet.sql("UPDATE {s}.chaos SET lease_blip = %s", on)

    def injected(self) -> int:
        ((value, called),) = self.fleet.sql("SELECT last_value, is_called FROM {s}.chaos_failures")
        return int(value) if called else 0


@dataclass
class LeaderSampler:
    """Samples every replica's leader gauge in a thread; a stopped replica is not asked."""

    fleet: Fleet
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> LeaderSampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        with httpx.Client(timeout=1) as client:
            while not self._stop.wait(0.1):
                started = time.perf_counter()
                gauges = self.fleet.gauges(client)
                self.samples.append(Sample(gauges, time.perf_counter() - started))

    def double_leaders(self) -> list[Sample]:
        """Samples in which two replicas reported 1, taken faster than a handover can be
        (a leader steps down `LEASE - RENEW_DEADLINE` before anyone may take over)."""
        return [
            s
            for s in self.samples
            if sum(1 for g in s.gauges.values() if g == 1) > 1
            and s.seconds < LEASE - RENEW_DEADLINE
        ]


@pytest.fixture
def make_fleet(postgres_url: str, tmp_path: Path) -> Iterator[Callable[..., Fleet]]:
    fleets: list[Fleet] = []

    def make(**kw: Any) -> Fleet:
        fleet = Fleet(postgres_url, tmp_path / f"fleet{len(fleets)}", **kw)
        fleets.append(fleet)
        return fleet

    try:
        yield make
    finally:
        for fleet in fleets:
            fleet.close()


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# -- a killed leader --------------------------------------------------------------------------


def test_a_killed_leader_is_replaced_and_its_workers_are_adopted(
    make_fleet: Callable[..., Fleet],
) -> None:
    fleet = make_fleet(
        pools=[
            pool("demo"),
            # Workers that take a minute to become ready: the leader always has spawns in
            # flight, so it dies with some.
            pool("slow", start_delay=60, timeouts={"spawn_s": 120, "stop_grace_s": 1}),
        ],
        # Stranded processes (a spawn the store never heard of) are stopped within seconds.
        intervals={"stranded_grace_s": 3, "stranded_scan_s": 1},
    )
    fleet.start()
    leader = fleet.wait_leader(FAILOVER_S + SLACK_S)
    survivors = [r for r in fleet.replicas if r is not leader]

    def owned(state: str, pool_name: str = "demo") -> list[dict[str, Any]]:
        return [
            w
            for w in fleet.workers(survivors[0], state=state, pool=pool_name)
            if w["owner"] == leader.instance
        ]

    def slow_processes(instance: str) -> dict[str, int]:
        """Worker id -> pid of the slow pool's processes that `instance` started."""
        return {
            p.worker_id: p.process.pid
            for p in fleet.processes()
            if (p.instance, p.pool) == (instance, "slow")
        }

    def at_target() -> bool:
        return (
            len(owned("warm")) >= 2
            and len(owned("spawning", "slow")) == 2
            and len(slow_processes(leader.instance)) == 2
        )

    # The leader keeps the pools warm, so it owns their workers. Claimed through the leader
    # once they are warm (a claim that found none would raise the demand, and with it the
    # warm count), it owns a session and a parked worker too.
    assert wait_until(at_target, 30), fleet.workers(survivors[0])
    session = fleet.claim(leader, "acme", lease_s=120)
    fleet.release(leader, fleet.claim(leader, "globex")["id"])
    assert wait_until(at_target, 30), fleet.workers(survivors[0])
    # Every replica shows the leader's sizing of each pool, not its own memory's.
    assert wait_until(lambda: fleet.sized_alike(leader, fleet.replicas), 5, 0.05)
    warm = {w["id"] for w in owned("warm")}
    (hot,) = owned("hot")
    (parked,) = owned("hot_idle")
    spawning = {w["id"] for w in owned("spawning", "slow")}
    spawn_pids = slow_processes(leader.instance)
    assert spawn_pids.keys() == spawning
    janitor_before = {
        r.index: fleet.metrics(r)["stoker_janitor_last_success_timestamp_seconds"]
        for r in survivors
    }

    killed_at = time.perf_counter()
    leader.kill()

    # Another replica leads once the lease has run out, and not before: the leader had
    # renewed it within its renew deadline, so the lease outlived it by at least the rest.
    new_leader = fleet.wait_leader(FAILOVER_S + SLACK_S, among=survivors)
    failover = time.perf_counter() - killed_at
    assert failover >= LEASE - RENEW_DEADLINE, f"lease taken {failover:.2f}s after the kill"
    assert sum(1 for g in fleet.gauges().values() if g == 1) == 1

    # The dead replica's warm, hot and parked workers are adopted in their state; its
    # in-flight spawns are retired and their processes stopped.
    adopters = {r.instance for r in survivors}

    def settled() -> bool:
        rows = {w["id"]: w for w in fleet.workers(new_leader)}
        adopted = all(
            rows.get(i, {}).get("owner") in adopters and rows[i]["state"] == state
            for ids, state in ((warm, "warm"), ({hot["id"]}, "hot"), ({parked["id"]}, "hot_idle"))
            for i in ids
        )
        return adopted and not spawning & rows.keys()

    assert wait_until(settled, INTERVALS["instance_expiry_s"] + 10 + SLACK_S, 0.2)
    for worker_id in spawning:
        row = fleet.worker(new_leader, worker_id)
        assert row is not None and (row["state"], row["reason"]) == ("retired", "orphaned")
    dead = leader.instance
    assert wait_until(lambda: not slow_processes(dead), 10), slow_processes(dead)
    assert all(_gone(pid) for pid in spawn_pids.values())

    # The session survived its replica: the worker serves it, and any replica renews and
    # releases it.
    token = {"Authorization": f"Bearer {session['worker']['token']}"}
    assert httpx.get(session["worker"]["endpoint"] + "/", headers=token).json()["org"] == "acme"
    renewed = fleet.http.post(f"{survivors[0].url}/v1/claims/{session['id']}/renew")
    assert renewed.status_code == 200 and renewed.json()["state"] == "bound"
    assert fleet.release(survivors[1], session["id"])["state"] == "released"

    # Reaping goes on under the new leader: a worker parked with a 1 s TTL is retired.
    short = fleet.claim(survivors[0], "initech", ttl_s=1)
    fleet.release(survivors[1], short["id"])
    retired: list[dict[str, Any] | None] = [None]

    def reaped() -> bool:
        retired[0] = fleet.worker(new_leader, short["worker"]["id"])
        return retired[0] is not None and retired[0]["state"] == "retired"

    assert wait_until(reaped, 1 + 2 * INTERVALS["reaper_interval_s"] + SLACK_S)
    assert retired[0] is not None and retired[0]["reason"] == "ttl"
    after = fleet.metrics(new_leader)["stoker_janitor_last_success_timestamp_seconds"]
    assert after > janitor_before[new_leader.index]
    # The pools are back to target: two warm of each, nothing owned by the dead replica.
    assert wait_until(
        lambda: all(
            p["counts"]["warm"] + p["counts"]["spawning"] >= 2
            for p in fleet.http.get(new_leader.url + "/v1/pools").json()["pools"]
        ),
        10,
    )
    assert not [w for w in fleet.workers(new_leader) if w["owner"] == dead]
    assert wait_until(lambda: fleet.sized_alike(new_leader, survivors), 5, 0.05)

    # Restarted on its port, the replica is a new instance and follows.
    fleet.start(leader)
    assert leader.instance != dead
    assert fleet.wait_leader(SLACK_S) is new_leader


# -- a lease blip and a stalled leader -------------------------------------------------------


def test_the_fleet_is_reaped_through_a_lease_blip_and_a_stalled_leader(
    make_fleet: Callable[..., Fleet],
) -> None:
    # Replicas stay live through the stall below (it is shorter than the instance expiry):
    # this test is about leadership, not about adoption.
    fleet = make_fleet(pools=[pool("demo")], intervals={"instance_expiry_s": 15})
    fleet.start()
    faults = StoreFaults(fleet)
    a, b, _ = fleet.replicas

    def park(replica: Replica, org: str) -> str:
        claim = fleet.claim(replica, org, ttl_s=1)
        fleet.release(replica, claim["id"])
        worker_id: str = claim["worker"]["id"]
        return worker_id

    def all_retired(replica: Replica, ids: list[str], reason: str) -> Callable[[], bool]:
        def check() -> bool:
            rows = [fleet.worker(replica, i) for i in ids]
            return all(
                r is not None and (r["state"], r["reason"]) == ("retired", reason) for r in rows
            )

        return check

    with LeaderSampler(fleet) as sampler:
        fleet.wait_leader(FAILOVER_S + SLACK_S)

        # 1. Renewals fail: every write to the lease table fails. The leader steps down at
        #    its renew deadline and nobody can take over.
        faults.lease_blip(True)
        assert wait_until(
            lambda: all(g == 0 for g in fleet.gauges().values()), RENEW_DEADLINE + SLACK_S
        )
        parked = [park(r, f"blip{r.index}") for r in fleet.replicas]
        lapsing = fleet.claim(a, "lapse", lease_s=1)
        # With no leader at all, every replica's fallback reaper retires its own parked
        # worker past its TTL and ends its own claim past its lease.
        assert wait_until(
            all_retired(b, parked, "ttl"), 1 + 2 * INTERVALS["reaper_interval_s"] + SLACK_S
        )
        assert wait_until(
            lambda: (
                fleet.http.get(f"{b.url}/v1/claims/{lapsing['id']}").json()["state"] == "expired"
            ),
            1 + 2 * INTERVALS["reaper_interval_s"] + SLACK_S,
        )
        assert all(g == 0 for g in fleet.gauges().values()), "a replica led during the blip"
        assert faults.injected() > 0
        # The blip ends: the electors, still contending, elect a leader again.
        faults.lease_blip(False)
        stalled = fleet.wait_leader(FAILOVER_S + SLACK_S)

        # 2. The leader stalls (SIGSTOP) longer than its lease: another replica takes
        #    over, and the others keep reaping meanwhile.
        others = [r for r in fleet.replicas if r is not stalled]
        stalled.pause()
        stopped_at = time.perf_counter()
        parked = [park(r, f"stall{r.index}") for r in others]
        assert wait_until(
            all_retired(others[0], parked, "ttl"), 1 + 2 * INTERVALS["reaper_interval_s"] + SLACK_S
        )
        successor = fleet.wait_leader(FAILOVER_S + SLACK_S, among=others)
        # Keep it stopped past the lease either way, then let it run again: it finds its
        # lease gone, reports 0 and contends as a follower. If the new leader has expired
        # its registration meanwhile (stopped past instance_expiry_s, and no transaction
        # of its own holding its row), it exits instead, with one line saying why, and its
        # supervisor starts a fresh instance.
        time.sleep(max(0.0, LEASE + 1 - (time.perf_counter() - stopped_at)))
        stalled.resume()

        def follower_or_exited() -> bool:
            assert stalled.proc is not None
            if stalled.proc.poll() is not None:
                return True
            return fleet.gauges().get(stalled.index) == 0

        assert wait_until(follower_or_exited, SLACK_S + INTERVALS["shutdown_grace_s"], 0.02)
        assert stalled.proc is not None
        # Its first heartbeats after SIGCONT tell which: give them time to run.
        time.sleep(4 * INTERVALS["instance_heartbeat_s"])
        if "event=instance_expired_while_alive" in stalled.log():
            stalled.proc.wait(INTERVALS["shutdown_grace_s"] + SLACK_S)
            assert stalled.proc.returncode == 1
            assert "expired while running" in stalled.log(), stalled.log()
            fleet.start(stalled)
        assert fleet.wait_leader(SLACK_S) is successor
        # A parked worker of the resumed replica is reaped as well.
        resumed = park(stalled, "resumed")
        assert wait_until(
            all_retired(successor, [resumed], "ttl"),
            1 + 2 * INTERVALS["reaper_interval_s"] + SLACK_S,
        )

    assert len(sampler.samples) > 50
    assert sampler.double_leaders() == []
    # The resumed replica answered the sampler after SIGCONT, never as a second leader.
    assert any(s.gauges[stalled.index] == 0 for s in sampler.samples[-10:])


# -- failing writes under load -----------------------------------------------------------------


def test_failed_writes_under_a_claim_workload_break_no_invariant(
    make_fleet: Callable[..., Fleet],
) -> None:
    org_cap = 3
    fleet = make_fleet(
        pools=[pool("demo", warm_target=4, max_workers_per_org=org_cap, scale_down_delay=1)]
    )
    fleet.start()
    faults = StoreFaults(fleet)
    orgs = [f"org{i}" for i in range(5)]
    got: list[dict[str, Any]] = []
    refused: dict[int, int] = defaultdict(int)
    released: dict[str, str] = {}
    lock = threading.Lock()

    def session(i: int) -> None:
        org, via = orgs[i % len(orgs)], fleet.replicas[i % 3]
        with httpx.Client(headers={"Authorization": f"Bearer {ADMIN}"}, timeout=15) as http:
            response = http.post(
                via.url + "/v1/claims", json={"pool": "demo", "org": org, "timeout_s": 5}
            )
            if response.status_code != 201:
                with lock:
                    refused[response.status_code] += 1
                return
            claim = response.json()
            with lock:
                got.append(claim)
            token = {"Authorization": f"Bearer {claim['worker']['token']}"}
            seen = http.get(claim["worker"]["endpoint"] + "/", headers=token).json()
            assert (seen["org"], seen["epoch"]) == (org, claim["worker"]["epoch"])
            time.sleep(0.02 * (i % 5))
            # Release through another replica, retrying while the store refuses writes.
            for attempt in range(100):
                answer = http.delete(
                    f"{fleet.replicas[(i + 1 + attempt) % 3].url}/v1/claims/{claim['id']}"
                )
                if answer.status_code == 200:
                    with lock:
                        released[claim["id"]] = answer.json()["state"]
                    return
                time.sleep(0.1)
            raise AssertionError(f"claim {claim['id']} could not be released: {answer.text}")

    with ThreadPoolExecutor(8) as pool_:
        for p in (0.05, 0.1, 0.2, 0.1):
            faults.write_failures(p)
            list(pool_.map(session, range(30)))
    faults.write_failures(0.0)

    # The failures were real and every replica that met one counted it.
    injected = faults.injected()
    counted = sum(fleet.metrics(r)["stoker_persist_failures_total"] for r in fleet.replicas)
    assert injected > 0 and counted > 0, (injected, counted)
    assert len(got) > 60 and set(released) == {c["id"] for c in got}

    # Every claim the client got is in the store, final, as the release answered.
    rows = {
        cid: (state, worker, epoch, org)
        for cid, state, worker, epoch, org in fleet.sql(
            "SELECT id, state, worker_id, worker_epoch, org FROM {s}.claims"
        )
    }
    for claim in got:
        state, worker, epoch, org = rows[claim["id"]]
        assert state == released[claim["id"]] != "bound"
        assert (worker, epoch, org) == (
            claim["worker"]["id"],
            claim["worker"]["epoch"],
            claim["org"],
        )
    # I1: no two claims on one worker overlap, and each one came with a newer epoch.
    # I2: a worker served one org.
    history: dict[str, list[tuple[float, float, int, str]]] = defaultdict(list)
    for worker, created, ended, epoch, org in fleet.sql(
        "SELECT worker_id, created_at, ended_at, worker_epoch, org FROM {s}.claims"
    ):
        history[worker].append((created, ended, epoch, org))
    for worker, claims in history.items():
        claims.sort()
        assert len({org for *_, org in claims}) == 1, (worker, claims)
        for (_, end, epoch, _), (start, _, next_epoch, _) in itertools.pairwise(claims):
            assert end is not None and end <= start and epoch < next_epoch, (worker, claims)

    # No worker stuck between memory and store: nothing stays in flight, every live row has
    # its process and every process its row, the pool is back to its target...
    left: list[str] = []

    def converged() -> bool:
        live = fleet.sql(
            "SELECT id, state, owner, runtime_ref FROM {s}.workers WHERE state = ANY(%s)",
            list(LIVE),
        )
        pids = {ref.get("pid"): (wid, state) for wid, state, _, ref in live}
        procs = {p.process.pid: p.worker_id for p in fleet.processes()}
        left[:] = [
            f"{wid} {state} ({owner})" for wid, state, owner, _ in live if state in IN_FLIGHT
        ]
        left.extend(f"row without process: {pids[pid]}" for pid in pids.keys() - procs.keys())
        left.extend(f"process without row: {procs[pid]}" for pid in procs.keys() - pids.keys())
        warm = sum(1 for _, state, _, _ in live if state == "warm")
        if warm != 4:
            left.append(f"{warm} warm workers")
        return not left

    assert wait_until(converged, 30, 0.2), left
    # ... and every idle worker is claimable as the store says: each parked worker by its
    # org through its owner (reuse), each warm one by a new org (warm, not a cold spawn).
    owner = {r.instance: r for r in fleet.replicas}
    parked = fleet.workers(fleet.replicas[0], state="hot_idle")
    by_org: dict[str, set[str]] = defaultdict(set)
    for w in parked:
        by_org[w["org"]].add(w["id"])
    again = []
    for w in parked:
        claim = fleet.claim(owner[w["owner"]], w["org"])
        assert claim["source"] == "reuse" and claim["worker"]["id"] in by_org[w["org"]]
        again.append((owner[w["owner"]], claim))
    warm = fleet.workers(fleet.replicas[0], state="warm")
    for i, w in enumerate(warm):
        claim = fleet.claim(owner[w["owner"]], f"fresh{i}")
        assert claim["source"] == "warm", claim
        again.append((owner[w["owner"]], claim))
    for replica, claim in again:
        assert fleet.release(replica, claim["id"])["state"] == "released"
    assert fleet.sql("SELECT count(*) FROM {s}.claims WHERE state = 'bound'") == [(0,)]
    # I5: the org cap held (checked on what is live now).
    for org, n in fleet.sql(
        "SELECT org, count(*) FROM {s}.workers WHERE state = ANY(%s) AND org IS NOT NULL "
        "GROUP BY org",
        list(LIVE),
    ):
        assert n <= org_cap, (org, n)


def test_a_shared_fleet_is_counted_once_whichever_replica_serves_each_call(
    make_fleet: Callable[..., Fleet],
) -> None:
    """Five orgs' clients send every claim and every release to one of the three replicas
    picked at random, with sessions of 10-100 ms and a ledger flush every 2 s: a worker
    changes hands between replicas, often several times, between two flushes of the one
    it left. After a clean stop of every replica (their workers left running), the
    ledger's worker-seconds in all states are the workers' lives from their rows (up to
    retirement, or to the owner's last ledger write), and its hot time the sessions'."""
    fleet = make_fleet(
        pools=[pool("demo", warm_target=3, hot_idle_ttl=30)],
        intervals={"reaper_interval_s": 2.0},
    )
    fleet.start()
    first = fleet.replicas[0]
    assert wait_until(lambda: len(fleet.workers(first, state="warm")) >= 3, 30)
    rng = random.Random(27)
    plans = {
        f"org-{n}": [
            (rng.choice(fleet.replicas), rng.choice(fleet.replicas), rng.uniform(0.01, 0.1))
            for _ in range(15)
        ]
        for n in range(5)
    }

    def sessions(org: str) -> int:
        with httpx.Client(headers={"Authorization": f"Bearer {ADMIN}"}, timeout=20) as http:
            for taker, releaser, hold_s in plans[org]:
                answer = http.post(taker.url + "/v1/claims", json={"pool": "demo", "org": org})
                assert answer.status_code == 201, answer.text
                time.sleep(hold_s)
                ended = http.delete(f"{releaser.url}/v1/claims/{answer.json()['id']}")
                assert ended.status_code == 200, ended.text
                time.sleep(hold_s)
        return len(plans[org])

    with ThreadPoolExecutor(len(plans)) as pool_:
        assert sum(pool_.map(sessions, plans)) == 75
    for replica in fleet.replicas:
        replica.signal(signal.SIGTERM)
    for replica in fleet.replicas:
        assert replica.proc is not None
        assert replica.proc.wait(30) == 0, replica.log()[-3000:]

    written = dict(fleet.sql("SELECT instance, max(updated_at) FROM {s}.ledger GROUP BY instance"))
    lived = 0.0
    for state, owner, created, updated in fleet.sql(
        "SELECT state, owner, created_at, updated_at FROM {s}.workers"
    ):
        lived += (updated if state == "retired" else written[owner]) - created
    states = ("starting_s", "warm_s", "hot_s", "hot_idle_s", "draining_s")
    ((*counted_by_state, hot),) = fleet.sql(
        f"SELECT {', '.join(f'sum({c})' for c in states)}, sum(hot_s) FROM {{s}}.ledger"
    )
    ((held,),) = fleet.sql("SELECT sum(ended_at - created_at) FROM {s}.claims")
    counted = sum(counted_by_state)
    # The replicas' clocks are this machine's one clock; what may differ is a flush that
    # counted a few milliseconds past a take that committed after it read the row.
    assert counted == pytest.approx(lived, abs=0.1), (counted, lived)
    assert hot == pytest.approx(held, rel=0.05), (hot, held)
