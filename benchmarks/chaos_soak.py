"""Chaos soak: `stoker serve` replicas on one PostgreSQL schema under a steady claim load,
with random faults, then an audit of the store, the processes and the client's claim log.

    python benchmarks/chaos_soak.py [--minutes 2] [--seed 1] [--replicas 3] [--rate 12]
                                    [--postgres URL] [--workdir DIR] [--keep] [--json FILE]
                                    [--fleet LABEL] [--schema NAME]

Faults are drawn from `--seed` at random moments while the load runs (at most one replica
is down or stopped at a time, at most one fault of each kind at a time):

  replica_kill      SIGKILL a replica; it is restarted 2-6 s later on the same port (a new
                    instance id), as a process supervisor would
  worker_kill       SIGKILL one demo-worker process of the fleet (found by its label)
  leader_stall      SIGSTOP the replica that leads the janitor for 0.5-2 lease durations,
                    then SIGCONT (a stalled leader: its lease expires under it)
  lease_blip        every write to the lease table fails for 1-2 lease durations, so no
                    replica can renew or take the lease (the fallback reapers must cover)
  write_failures    5-20 % of the writes to the workers and claims tables fail for 3-8 s
  connection_kill   pg_terminate_backend of one replica's store connections

The store faults are real failed writes: a PL/pgSQL trigger in the soak's own schema raises
with a probability read from a one-row settings table (`StoreFaults`). Nothing in stoker
knows about them.

The load: claims arrive at `--rate` per second (Poisson) from orgs `org0..org5`, each sent
to a random replica (a connection refused goes to the next one, as a load balancer would
retry); a bound session checks that its worker answers for its org, holds it 0.05-0.6 s,
sometimes renews, and releases it through a random replica. Every claim the load got is
logged with its worker, org, epoch, and the client's bound and release times.

The audit, once the load stopped, every replica runs again and a settle period passed:

  I1 no double assignment   no two claims with overlapping lifetimes on one worker (client
                            log: bound..release sent; store: created..ended) and claim
                            epochs of a worker strictly increase
  I2 tenant isolation       a worker served at most one org (store and client log), and
                            answered its claimant's org
  I3 no leaks               every fleet process belongs to a live row and every live row to
                            a process; idle workers back to target; no hot_idle past its
                            TTL; no bound claim with an expired lease
  I4 bounded in-flight      no spawning, reserved, activating or draining row left (and none
                            seen older than its timeout plus failover slack during the run)
  I5 caps                   live workers per org and per pool within their caps (sampled)
  accounting                every claim id the client received is in the store, final, in
                            the state the client was told
  leadership                at most one replica reports stoker_janitor_is_leader 1 at once

Prints the counts; exits 0 with no violation, 1 on any violation, 2 when the soak could not
run (PostgreSQL unreachable, a replica that does not start). `run_soak` is the same soak as
a function (benchmarks/replicas.py reuses the replica harness: `ReplicaSet`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import psycopg
from prometheus_client.parser import text_string_to_metric_families

STOKER = str(Path(sys.executable).with_name("stoker"))
DEMO = ["{python}", "-m", "stoker.demo_worker", "--port", "{port}", "--worker-id", "{worker_id}"]
DEFAULT_POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"
ADMIN_TOKEN = "chaos-admin-token-0123456789"
#: Live worker states (as the store writes them).
LIVE = ("spawning", "warm", "reserved", "activating", "hot", "hot_idle", "draining")
IN_FLIGHT = ("spawning", "reserved", "activating", "draining")
STARTED = re.compile(r"event=control_plane_started instance=(\S+)")


# -- configuration of the replicas ------------------------------------------------------------


@dataclass(frozen=True)
class Timings:
    """Short intervals and lease timings, so that failover happens within seconds."""

    janitor_interval_s: float = 0.5
    reaper_interval_s: float = 0.5
    instance_heartbeat_s: float = 0.5
    instance_expiry_s: float = 3.0
    lease_duration_s: float = 3.0
    renew_deadline_s: float = 2.0
    retry_period_s: float = 0.5
    stranded_grace_s: float = 5.0
    stranded_scan_s: float = 2.0
    demand_window_s: float = 5.0
    shutdown_grace_s: float = 3.0

    def intervals(self) -> dict[str, float]:
        """The `intervals` section of the replicas' config."""
        return {
            "janitor_interval_s": self.janitor_interval_s,
            "reaper_interval_s": self.reaper_interval_s,
            "instance_heartbeat_s": self.instance_heartbeat_s,
            "instance_expiry_s": self.instance_expiry_s,
            "stranded_grace_s": self.stranded_grace_s,
            "stranded_scan_s": self.stranded_scan_s,
            "demand_window_s": self.demand_window_s,
            "shutdown_grace_s": self.shutdown_grace_s,
            "spawn_rate": 20.0,
            "spawn_burst": 20,
        }

    def leader_election(self) -> dict[str, Any]:
        """The `leader_election` section: the store lease with these timings."""
        return {
            "kind": "store",
            "lease_duration_s": self.lease_duration_s,
            "renew_deadline_s": self.renew_deadline_s,
            "retry_period_s": self.retry_period_s,
        }


def demo_pool(**overrides: Any) -> dict[str, Any]:
    """A pool of demo workers with short TTLs (a `pools` item of the config)."""
    pool: dict[str, Any] = {
        "name": "demo",
        "command": DEMO,
        "memory_mb": 32,
        "warm_target": 3,
        "max_workers": 30,
        "max_workers_per_org": 4,
        "hot_idle_ttl": 3,
        "scale_down_delay": 2,
        "lease_s": 8,
        "claim_timeout_s": 5,
        "timeouts": {
            "spawn_s": 20,
            "reserve_s": 10,
            "activation_s": 5,
            "drain_s": 10,
            "stop_grace_s": 1,
        },
    }
    pool.update(overrides)
    return pool


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def with_application_name(url: str, name: str) -> str:
    """`url` with `application_name` set, so the replica's sessions are recognisable."""
    return f"{url}{'&' if '?' in url else '?'}application_name={name}"


# -- replicas ---------------------------------------------------------------------------------


@dataclass
class Replica:
    """One `stoker serve` process slot: a fixed port, restarted as a new instance."""

    index: int
    port: int
    workdir: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    generation: int = 0
    paused: bool = False
    instance: str | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        """Base URL of its API."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        """True while its process runs (also while stopped by SIGSTOP)."""
        return self.proc is not None and self.proc.poll() is None

    @property
    def serving(self) -> bool:
        """True while it runs and is not stopped."""
        return self.alive and not self.paused

    def start(self) -> None:
        """Start a new generation of the process (returns at once; see `ReplicaSet.ready`)."""
        self.generation += 1
        self.instance = None
        self.log_path = self.workdir / f"serve-{self.generation}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [STOKER, "serve"],
                cwd=self.workdir,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def log(self) -> str:
        """What the current generation wrote so far."""
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def logs(self) -> list[str]:
        """What every generation wrote."""
        return [p.read_text(errors="replace") for p in sorted(self.workdir.glob("serve-*.log"))]

    def read_instance(self) -> str | None:
        """The instance id the current generation logged at start."""
        if self.instance is None:
            match = STARTED.search(self.log())
            self.instance = match.group(1) if match else None
        return self.instance

    def kill(self) -> None:
        """SIGKILL (no shutdown at all) and collect the exit status."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.paused = False

    def pause(self) -> None:
        """SIGSTOP: the process stalls, its connections stay open."""
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        """SIGCONT after `pause`."""
        if self.proc is not None and self.paused:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    async def terminate(self, timeout: float = 30.0) -> None:
        """SIGTERM (graceful: workers are left running), SIGKILL after `timeout`."""
        if self.proc is None:
            return
        self.resume()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.proc.poll() is None:
            self.kill()


@dataclass
class Scrape:
    """One `/metrics` answer: sample values by `name{labels}`."""

    values: dict[str, float]

    def total(self, name: str) -> float:
        """Sum of every sample of `name` (all label sets)."""
        return sum(v for k, v in self.values.items() if k.split("{", 1)[0] == name)

    def get(self, name: str) -> float | None:
        """The unlabelled sample `name`, if present."""
        return self.values.get(name)


def parse_metrics(text: str) -> Scrape:
    """Parse the Prometheus text format."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return Scrape(values)


class ReplicaSet:
    """N `stoker serve` replicas on one PostgreSQL schema, each on its own port.

    Every replica gets the same configuration through `STOKER_*` environment overrides;
    its store connections carry `application_name=<fleet>-r<index>` so that one replica's
    sessions can be terminated. Worker processes carry the fleet label `STOKER_FLEET`.
    """

    def __init__(
        self,
        *,
        postgres_url: str,
        count: int,
        pools: Sequence[Mapping[str, Any]],
        timings: Timings,
        workdir: Path,
        schema: str | None = None,
        fleet: str | None = None,
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        token = uuid.uuid4().hex[:8]
        self.postgres_url = postgres_url
        self.schema = schema or f"stoker_chaos_{token}"
        self.fleet = fleet or f"chaos-{token}"
        self.timings = timings
        self.pools = [dict(p) for p in pools]
        self.workdir = workdir
        self.replicas: list[Replica] = []
        #: The last scrape of every (replica, generation): counters of dead ones still count.
        self.last_scrapes: dict[tuple[int, int], Scrape] = {}
        for index in range(count):
            env = {k: v for k, v in os.environ.items() if not k.startswith("STOKER_")}
            env.update(
                {
                    "STOKER_STORE": with_application_name(postgres_url, f"{self.fleet}-r{index}"),
                    "STOKER_STORE_OPTIONS__SCHEMA": self.schema,
                    "STOKER_FLEET": self.fleet,
                    "STOKER_API__ADMIN_TOKENS": ADMIN_TOKEN,
                    # Replicas of one store share one fleet activation key.
                    "STOKER_ACTIVATION__KEY": f"{self.fleet}-activation-key-shared-by-replicas",
                    "STOKER_INTERVALS": json.dumps(timings.intervals()),
                    "STOKER_POOLS": json.dumps(self.pools),
                    "STOKER_LOG_LEVEL": "info",
                }
            )
            env["STOKER_LEADER_ELECTION"] = json.dumps(timings.leader_election())
            env.update(extra_env or {})
            # A fixed port per replica: a restarted replica comes back where clients and the
            # load balancer expect it.
            port = free_port()
            env["STOKER_API__PORT"] = str(port)
            replica_dir = workdir / f"r{index}"
            replica_dir.mkdir(parents=True, exist_ok=True)
            self.replicas.append(Replica(index, port, replica_dir, env))
        self.http: aiohttp.ClientSession | None = None

    @property
    def urls(self) -> list[str]:
        """Base URLs of every replica (whether it runs or not)."""
        return [r.url for r in self.replicas]

    @property
    def headers(self) -> dict[str, str]:
        """The admin token header."""
        return {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    async def __aenter__(self) -> ReplicaSet:
        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=2.0),
            headers=self.headers,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def session(self) -> aiohttp.ClientSession:
        """The harness's own HTTP client (admin token, short timeouts)."""
        assert self.http is not None, "use `async with ReplicaSet(...)`"
        return self.http

    async def start(self, indexes: Sequence[int] | None = None, timeout: float = 60.0) -> None:
        """Start replicas (all by default) and wait until each one is ready."""
        chosen = [self.replicas[i] for i in (indexes if indexes is not None else range(len(self)))]
        for replica in chosen:
            replica.start()
        await asyncio.gather(*(self.ready(r, timeout) for r in chosen))

    def __len__(self) -> int:
        return len(self.replicas)

    async def ready(self, replica: Replica, timeout: float = 60.0) -> None:
        """Wait until `/readyz` answers 200; raises with the replica's log if it never does."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not replica.alive:
                raise RuntimeError(f"replica {replica.index} exited:\n{replica.log()[-3000:]}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with self.session().get(f"{replica.url}/readyz") as response:
                    if response.status == 200 and replica.read_instance():
                        return
            await asyncio.sleep(0.05)
        raise RuntimeError(f"replica {replica.index} not ready in {timeout}s:\n{replica.log()}")

    async def scrape(self, replica: Replica, timeout: float = 2.0) -> Scrape | None:
        """The replica's `/metrics`, or None when it does not answer in time."""
        if not replica.serving:
            return None
        try:
            async with self.session().get(
                f"{replica.url}/metrics", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as response:
                if response.status != 200:
                    return None
                scrape = parse_metrics(await response.text())
        except (aiohttp.ClientError, TimeoutError):
            return None
        self.last_scrapes[(replica.index, replica.generation)] = scrape
        return scrape

    async def scrape_all(self, timeout: float = 2.0) -> dict[int, Scrape | None]:
        """Every serving replica's `/metrics`, scraped concurrently."""
        found = await asyncio.gather(*(self.scrape(r, timeout) for r in self.replicas))
        return {r.index: s for r, s in zip(self.replicas, found, strict=True)}

    async def leaders(self, timeout: float = 2.0) -> dict[int, float | None]:
        """`stoker_janitor_is_leader` of each replica (None: not serving or no answer)."""
        scrapes = await self.scrape_all(timeout)
        return {
            i: (s.get("stoker_janitor_is_leader") if s is not None else None)
            for i, s in scrapes.items()
        }

    async def leader(self) -> Replica | None:
        """The one replica that reports itself leader, or None."""
        gauges = await self.leaders()
        leading = [self.replicas[i] for i, g in gauges.items() if g == 1]
        return leading[0] if len(leading) == 1 else None

    def counter_total(self, name: str) -> float:
        """`name` summed over the last scrape of every replica generation."""
        return sum(s.total(name) for s in self.last_scrapes.values())

    def fleet_processes(self) -> list[psutil.Process]:
        """Live (non-zombie) worker processes with this fleet's label."""
        return fleet_processes(self.fleet)

    def stranded_stops(self) -> int:
        """Processes the janitor's stranded scan stopped (not ones that exited meanwhile)."""
        found = 0
        for text in (t for r in self.replicas for t in r.logs()):
            for match in re.finditer(r"event=stranded_stopped worker=(\S+)", text):
                if f"event=worker_already_gone worker={match.group(1)} " not in text:
                    found += 1
        return found

    def log_events(self, event: str) -> tuple[int, int]:
        """(lines, replica generations) with `event=<event>` in the replicas' logs."""
        needle = f"event={event} "
        texts = [text for r in self.replicas for text in r.logs()]
        return sum(t.count(needle) for t in texts), sum(1 for t in texts if needle in t)

    async def close(self, *, keep: bool = False) -> None:
        """Stop every replica, kill what is left of the fleet, drop the schema."""
        await asyncio.gather(*(r.terminate() for r in self.replicas))
        kill_fleet(self.fleet)
        if self.http is not None:
            await self.http.close()
            self.http = None
        if not keep:
            with contextlib.suppress(psycopg.Error):
                async with await psycopg.AsyncConnection.connect(
                    self.postgres_url, autocommit=True
                ) as conn:
                    await conn.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')


def fleet_processes(fleet: str) -> list[psutil.Process]:
    """Live (non-zombie) worker processes labelled `STOKER_FLEET=<fleet>`.

    The worker id label is required too: the replicas themselves carry `STOKER_FLEET` in
    their environment (it is the config override of `fleet`).
    """
    found = []
    for process in psutil.process_iter():
        try:
            env = process.environ()
            if env.get("STOKER_FLEET") != fleet or "STOKER_WORKER_ID" not in env:
                continue
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            found.append(process)
        except psutil.Error:
            continue
    return found


def kill_fleet(fleet: str) -> None:
    """SIGKILL every worker process of `fleet` (only ever our own label)."""
    processes = fleet_processes(fleet)
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(processes, timeout=10)


# -- store faults -----------------------------------------------------------------------------


class StoreFaults:
    """Real failed writes and dropped connections, injected into PostgreSQL from outside.

    A `BEFORE INSERT OR UPDATE` trigger on the workers and claims tables raises with the
    probability in `chaos_settings.write_failure_p`; one on the leases table raises while
    `chaos_settings.lease_blip` is set. Every injected failure first bumps a sequence
    (sequences ignore the rollback of the failed transaction), so they can be counted.
    """

    def __init__(self, postgres_url: str, schema: str) -> None:
        self.url = postgres_url
        self.s = f'"{schema}"'

    async def _execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        async with await psycopg.AsyncConnection.connect(self.url, autocommit=True) as conn:
            cur = await conn.execute(sql, params)
            return list(await cur.fetchall()) if cur.description else []

    async def install(self) -> None:
        """Create the settings table, the counters and the triggers (after migration)."""
        s = self.s
        statements = [
            f"CREATE TABLE IF NOT EXISTS {s}.chaos_settings (id int PRIMARY KEY CHECK (id = 1), "
            "write_failure_p double precision NOT NULL DEFAULT 0, "
            "lease_blip boolean NOT NULL DEFAULT false)",
            f"INSERT INTO {s}.chaos_settings (id) VALUES (1) ON CONFLICT DO NOTHING",
            f"CREATE SEQUENCE IF NOT EXISTS {s}.chaos_write_failures",
            f"CREATE SEQUENCE IF NOT EXISTS {s}.chaos_lease_failures",
            f"""CREATE OR REPLACE FUNCTION {s}.chaos_fail_write() RETURNS trigger
                LANGUAGE plpgsql AS $$
                DECLARE p double precision;
                BEGIN
                    SELECT write_failure_p INTO p FROM {s}.chaos_settings WHERE id = 1;
                    IF p > 0 AND random() < p THEN
                        PERFORM nextval('{s}.chaos_write_failures');
                        RAISE EXCEPTION 'chaos: injected failure of % on %', TG_OP, TG_TABLE_NAME;
                    END IF;
                    RETURN NEW;
                END $$""",
            f"""CREATE OR REPLACE FUNCTION {s}.chaos_fail_lease() RETURNS trigger
                LANGUAGE plpgsql AS $$
                BEGIN
                    IF (SELECT lease_blip FROM {s}.chaos_settings WHERE id = 1) THEN
                        PERFORM nextval('{s}.chaos_lease_failures');
                        RAISE EXCEPTION 'chaos: injected lease write failure';
                    END IF;
                    RETURN NEW;
                END $$""",
        ]
        for table, function in (
            ("workers", "chaos_fail_write"),
            ("claims", "chaos_fail_write"),
            ("leases", "chaos_fail_lease"),
        ):
            statements += [
                f"DROP TRIGGER IF EXISTS chaos_{table} ON {s}.{table}",
                f"CREATE TRIGGER chaos_{table} BEFORE INSERT OR UPDATE ON {s}.{table} "
                f"FOR EACH ROW EXECUTE FUNCTION {s}.{function}()",
            ]
        async with (
            await psycopg.AsyncConnection.connect(self.url, autocommit=True) as conn,
            conn.transaction(),
        ):
            for sql in statements:
                await conn.execute(sql)

    async def set_write_failures(self, p: float) -> None:
        """Fail this fraction of worker and claim writes from now on."""
        await self._execute(
            f"UPDATE {self.s}.chaos_settings SET write_failure_p = %s WHERE id = 1", (p,)
        )

    async def set_lease_blip(self, on: bool) -> None:
        """Fail every lease write (acquire, renew, release) while on."""
        await self._execute(
            f"UPDATE {self.s}.chaos_settings SET lease_blip = %s WHERE id = 1", (on,)
        )

    async def injected(self) -> dict[str, int]:
        """How many writes failed by injection so far, by kind."""
        out = {}
        for name in ("write", "lease"):
            rows = await self._execute(
                f"SELECT last_value, is_called FROM {self.s}.chaos_{name}_failures"
            )
            value, called = rows[0]
            out[name] = int(value) if called else 0
        return out

    async def terminate_connections(self, application_name: str) -> int:
        """pg_terminate_backend every session of one replica; how many were ended."""
        rows = await self._execute(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = %s AND pid <> pg_backend_pid()",
            (application_name,),
        )
        return int(rows[0][0])


# -- the store, read directly -----------------------------------------------------------------


@dataclass(frozen=True)
class WorkerRow:
    """The columns of a worker row the audit reads."""

    id: str
    pool: str
    state: str
    epoch: int
    owner: str
    org: str | None
    claim_id: str | None
    runtime_ref: dict[str, Any]
    created_at: float
    updated_at: float
    heartbeat_at: float
    idle_since: float | None
    ttl_s: float | None
    reason: str | None


@dataclass(frozen=True)
class ClaimRow:
    """The columns of a claim row the audit reads."""

    id: str
    org: str
    worker_id: str
    worker_epoch: int
    state: str
    expires_at: float
    created_at: float
    ended_at: float | None
    reason: str | None
    owner: str


async def read_workers(url: str, schema: str) -> list[WorkerRow]:
    """Every worker row, retired ones included."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT id, pool, state, epoch, owner, org, claim_id, runtime_ref, created_at, "
            "updated_at, heartbeat_at, idle_since, ttl_s, reason "
            f'FROM "{schema}".workers'
        )
        return [WorkerRow(*row) for row in await cur.fetchall()]


async def read_claims(url: str, schema: str) -> list[ClaimRow]:
    """Every claim row."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT id, org, worker_id, worker_epoch, state, expires_at, created_at, ended_at, "
            f'reason, owner FROM "{schema}".claims'
        )
        return [ClaimRow(*row) for row in await cur.fetchall()]


# -- the load ---------------------------------------------------------------------------------


@dataclass
class ClaimRecord:
    """One claim the load got, as the client saw it."""

    id: str
    org: str
    worker_id: str
    epoch: int
    source: str
    replica: int
    #: Wall time when the claim's answer arrived (the session surely had started by then).
    bound_at: float
    #: Wall time just before the release was sent (the session surely lasted until then).
    release_sent_at: float | None = None
    #: The claim's state in the answer to the release; None if no release got through.
    final_state: str | None = None


@dataclass
class Violation:
    """One broken invariant, with what shows it."""

    invariant: str
    detail: str


@dataclass
class LoadStats:
    """What the load did."""

    attempts: int = 0
    served: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    released: Counter[str] = field(default_factory=Counter)
    renewed: int = 0
    release_gave_up: int = 0
    worker_checks: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)


class Load:
    """Claims at a steady rate, spread over the replicas, with a client-side claim log."""

    def __init__(
        self,
        replicas: ReplicaSet,
        *,
        rate: float,
        rng: random.Random,
        orgs: Sequence[str] = tuple(f"org{i}" for i in range(6)),
        pool: str = "demo",
        lease_s: float = 8.0,
    ) -> None:
        self.replicas = replicas
        self.rate = rate
        self.rng = rng
        self.orgs = list(orgs)
        self.pool = pool
        self.lease_s = lease_s
        self.log: list[ClaimRecord] = []
        self.stats = LoadStats()
        self.violations: list[Violation] = []
        #: Worker id -> claim id of the sessions held right now (the online I1 check).
        self.held: dict[str, str] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._http: aiohttp.ClientSession | None = None

    async def run(self, duration: float) -> None:
        """Open-loop arrivals for `duration` seconds, then wait for the sessions to end."""
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=20.0),
            headers=self.replicas.headers,
        )
        try:
            deadline = time.monotonic() + duration
            while time.monotonic() < deadline:
                await asyncio.sleep(self.rng.expovariate(self.rate))
                task = asyncio.create_task(self._session(self.rng.choice(self.orgs)))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            if self._tasks:
                await asyncio.wait(list(self._tasks), timeout=60)
        finally:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._http.close()

    def _order(self) -> list[Replica]:
        """Replicas in a random order: the first one gets the request."""
        order = list(self.replicas.replicas)
        self.rng.shuffle(order)
        return order

    async def _request(
        self, method: str, path: str, body: dict[str, Any] | None = None, *, retry: bool
    ) -> tuple[int, dict[str, Any] | None, Replica | None]:
        """Send to a random replica; a refused connection tries the next one (never sent).

        `retry`: also try the next replica after an answer-less failure (only for requests
        that are safe to repeat). Returns (status, body, replica); status 0: no answer.
        """
        assert self._http is not None
        last: tuple[int, dict[str, Any] | None, Replica | None] = (0, None, None)
        for replica in self._order():
            try:
                async with self._http.request(method, replica.url + path, json=body) as response:
                    answer = await response.json(content_type=None)
                    return response.status, answer, replica
            except aiohttp.ClientConnectorError:
                continue  # refused: nothing was sent, another replica may take it
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                last = (0, {"error": repr(exc)}, replica)
                if not retry:
                    return last
        return last

    async def _session(self, org: str) -> None:
        stats = self.stats
        stats.attempts += 1
        body = {"pool": self.pool, "org": org, "timeout_s": 5, "lease_s": self.lease_s}
        started = time.monotonic()
        status, answer, replica = await self._request("POST", "/v1/claims", body, retry=False)
        if status != 201 or answer is None or replica is None:
            stats.errors[str(status) if status else "no_answer"] += 1
            return
        stats.latencies.append(time.monotonic() - started)
        worker = answer["worker"]
        record = ClaimRecord(
            id=answer["id"],
            org=org,
            worker_id=worker["id"],
            epoch=int(worker["epoch"]),
            source=answer["source"],
            replica=replica.index,
            bound_at=time.time(),
        )
        self.log.append(record)
        stats.served[record.source] += 1
        if answer["org"] != org:
            self.violations.append(
                Violation("I2", f"claim {record.id} for {org} bound to {answer['org']}")
            )
        other = self.held.get(record.worker_id)
        if other is not None:
            self.violations.append(
                Violation(
                    "I1",
                    f"worker {record.worker_id} handed to claim {record.id} ({org}) while "
                    f"claim {other} still holds it",
                )
            )
        self.held[record.worker_id] = record.id
        try:
            await self._check_worker(record, worker)
            hold = self.rng.uniform(0.05, 0.6)
            if self.rng.random() < 0.2:
                await asyncio.sleep(hold / 2)
                status, _, _ = await self._request(
                    "POST", f"/v1/claims/{record.id}/renew", {}, retry=True
                )
                if status == 200:
                    stats.renewed += 1
                await asyncio.sleep(hold / 2)
            else:
                await asyncio.sleep(hold)
        finally:
            if self.held.get(record.worker_id) == record.id:
                del self.held[record.worker_id]
            record.release_sent_at = time.time()
        await self._release(record)

    async def _check_worker(self, record: ClaimRecord, worker: Mapping[str, Any]) -> None:
        """The worker answers its claimant, for the claim's org and epoch."""
        assert self._http is not None
        headers = {"Authorization": f"Bearer {worker['token']}"}
        try:
            async with self._http.get(
                worker["endpoint"] + "/", headers=headers, timeout=aiohttp.ClientTimeout(total=3)
            ) as response:
                status = response.status
                seen = await response.json(content_type=None) if status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            self.stats.worker_checks["unreachable"] += 1
            return
        if seen is None:
            self.stats.worker_checks[f"status_{status}"] += 1
            return
        if seen.get("org") != record.org:
            self.violations.append(
                Violation(
                    "I2",
                    f"worker {record.worker_id} answers for {seen.get('org')}, "
                    f"claim {record.id} is {record.org}",
                )
            )
        elif seen.get("epoch") != record.epoch:
            self.stats.worker_checks["newer_epoch"] += 1
        else:
            self.stats.worker_checks["ok"] += 1

    async def _release(self, record: ClaimRecord) -> None:
        """Release through any replica, retrying (bounded) through store and replica faults."""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            status, answer, _ = await self._request("DELETE", f"/v1/claims/{record.id}", retry=True)
            if status == 200 and answer is not None:
                record.final_state = str(answer["state"])
                self.stats.released[record.final_state] += 1
                return
            await asyncio.sleep(0.2)
        self.stats.release_gave_up += 1


# -- monitors during the run ------------------------------------------------------------------


@dataclass
class LeaderMonitor:
    """Samples every replica's leader gauge; at most one may report 1 in a sample."""

    replicas: ReplicaSet
    interval: float = 0.2
    samples: int = 0
    violations: list[Violation] = field(default_factory=list)
    handovers: int = 0
    longest_gap_s: float = 0.0
    _current: int | None = None
    _gap_since: float | None = None

    async def run(self, stop: asyncio.Event) -> None:
        """Sample until `stop` is set."""
        while not stop.is_set():
            started = time.monotonic()
            gauges = await self.replicas.leaders(timeout=1.0)
            took = time.monotonic() - started
            self.samples += 1
            leading = sorted(i for i, g in gauges.items() if g == 1)
            # A sample is a snapshot only if its scrapes were quicker than the window in
            # which nobody leads (the lease outlives the old leader's renew deadline).
            window = self.replicas.timings.lease_duration_s - self.replicas.timings.renew_deadline_s
            if len(leading) > 1 and took < window:
                self.violations.append(
                    Violation("leadership", f"replicas {leading} all report leader at once")
                )
            now = time.monotonic()
            if len(leading) == 1:
                if self._current is not None and leading[0] != self._current:
                    self.handovers += 1
                self._current = leading[0]
                if self._gap_since is not None:
                    self.longest_gap_s = max(self.longest_gap_s, now - self._gap_since)
                    self._gap_since = None
            elif not leading and self._gap_since is None:
                self._gap_since = now
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)


@dataclass
class StoreMonitor:
    """Samples the store: caps (I5) and the age of in-flight rows (I4)."""

    url: str
    schema: str
    org_cap: int
    pool_cap: int
    #: How long past its timeout an in-flight row may live: failover and sweep slack.
    timeouts: Mapping[str, float]
    slack_s: float
    interval: float = 1.0
    violations: list[Violation] = field(default_factory=list)
    peak_live: int = 0
    oldest_in_flight: dict[str, float] = field(default_factory=dict)
    _reported: set[str] = field(default_factory=set)

    async def run(self, stop: asyncio.Event) -> None:
        """Sample until `stop` is set."""
        while not stop.is_set():
            with contextlib.suppress(psycopg.Error):
                await self._sample()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)

    async def _sample(self) -> None:
        now = time.time()
        workers = [w for w in await read_workers(self.url, self.schema) if w.state in LIVE]
        self.peak_live = max(self.peak_live, len(workers))
        per_org = Counter(w.org for w in workers if w.org is not None)
        for org, n in per_org.items():
            if self.org_cap and n > self.org_cap:
                self._report("I5", f"org {org} holds {n} live workers, cap {self.org_cap}")
        if self.pool_cap and len(workers) > self.pool_cap:
            self._report("I5", f"pool holds {len(workers)} live workers, cap {self.pool_cap}")
        for w in workers:
            if w.state not in IN_FLIGHT:
                continue
            since = w.heartbeat_at if w.state in ("reserved", "activating") else w.updated_at
            age = now - (w.created_at if w.state == "spawning" else since)
            self.oldest_in_flight[w.state] = max(self.oldest_in_flight.get(w.state, 0.0), age)
            if age > self.timeouts[w.state] + self.slack_s:
                self._report("I4", f"worker {w.id} {w.state} for {age:.1f}s (owner {w.owner})")

    def _report(self, invariant: str, detail: str) -> None:
        key = detail.split(" for ")[0] if invariant == "I4" else detail
        if key not in self._reported:
            self._reported.add(key)
            self.violations.append(Violation(invariant, detail))


# -- faults -----------------------------------------------------------------------------------


class ChaosMonkey:
    """Injects the faults of the module docstring at random moments until stopped."""

    KINDS = (
        ("replica_kill", 3),
        ("worker_kill", 4),
        ("leader_stall", 2),
        ("lease_blip", 2),
        ("write_failures", 3),
        ("connection_kill", 2),
    )

    def __init__(self, replicas: ReplicaSet, faults: StoreFaults, rng: random.Random) -> None:
        self.replicas = replicas
        self.faults = faults
        self.rng = rng
        self.counts: Counter[str] = Counter()
        self.errors: list[str] = []
        self._busy: set[str] = set()
        #: Held while a replica is killed or stopped: one replica is down at a time.
        self._one_down = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        #: Replicas down on purpose (killed and not yet restarted by `replica_kill`).
        self._killed: set[int] = set()
        #: Replicas that exited on their own and are being restarted.
        self._restarting: set[int] = set()

    async def run(self, stop: asyncio.Event) -> None:
        """Start one fault after another (1-3 s apart) until `stop` is set, then undo all.

        The first round is every kind once, in a random order, so that even a short soak
        meets each of them; the kinds are drawn by weight after that.
        """
        kinds, weights = zip(*self.KINDS, strict=True)
        first_round = list(kinds)
        self.rng.shuffle(first_round)
        try:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.rng.uniform(1.0, 3.0))
                if stop.is_set():
                    break
                self._supervise()
                kind = first_round.pop(0) if first_round else self.rng.choices(kinds, weights)[0]
                if kind in self._busy:
                    continue
                task = asyncio.create_task(self._fault(kind))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        finally:
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.undo()

    def _supervise(self) -> None:
        """Restart a replica that exited by itself, as systemd's `Restart=always` would (a
        replica whose registration expired while it was stopped exits for a fresh start)."""
        for replica in self.replicas.replicas:
            index = replica.index
            if replica.alive or index in self._killed or index in self._restarting:
                continue
            self._restarting.add(index)
            task = asyncio.create_task(self._restart_exited(replica))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _restart_exited(self, replica: Replica) -> None:
        try:
            # It is the one replica down until it is ready again: no other fault may kill
            # or stop it (or another replica) while it starts.
            async with self._one_down:
                await asyncio.sleep(1.0)  # RestartSec
                replica.start()
                await self.replicas.ready(replica, timeout=60)
            self.counts["replica_exit_restart"] += 1
        except Exception as exc:
            self.errors.append(f"restart of replica {replica.index}: {exc!r}")
        finally:
            self._restarting.discard(replica.index)

    async def _fault(self, kind: str) -> None:
        self._busy.add(kind)
        try:
            await getattr(self, kind)()
        except Exception as exc:  # a fault that could not be injected is reported, not fatal
            self.errors.append(f"{kind}: {exc!r}")
        finally:
            self._busy.discard(kind)

    async def replica_kill(self) -> None:
        """SIGKILL a replica, restart it 2-6 s later (a new instance on the same port)."""
        async with self._one_down:
            serving = [r for r in self.replicas.replicas if r.serving]
            if not serving:
                return
            replica = self.rng.choice(serving)
            self._killed.add(replica.index)
            try:
                replica.kill()
                self.counts["replica_kill"] += 1
                await asyncio.sleep(self.rng.uniform(2.0, 6.0))
                replica.start()
                await self.replicas.ready(replica, timeout=60)
                self.counts["replica_restart"] += 1
            finally:
                self._killed.discard(replica.index)

    async def worker_kill(self) -> None:
        """SIGKILL one worker process of the fleet."""
        processes = self.replicas.fleet_processes()
        if not processes:
            return
        with contextlib.suppress(psutil.Error):
            self.rng.choice(processes).kill()
            self.counts["worker_kill"] += 1

    async def leader_stall(self) -> None:
        """SIGSTOP the leader for 0.5-2 lease durations, then SIGCONT."""
        async with self._one_down:
            # There may be no leader for a moment (a blip, a handover): wait for one.
            deadline = time.monotonic() + 4 * self.replicas.timings.lease_duration_s
            leader = await self.replicas.leader()
            while leader is None and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
                leader = await self.replicas.leader()
            if leader is None or not leader.serving:
                self.errors.append("leader_stall: no leader to stall")
                return
            leader.pause()
            self.counts["leader_stall"] += 1
            lease = self.replicas.timings.lease_duration_s
            try:
                await asyncio.sleep(self.rng.uniform(0.5 * lease, 2.0 * lease))
            finally:
                leader.resume()

    async def lease_blip(self) -> None:
        """Every lease write fails for 1-2 lease durations."""
        lease = self.replicas.timings.lease_duration_s
        await self.faults.set_lease_blip(True)
        self.counts["lease_blip"] += 1
        try:
            await asyncio.sleep(self.rng.uniform(lease, 2.0 * lease))
        finally:
            await self.faults.set_lease_blip(False)

    async def write_failures(self) -> None:
        """5-20 % of the worker and claim writes fail for 3-8 s."""
        await self.faults.set_write_failures(self.rng.choice((0.05, 0.1, 0.2)))
        self.counts["write_failures"] += 1
        try:
            await asyncio.sleep(self.rng.uniform(3.0, 8.0))
        finally:
            await self.faults.set_write_failures(0.0)

    async def connection_kill(self) -> None:
        """Terminate one replica's PostgreSQL sessions."""
        serving = [r for r in self.replicas.replicas if r.serving]
        if not serving:
            return
        replica = self.rng.choice(serving)
        ended = await self.faults.terminate_connections(f"{self.replicas.fleet}-r{replica.index}")
        self.counts["connection_kill"] += 1
        self.counts["connections_terminated"] += ended

    async def undo(self) -> None:
        """Every fault off, every replica running again."""
        with contextlib.suppress(psycopg.Error):
            await self.faults.set_write_failures(0.0)
            await self.faults.set_lease_blip(False)
        for replica in self.replicas.replicas:
            replica.resume()
            if not replica.alive:
                replica.start()
                await self.replicas.ready(replica, timeout=60)
                self.counts["replica_restart"] += 1


# -- settle and audit -------------------------------------------------------------------------


def process_pid(ref: Mapping[str, Any]) -> int | None:
    """The pid a runtime ref names."""
    pid = ref.get("pid")
    return pid if isinstance(pid, int) else None


@dataclass
class Leftovers:
    """What still differs from a settled fleet (empty lists when settled)."""

    stray_processes: list[str] = field(default_factory=list)
    rows_without_process: list[str] = field(default_factory=list)
    in_flight: list[str] = field(default_factory=list)
    hot_idle: list[str] = field(default_factory=list)
    warm: int = 0
    bound_claims: list[str] = field(default_factory=list)
    expired_bound: list[str] = field(default_factory=list)

    def settled(self, warm_target: int) -> bool:
        """True when nothing is left over."""
        return not (
            self.stray_processes
            or self.rows_without_process
            or self.in_flight
            or self.hot_idle
            or self.bound_claims
            or self.warm != warm_target
        )


async def leftovers(replicas: ReplicaSet) -> Leftovers:
    """Compare the store with the live processes."""
    url, schema = replicas.postgres_url, replicas.schema
    workers = await read_workers(url, schema)
    claims = await read_claims(url, schema)
    now = time.time()
    live = [w for w in workers if w.state in LIVE]
    processes = {}
    for process in replicas.fleet_processes():
        with contextlib.suppress(psutil.Error):
            processes[process.pid] = process.environ().get("STOKER_WORKER_ID", "?")
    row_pids = {process_pid(w.runtime_ref): w.id for w in live}
    out = Leftovers()
    out.stray_processes = [
        f"pid {pid} ({wid})" for pid, wid in processes.items() if row_pids.get(pid) != wid
    ]
    out.rows_without_process = [
        f"{w.id} {w.state} pid {process_pid(w.runtime_ref)}"
        for w in live
        if w.state in ("warm", "hot", "hot_idle") and process_pid(w.runtime_ref) not in processes
    ]
    out.in_flight = [f"{w.id} {w.state} ({w.owner})" for w in live if w.state in IN_FLIGHT]
    out.hot_idle = [f"{w.id} {w.org}" for w in live if w.state == "hot_idle"]
    out.warm = sum(1 for w in live if w.state == "warm")
    bound = [c for c in claims if c.state == "bound"]
    out.bound_claims = [c.id for c in bound]
    out.expired_bound = [c.id for c in bound if c.expires_at < now]
    return out


async def settle(replicas: ReplicaSet, warm_target: int, timeout: float) -> tuple[float, Leftovers]:
    """Wait (bounded) until the fleet is settled; (seconds it took, what is left)."""
    started = time.monotonic()
    while True:
        found = await leftovers(replicas)
        if found.settled(warm_target) or time.monotonic() - started > timeout:
            return time.monotonic() - started, found
        await asyncio.sleep(0.5)


def overlaps(intervals: Sequence[tuple[float, float, str]]) -> Iterator[tuple[str, str]]:
    """(earlier, later) ids of intervals [start, end) that overlap an earlier one."""
    latest_end, latest = -math.inf, ""
    for start, end, ident in sorted(intervals):
        if start < latest_end:
            yield latest, ident
        if end > latest_end:
            latest_end, latest = end, ident


def audit(
    log: Sequence[ClaimRecord],
    workers: Sequence[WorkerRow],
    claims: Sequence[ClaimRow],
    left: Leftovers,
    warm_target: int,
) -> list[Violation]:
    """The end-of-soak checks of the module docstring (beyond what the monitors saw)."""
    found: list[Violation] = []
    by_id = {c.id: c for c in claims}
    rows = {w.id: w for w in workers}
    # I1 in the store: a worker's claims never overlap, and each one has a newer epoch.
    per_worker: dict[str, list[ClaimRow]] = defaultdict(list)
    for c in claims:
        per_worker[c.worker_id].append(c)
    for worker_id, cs in per_worker.items():
        spans = [
            (c.created_at, c.ended_at if c.ended_at is not None else math.inf, c.id) for c in cs
        ]
        for a, b in overlaps(spans):
            found.append(
                Violation("I1", f"store: claims {a} and {b} overlap on worker {worker_id}")
            )
        ordered = sorted(cs, key=lambda c: (c.created_at, c.id))
        for first, second in itertools.pairwise(ordered):
            if second.worker_epoch <= first.worker_epoch:
                found.append(
                    Violation(
                        "I1",
                        f"store: worker {worker_id} bound claim {second.id} at epoch "
                        f"{second.worker_epoch} after {first.id} at {first.worker_epoch}",
                    )
                )
        orgs = {c.org for c in cs}
        row = rows.get(worker_id)
        if row is not None and row.org is not None:
            orgs.add(row.org)
        if len(orgs) > 1:
            found.append(Violation("I2", f"store: worker {worker_id} served orgs {sorted(orgs)}"))
    # I1 and I2 in the client log: the client's inner bounds of each session.
    client: dict[str, list[ClaimRecord]] = defaultdict(list)
    for r in log:
        client[r.worker_id].append(r)
    for worker_id, rs in client.items():
        spans = []
        for r in rs:
            end = r.release_sent_at if r.release_sent_at is not None else math.inf
            stored = by_id.get(r.id)
            if stored is not None and stored.ended_at is not None:
                end = min(end, stored.ended_at)
            spans.append((r.bound_at, end, r.id))
        for a, b in overlaps(spans):
            found.append(
                Violation("I1", f"client: claims {a} and {b} overlap on worker {worker_id}")
            )
        if len({r.org for r in rs}) > 1:
            found.append(
                Violation("I2", f"client: worker {worker_id} served {sorted({r.org for r in rs})}")
            )
    # Accounting: every claim the client got is in the store, final, as the client was told.
    for r in log:
        stored = by_id.get(r.id)
        if stored is None:
            found.append(Violation("accounting", f"claim {r.id} is not in the store"))
        elif stored.state == "bound":
            found.append(Violation("accounting", f"claim {r.id} still bound after the soak"))
        elif r.final_state is not None and stored.state != r.final_state:
            found.append(
                Violation(
                    "accounting",
                    f"claim {r.id}: the release answered {r.final_state}, the store says "
                    f"{stored.state}",
                )
            )
        elif (stored.worker_id, stored.worker_epoch, stored.org) != (r.worker_id, r.epoch, r.org):
            found.append(Violation("accounting", f"claim {r.id} differs from what the client got"))
    # I3 and I4 after the settle period.
    for item in left.stray_processes:
        found.append(Violation("I3", f"process without a live row: {item}"))
    for item in left.rows_without_process:
        found.append(Violation("I3", f"live row without a process: {item}"))
    for item in left.hot_idle:
        found.append(Violation("I3", f"hot_idle past its TTL: {item}"))
    for item in left.expired_bound:
        found.append(Violation("I3", f"claim bound past its lease: {item}"))
    if left.warm != warm_target:
        found.append(Violation("I3", f"{left.warm} warm workers, target {warm_target}"))
    for item in left.in_flight:
        found.append(Violation("I4", f"in-flight row after the settle period: {item}"))
    return found


# -- the soak ---------------------------------------------------------------------------------


@dataclass
class SoakReport:
    """Everything the soak counted."""

    seed: int
    minutes: float
    replicas: int
    rate: float
    load: LoadStats
    faults: Counter[str]
    injected: dict[str, int]
    server: dict[str, float]
    leadership: dict[str, float]
    settle_s: float
    findings: dict[str, str]
    peak_live: int
    oldest_in_flight: dict[str, float]
    violations: list[Violation]
    fault_errors: list[str]

    def as_json(self) -> dict[str, Any]:
        """The report as plain data (`--json`)."""
        load = self.load
        return {
            "seed": self.seed,
            "minutes": self.minutes,
            "replicas": self.replicas,
            "rate": self.rate,
            "claims": {
                "attempted": load.attempts,
                "served": sum(load.served.values()),
                "by_source": dict(load.served),
                "refused": dict(load.errors),
                "released": dict(load.released),
                "release_gave_up": load.release_gave_up,
                "renewed": load.renewed,
                "worker_checks": dict(load.worker_checks),
            },
            "faults": dict(self.faults),
            "failed_writes": self.injected,
            "server": self.server,
            "leadership": self.leadership,
            "settle_s": self.settle_s,
            "findings": self.findings,
            "violations": [{"invariant": v.invariant, "detail": v.detail} for v in self.violations],
            "fault_errors": self.fault_errors,
        }

    def print(self) -> None:
        """The report, one figure per line."""
        load = self.load
        served = sum(load.served.values())
        lat = sorted(load.latencies)
        p99 = lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))] * 1000 if lat else 0.0
        print(
            f"chaos soak: {self.minutes:g} min, seed {self.seed}, {self.replicas} replicas, "
            f"{self.rate:g} claims/s"
        )
        print(f"  claims attempted       {load.attempts}")
        print(f"  claims served          {served} {dict(load.served)} (p99 {p99:.0f} ms)")
        print(f"  claims refused         {sum(load.errors.values())} {dict(load.errors)}")
        print(f"  releases               {dict(load.released)}; gave up {load.release_gave_up}")
        print(f"  renewals               {load.renewed}")
        print(f"  worker checks          {dict(load.worker_checks)}")
        print(f"  faults injected        {dict(sorted(self.faults.items()))}")
        print(
            f"  failed writes          {self.injected.get('write', 0)} worker/claim writes, "
            f"{self.injected.get('lease', 0)} lease writes (raised by the trigger)"
        )
        print("  server counters        " + ", ".join(f"{k} {v:g}" for k, v in self.server.items()))
        print(
            "  leadership             "
            + ", ".join(f"{k} {v:g}" for k, v in self.leadership.items())
        )
        print(f"  peak live workers      {self.peak_live}")
        oldest = ", ".join(f"{k} {v:.1f}s" for k, v in sorted(self.oldest_in_flight.items()))
        print(f"  oldest in-flight rows  {oldest or '-'}")
        print(f"  settled after          {self.settle_s:.1f} s after the load stopped")
        for name, text in self.findings.items():
            print(f"  {name:<22} {text}")
        for error in self.fault_errors:
            print(f"  fault not injected     {error}")
        by_invariant = Counter(v.invariant for v in self.violations)
        names = ("I1", "I2", "I3", "I4", "I5", "accounting", "leadership")
        print(
            "  violations             "
            + ", ".join(f"{name} {by_invariant.get(name, 0)}" for name in names)
            + f" (total {len(self.violations)})"
        )
        for v in self.violations[:50]:
            print(f"    {v.invariant}: {v.detail}")


async def postgres_reachable(url: str) -> str | None:
    """None when PostgreSQL answers, else why not."""
    try:
        async with await psycopg.AsyncConnection.connect(url, connect_timeout=5) as conn:
            await conn.execute("SELECT 1")
    except psycopg.Error as exc:
        return str(exc).strip() or repr(exc)
    return None


async def run_soak(
    *,
    minutes: float,
    seed: int,
    replicas: int,
    rate: float,
    postgres_url: str,
    workdir: Path,
    keep: bool = False,
    fleet_label: str | None = None,
    schema: str | None = None,
) -> SoakReport:
    """Run the soak and its audit; the report lists every violation found."""
    rng = random.Random(seed)
    timings = Timings()
    pool = demo_pool()
    warm_target = int(pool["warm_target"])
    async with ReplicaSet(
        postgres_url=postgres_url,
        count=replicas,
        pools=[pool],
        timings=timings,
        workdir=workdir,
        schema=schema,
        fleet=fleet_label,
    ) as fleet:
        try:
            await fleet.start()
            faults = StoreFaults(postgres_url, fleet.schema)
            await faults.install()
            load = Load(fleet, rate=rate, rng=random.Random(rng.random()), lease_s=pool["lease_s"])
            monkey = ChaosMonkey(fleet, faults, random.Random(rng.random()))
            leader_monitor = LeaderMonitor(fleet)
            t = pool["timeouts"]
            # A row owned by a replica that died, stalled or lost the store is swept only
            # after its owner expired and a leader took over: that is the slack.
            slack = (
                timings.instance_expiry_s
                + 2 * timings.lease_duration_s
                + 6.0  # the longest replica downtime before its restart
                + 4 * timings.janitor_interval_s
            )
            store_monitor = StoreMonitor(
                postgres_url,
                fleet.schema,
                org_cap=pool["max_workers_per_org"],
                pool_cap=pool["max_workers"],
                timeouts={
                    "spawning": t["spawn_s"],
                    "reserved": t["reserve_s"],
                    "activating": t["activation_s"],
                    "draining": t["drain_s"],
                },
                slack_s=slack,
            )
            stop = asyncio.Event()
            monitors = [
                asyncio.create_task(store_monitor.run(stop)),
                asyncio.create_task(monkey.run(stop)),
                asyncio.create_task(leader_monitor.run(stop)),
            ]
            try:
                await load.run(minutes * 60)
            finally:
                load_end = time.monotonic()
                stop.set()
                await asyncio.gather(*monitors)
            injected = await faults.injected()
            # The orphaned claims of requests that got no answer expire by their lease.
            _, left = await settle(
                fleet, warm_target, timeout=pool["lease_s"] + pool["hot_idle_ttl"] + 60
            )
            settle_s = time.monotonic() - load_end
            stranded = fleet.stranded_stops()
            expired_lines, expired_replicas = fleet.log_events("instance_expired_while_alive")
            findings = {
                # The janitor's safety net for processes no live row names (not a violation:
                # it is how such processes are bounded), counted to see how often it acts.
                "stranded stopped": f"{stranded} live processes stopped by the stranded scan",
                # Replicas that ran on after their instance row had expired (a stall longer
                # than instance_expiry_s): the leader treats their new workers as orphans.
                "expired while alive": f"{expired_replicas} replica generations "
                f"({expired_lines} heartbeats refused)",
            }
            await fleet.scrape_all()
            workers = await read_workers(postgres_url, fleet.schema)
            claims = await read_claims(postgres_url, fleet.schema)
            violations = (
                load.violations
                + leader_monitor.violations
                + store_monitor.violations
                + audit(load.log, workers, claims, left, warm_target)
            )
            server = {
                name: fleet.counter_total(f"stoker_{name}_total")
                for name in ("persist_failures", "pass_failures", "fence_misses")
            }
            return SoakReport(
                seed=seed,
                minutes=minutes,
                replicas=replicas,
                rate=rate,
                load=load.stats,
                faults=monkey.counts,
                injected=injected,
                server=server,
                leadership={
                    "samples": leader_monitor.samples,
                    "handovers": leader_monitor.handovers,
                    "longest_leaderless_s": round(leader_monitor.longest_gap_s, 1),
                },
                settle_s=settle_s,
                findings=findings,
                peak_live=store_monitor.peak_live,
                oldest_in_flight=store_monitor.oldest_in_flight,
                violations=violations,
                fault_errors=monkey.errors,
            )
        finally:
            await fleet.close(keep=keep)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, run the soak, print the report; the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=2.0, help="how long the load runs")
    parser.add_argument("--seed", type=int, default=1, help="seed of the fault schedule and load")
    parser.add_argument("--replicas", type=int, default=3, help="stoker serve processes")
    parser.add_argument("--rate", type=float, default=12.0, help="claims per second")
    parser.add_argument(
        "--postgres",
        default=os.environ.get("STOKER_TEST_POSTGRES_URL", DEFAULT_POSTGRES),
        help="PostgreSQL URL (a schema of its own is created and dropped)",
    )
    parser.add_argument("--workdir", type=Path, default=None, help="keep replica logs here")
    parser.add_argument("--keep", action="store_true", help="keep the schema for inspection")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    parser.add_argument(
        "--fleet", default=None, help="label of the worker processes (default: chaos-<random>)"
    )
    parser.add_argument(
        "--schema", default=None, help="PostgreSQL schema to use (default: stoker_chaos_<random>)"
    )
    args = parser.parse_args(argv)
    if args.replicas < 2:
        parser.error("--replicas must be at least 2 (one is killed now and then)")
    problem = asyncio.run(postgres_reachable(args.postgres))
    if problem is not None:
        print(f"chaos soak: PostgreSQL at {args.postgres} is not reachable: {problem}")
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="stoker-chaos-"))
    try:
        report = asyncio.run(
            run_soak(
                minutes=args.minutes,
                seed=args.seed,
                replicas=args.replicas,
                rate=args.rate,
                postgres_url=args.postgres,
                workdir=workdir,
                keep=args.keep,
                fleet_label=args.fleet,
                schema=args.schema,
            )
        )
    except RuntimeError as exc:
        print(f"chaos soak could not run: {exc}")
        return 2
    report.print()
    if args.json is not None:
        args.json.write_text(json.dumps(report.as_json(), indent=2))
    if args.workdir is None:
        if report.violations:
            print(f"  replica logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
