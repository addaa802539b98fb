"""`backtest`: a pool's recorded claims replayed through the simulator (`stoker.sim.backtest`)
for its current settings and for candidates, or a search for the cheapest settings that
meet a target."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from stoker.cli.claims import LOG_PAGE
from stoker.cli.output import JsonFlag, fail, given_server, make_console, print_json

if TYPE_CHECKING:
    from stoker.config import StokerConfig
    from stoker.config.convert import DomainConfig
    from stoker.domain.ledger import ClaimLogEntry
    from stoker.domain.specs import CostSpec
    from stoker.sim.backtest import Figures, Recommendation, SpawnToReady
    from stoker.sim.claimlog import ClaimReplay

#: The settings of the pool's current run when nothing says otherwise.
_GRAMMAR = "KEY=VALUE[,KEY=VALUE...]"


def backtest(
    from_file: Annotated[
        Path | None,
        typer.Option(
            "--from",
            help="A claim log (JSON lines, as `stoker claims export` writes; - reads stdin)",
            dir_okay=False,
            show_default=False,
        ),
    ] = None,
    url: Annotated[
        str | None,
        typer.Option(
            "--url",
            help=(
                "Fetch the log, the pool's settings and spawn times from this server "
                "(before the command too; $STOKER_URL; not with --from)"
            ),
            show_default=False,
        ),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            help="Bearer token (before the command too; $STOKER_TOKEN)",
            show_default=False,
        ),
    ] = None,
    since: Annotated[
        str, typer.Option("--since", help="With --url: the log since (e.g. 7d, 12h)")
    ] = "7d",
    pool: Annotated[
        str | None,
        typer.Option("--pool", help="The pool (needed when the log holds several)"),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            "-c",
            help="Take the pool's current settings from this config file",
            dir_okay=False,
            show_default=False,
        ),
    ] = None,
    current: Annotated[
        str | None,
        typer.Option(
            "--current",
            metavar=_GRAMMAR,
            help="The pool's current settings (over --config's or the server's)",
            show_default=False,
        ),
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            metavar="KEY=VALUE",
            help="A change to the current settings; all --set together make one candidate",
            show_default=False,
        ),
    ] = None,
    candidate: Annotated[
        list[str] | None,
        typer.Option(
            "--candidate",
            metavar=_GRAMMAR,
            help="One candidate: changes to the current settings (repeatable)",
            show_default=False,
        ),
    ] = None,
    policy: Annotated[
        list[str] | None,
        typer.Option(
            "--policy",
            "-p",
            help="A candidate: the current settings under this simulator policy (repeatable)",
            show_default=False,
        ),
    ] = None,
    spawn_s: Annotated[
        str | None,
        typer.Option(
            "--spawn-s",
            metavar="P50[:P99]",
            help="Spawn-to-ready seconds (default: the server's ledger, else the waits of "
            "the log's cold claims, else 5:12)",
            show_default=False,
        ),
    ] = None,
    start_slots: Annotated[
        str | None,
        typer.Option(
            "--start-slots",
            metavar="N[:HOLD]",
            help="A local pool's machine starts at most N workers at once, each holding its "
            "slot HOLD seconds (default: the server's, else -c's runtime.start_limit or one "
            "per core, each for its whole spawn)",
            show_default=False,
        ),
    ] = None,
    recommend: Annotated[
        bool,
        typer.Option("--recommend", help="Search for the cheapest settings that meet --target"),
    ] = False,
    target: Annotated[
        str,
        typer.Option(
            "--target",
            metavar="FIGURE=NUMBER",
            help="cold_share, session_p99_ms or claim_p99_ms, at most NUMBER",
        ),
    ] = "cold_share=0.005",
    search: Annotated[
        str,
        typer.Option(
            "--search",
            metavar="KEY[,KEY...]",
            help="The settings --recommend varies",
        ),
    ] = "warm_target,demand.quantile,hot_idle_ttl,headroom_nodes",
    seed: Annotated[int, typer.Option("--seed", help="Seed")] = 1,
    jobs: Annotated[
        int,
        typer.Option("--jobs", "-j", min=0, help="Settings run at once (0: up to two per CPU)"),
    ] = 0,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Directory for the report", file_okay=False),
    ] = None,
    no_progress: Annotated[bool, typer.Option("--no-progress", help="No progress bar")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Replay a pool's recorded claims through the simulator, for its current settings and
    for candidates, and compare cold share, latency, idle worker-hours and cost.

    Settings are KEY=VALUE: warm_target, max_workers, max_workers_per_org, hot_idle_ttl,
    max_ttl, min_hot_idle, scale_down_delay, lease_s, claim_timeout_s, headroom_nodes,
    demand.quantile, demand.org_forecast, demand.headroom, reuse, and policy (a simulator
    policy kind). The current settings always run (named "current"); all --set options together
    make one candidate, each --candidate another, each --policy another.
    """
    from stoker.extras import missing_extra

    problem = missing_extra("sim", "the backtest")
    if problem is not None:
        fail(problem)

    from stoker.domain.errors import ConfigError
    from stoker.sim.backtest import (
        SEARCHED,
        Backtest,
        all_figures,
        parse_settings,
        parse_target,
        parse_value,
        settings_text,
    )

    if from_file is not None and url is not None:
        fail("give the claim log: either --from FILE or --url URL, not both", code=2)
    if from_file is None:
        # The server given before the command (`stoker --url URL backtest`, $STOKER_URL),
        # as every command that talks to one takes it.
        url, token = given_server(url, token)
        if url is None:
            fail("give the claim log: either --from FILE or --url URL", code=2)
    try:
        known: dict[str, Any] = {}
        spawn: SpawnToReady | None = None
        cost: CostSpec | None = None
        resources: tuple[float, float] | None = None
        #: The per-org overrides in force (org -> the settings it sets itself), and where
        #: they come from; None: no source states them.
        orgs: dict[str, dict[str, Any]] = {}
        orgs_source: str | None = None
        #: Where the pool cap replayed (`max_workers`) comes from, for the report.
        cap_source = "no server, --config or --current max_workers gives one"
        #: The replicas' intervals (`ControlPlaneConfig` keys), and whose they are.
        intervals: dict[str, Any] = {}
        passes_source: str | None = None
        #: The live machine's start-up slots (local processes), and whose they are.
        slots: tuple[int, float | None] | None = None
        slots_source = ""
        if from_file is not None:
            from stoker.sim.claimlog import read_claim_log, read_claim_stream

            replay = (
                read_claim_stream(sys.stdin.buffer, pool)
                if str(from_file) == "-"
                else read_claim_log(from_file, pool)
            )
        else:
            assert url is not None
            replay, known, spawn, cost, resources, stated, served, slots = _from_server(
                url, token, since, pool
            )
            if slots is not None:
                slots_source = f"the server's, GET {url}/v1/pools/{replay.pool}"
            if served:
                intervals, passes_source = served, f"the server's, GET {url}/v1/pools/{replay.pool}"
            if stated is not None:
                orgs, orgs_source = (
                    stated,
                    f"the server's org_overrides, GET {url}/v1/pools/{replay.pool}",
                )
            if "max_workers" in known:
                cap_source = f"the server's cap, GET {url}/v1/pools/{replay.pool}"
        # The live pool's (CPUs, GiB) per worker, as its ledger counted them or its
        # template says: a local process has no CPU share (`resources_of`).
        sized = resources
        if config is not None:
            file = _ConfigFile.load(config)
            pool_settings, given, prices, sizes = _config_settings(file, replay.pool)
            if {"janitor_interval_s", "reaper_interval_s"} & set(given):
                passes_source = "the config file's"
            intervals = {**intervals, **given}
            config_cap, config_source = _config_cap(file, replay.pool)
            if slots is None:
                slots, slots_source = _config_slots(file)
            if "max_workers" in known and pool_settings["max_workers"] == 0:
                # The live server's cap in force, derived on its own machine, over one
                # derived here.
                pool_settings["max_workers"] = known["max_workers"]
            else:
                pool_settings["max_workers"], cap_source = config_cap, config_source
            known.update(pool_settings)
            sized = sizes
            if prices is not None:
                cost, resources = prices, sizes
            # The file's `orgs:` over the server's, org by org (as its pool settings).
            orgs.update(_config_orgs(file))
            orgs_source = f"orgs: in {config}" + (f" over {orgs_source}" if orgs_source else "")
        if current:
            given = parse_settings(current)
            if "max_workers" in given:
                cap_source = "--current"
            known.update(given)
        spawn, spawn_source = _spawn_of(spawn_s, spawn, replay)
        if start_slots is not None:
            slots, slots_source = _parse_slots(start_slots), "--start-slots"
        runs: list[tuple[str, dict[str, Any]]] = [("current", {})]
        if set_:
            changes: dict[str, Any] = {}
            for item in set_:
                key, sep, raw = item.partition("=")
                if not sep:
                    raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
                if key.strip() in changes:
                    # All --set make one candidate: two values of a key cannot both be it.
                    raise ConfigError(f"--set {key.strip()} given twice")
                changes[key.strip()] = parse_value(key.strip(), raw.strip())
            runs.append((settings_text(changes), changes))
        for text in candidate or []:
            changes = parse_settings(text)
            if not changes:
                raise ConfigError(f"--candidate {text!r}: expected {_GRAMMAR}")
            runs.append((settings_text(changes), changes))
        for name in policy or []:
            runs.append((f"policy={name}", {"policy": parse_value("policy", name)}))
        names = [name for name, _ in runs]
        if len(set(names)) != len(names):
            raise ConfigError("two candidates are the same settings")
        goal = parse_target(target) if recommend else None
        if recommend and len(runs) > 1:
            raise ConfigError("--recommend searches from the current settings: no candidates")
        if recommend and out is not None:
            # The search keeps each replay's figures, not its report: nothing to write.
            raise ConfigError(
                "--out writes the report of the settings given; --recommend prints the ones "
                "it finds (replay them with --set to write their report)"
            )
        keys = [k.strip() for k in search.split(",") if k.strip()]
        for key in keys:
            if key not in SEARCHED:
                raise ConfigError(f"--search: cannot search {key!r}; one of {', '.join(SEARCHED)}")
    except ConfigError as exc:
        fail(str(exc).removeprefix("scenario backtest: "), code=2)
    if out is not None:
        from stoker.sim.report import check_out

        try:
            check_out(out)
        except OSError as exc:
            fail(f"cannot write the report to {out}: {exc}")
    # Settings replay the same log, so their runs are of about one length: all at once
    # they end together (three on two cores take 1.5 runs' time, not 2). At most two
    # per CPU, since each holds the log and its simulated fleet in memory.
    workers = jobs or 2 * (os.cpu_count() or 1)
    from stoker.cli.scaletest import _ScaletestProgress

    bar = _ScaletestProgress(enabled=not no_progress and not as_json)
    _warn_orgs(replay, orgs, orgs_source, from_server=url is not None)
    if replay.repeated:
        print(
            f"stoker: warning: {replay.repeated:,} claims of the log repeat an earlier one of "
            "the same instant in every field (a window exported twice and joined?); they are "
            "replayed as claims of their own",
            file=sys.stderr,
        )
    # What the current settings replayed beyond their KEY=VALUEs, for every output.
    facts: dict[str, Any] = {
        "cap": {"max_workers": known.get("max_workers", 0), "source": cap_source},
        "org_overrides": _orgs_json(replay, orgs, orgs_source),
    }
    # Local processes: a spawn never waits for a node.
    machine = sized is not None and sized[0] == 0
    facts["local"] = machine
    facts["repeated_claims"] = replay.repeated
    facts["spawn_s"] = {"p50": spawn.p50_s, "p99": spawn.p99_s, "source": spawn_source}
    notes = [_cap_line(known.get("max_workers", 0), cap_source)]
    if not known:
        notes.append(
            "current settings: a pool's defaults (no server, --config or --current states "
            "the pool's)"
        )
    notes.append(
        f"spawn-to-ready: {spawn.p50_s:.3g} s median, {spawn.p99_s:.3g} s p99 ({spawn_source})"
    )
    notes.append(_passes_line(intervals, passes_source, facts))
    if machine:
        notes.append("local processes: no spawn waits for a node (its nodes are there at once)")
        notes.append(_slots_line(slots, slots_source, facts))
    else:
        slots = None  # a Kubernetes pool's start-ups are the kubelets' own
        if sized is None:
            notes.append(
                "nodes: simulated, as a Kubernetes pool's (no server ledger or --config says "
                "what its workers run on; a local pool's spawns never wait for a node: give -c)"
            )
    notes += [line for line in [_orgs_line(replay, orgs, orgs_source)] if line]
    run = Backtest(
        replay=replay,
        orgs=orgs,
        current=known,
        spawn=spawn,
        control_plane=intervals,
        seed=seed,
        jobs=workers,
        progress=bar.update,
        cost=cost,
        resources=resources,
        machine=machine,
        start_slots=slots,
    )
    try:
        if goal is not None:
            from stoker.sim.backtest import recommend as run_search

            try:
                found = run_search(run, *goal, keys=keys)
            except ConfigError as exc:
                bar.stop()
                fail(str(exc).removeprefix("scenario backtest: "), code=2)
            finally:
                bar.stop()
            _print_recommendation(found, replay, known, facts, notes, url=url, as_json=as_json)
            if found.settings is None or not found.confirmed_ok:
                raise typer.Exit(1)
            return
        try:
            result = run.run(runs)
        except ConfigError as exc:
            bar.stop()
            fail(str(exc).removeprefix("scenario backtest: "), code=2)
    finally:
        bar.stop()
    rows = all_figures(result, cost, resources)
    if out is not None:
        _write_report(result, rows, replay, out, notes)
    if as_json:
        print_json(
            {
                "pool": replay.pool,
                "claims": len(replay),
                "span_s": replay.span_s,
                "recorded_cold_share": replay.recorded_cold_share(),
                "current": known,
                **facts,
                "runs": [
                    {**f.as_dict(), "settings": s} for f, (_, s) in zip(rows, runs, strict=True)
                ],
                "wall_s": round(result.wall_s, 3),
            }
        )
        return
    _print_table(replay, rows)
    print("\n".join(notes))
    print(
        f"{_claims(len(replay))} over {_span(replay.span_s)}, {_claims(len(rows), 'settings')} in "
        f"{result.wall_s:.1f} s" + (f"; report in {out}" if out is not None else ""),
        flush=True,
    )


# -- the server ------------------------------------------------------------------------------


def _from_server(
    url: str, token: str | None, since: str, pool: str | None, *, page_size: int = LOG_PAGE
) -> tuple[
    ClaimReplay,
    dict[str, Any],
    SpawnToReady | None,
    CostSpec | None,
    tuple[float, float] | None,
    dict[str, dict[str, Any]] | None,
    dict[str, float],
    tuple[int, float | None] | None,
]:
    """The log (`GET /v1/claims/log`, page after page), the pool's current settings,
    per-org overrides (`GET /v1/pools/{name}`; None: the server states none), the
    replicas' intervals (empty: the server states none) and start-up slots (None: it
    bounds none, or does not say), and its
    spawn-to-ready time, prices and resources per worker (`GET /v1/pools/{name}/ledger`
    when the server has it, else None)."""
    import httpx

    from stoker.domain.errors import ConfigError
    from stoker.sim.claimlog import build_replay, in_order, parse_entry

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=60.0) as client:
            where = f"{url}/v1/claims/log"

            def entries() -> Iterator[tuple[ClaimLogEntry, str]]:
                """The log's entries, parsed page by page as they come (a week of a
                million is never held as JSON)."""
                params: dict[str, Any] = {"since": since, "limit": page_size}
                if pool:
                    params["pool"] = pool
                number = 0
                while True:
                    answer = client.get("/v1/claims/log", params=params)
                    _raise_for(answer, "/v1/claims/log")
                    page = answer.json()
                    for entry in page.get("entries", []):
                        number += 1
                        at = f"{where} entry {number}"
                        yield parse_entry(entry, at), at
                    if not page.get("next"):
                        return
                    params["after"] = page["next"]

            replay = build_replay(in_order(entries()), pool)
            info = client.get(f"/v1/pools/{replay.pool}")
            if info.status_code == 404:
                # Deleted: its claim log stays (its own retention), its settings are gone.
                raise ConfigError(
                    f"{url} serves no pool {replay.pool!r} any more (deleted?), though its "
                    f"claim log is there: export it (stoker claims export --pool "
                    f"{replay.pool} --since {since} --out FILE) and replay it with --from FILE "
                    "and -c (a config with the settings it ran with)"
                )
            _raise_for(info, f"/v1/pools/{replay.pool}")
            settings = _pool_settings(info.json())
            stated = _org_overrides(info.json())
            served = _served_intervals(info.json())
            slots = _served_slots(info.json())
            ledger = client.get(f"/v1/pools/{replay.pool}/ledger", params={"since": since})
            body = ledger.json() if ledger.status_code == 200 else None
            spawn, cost, resources = _ledger_spawn(body), _ledger_cost(body), _ledger_sizes(body)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        # InvalidURL is no HTTPError: a malformed --url (`http://[::1`) is the user's.
        raise ConfigError(f"cannot read from {url}: {exc}") from None
    except (ValueError, AttributeError):
        raise ConfigError(f"{url}: an answer that is not the API's JSON") from None
    return replay, settings, spawn, cost, resources, stated, served, slots


def _parse_slots(text: str) -> tuple[int, float | None]:
    """`N` or `N:HOLD` (start-ups at once, seconds each holds its slot)."""
    from stoker.domain.errors import ConfigError

    head, sep, tail = text.partition(":")
    try:
        limit, hold = int(head), float(tail) if sep else None
    except ValueError:
        raise ConfigError(f"--start-slots {text!r}: expected N or N:HOLD") from None
    if limit < 1 or (hold is not None and not (math.isfinite(hold) and hold >= 0)):
        raise ConfigError(
            f"--start-slots {text!r}: N must be at least 1 and HOLD a number of seconds >= 0"
        )
    return limit, hold


def _served_slots(body: Any) -> tuple[int, float | None] | None:
    """The answering replica's start-up slots and the mean seconds a start-up held one,
    as `GET /v1/pools/{name}` states them (local processes); None when it states none."""
    if not isinstance(body, Mapping):
        return None
    limit, hold = body.get("start_limit"), body.get("start_slot_s")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        return None
    if isinstance(hold, bool) or not isinstance(hold, int | float):
        return limit, None
    return limit, float(hold) if math.isfinite(hold) and hold >= 0 else None


def _served_intervals(body: Any) -> dict[str, float]:
    """The replicas' intervals a pool's `GET /v1/pools/{name}` states (the answering
    replica's config's); none from a server that does not say."""
    out = {}
    for key in ("janitor_interval_s", "reaper_interval_s"):
        value = body.get(key) if isinstance(body, Mapping) else None
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            out[key] = float(value)
    return out


def _ledger_cost(body: Any) -> CostSpec | None:
    """The pool's prices as its ledger states them (None: it has none)."""
    from stoker.domain.specs import CostSpec

    prices = body.get("cost") if isinstance(body, Mapping) else None
    if not isinstance(prices, Mapping):
        return None
    given = {k: float(v) for k, v in prices.items() if v is not None and k in _PRICES}
    try:
        return CostSpec(**given) if given else None
    except ValueError:
        return None


_PRICES = ("per_cpu_hour", "per_gib_hour", "per_worker_hour")
_WORKER_SECONDS = ("warm_s", "hot_s", "hot_idle_s", "starting_s", "draining_s")


def _ledger_sizes(body: Any) -> tuple[float, float] | None:
    """The pool's (CPUs, GiB) per worker as its ledger counted them: resource-seconds
    over worker-seconds (None: no worker time in the window)."""
    total = body.get("total") if isinstance(body, Mapping) else None
    if not isinstance(total, Mapping):
        return None
    try:
        worker_s = sum(float(total.get(k) or 0.0) for k in _WORKER_SECONDS)
        cpu_s, gib_s = float(total.get("cpu_s") or 0.0), float(total.get("gib_s") or 0.0)
    except (TypeError, ValueError):
        return None
    return (cpu_s / worker_s, gib_s / worker_s) if worker_s > 0 else None


def _org_overrides(body: Mapping[str, Any]) -> dict[str, dict[str, Any]] | None:
    """The per-org overrides a pool's `GET /v1/pools/{name}` states (None: a server that
    states none, from before it did)."""
    stated = body.get("org_overrides")
    if not isinstance(stated, Mapping):
        return None
    return {str(org): dict(given) for org, given in stated.items() if isinstance(given, Mapping)}


def _raise_for(answer: Any, path: str) -> None:
    from stoker.domain.errors import ConfigError

    if answer.status_code != 200:
        detail = ""
        try:
            detail = ": " + str(answer.json().get("detail", ""))
        except ValueError:
            pass
        raise ConfigError(f"GET {path} answered {answer.status_code}{detail}")


def _pool_settings(body: Mapping[str, Any]) -> dict[str, Any]:
    """The settings a pool's `GET /v1/pools/{name}` states: its targets and cap, and its
    stored settings (`settings`, those `PATCH` changes; the others keep the simulator's
    defaults). `max_workers` is the pool's `cap`: the cap in force, derived on the server's
    machine when the setting is 0. `warm_target` is the stored one: a drained pool states
    0 at the top (the target in force while it drains), not the one its log ran with."""
    from stoker.sim.backtest import PATCHABLE

    names = {"warm_target": "warm_target", "cap": "max_workers"}
    names.update({k: k for k in ("max_workers_per_org", "hot_idle_ttl", "headroom_nodes", "reuse")})
    out = {key: body[field] for field, key in names.items() if body.get(field) is not None}
    stored = body.get("settings")
    if isinstance(stored, Mapping):
        if stored.get("warm_target") is not None:
            out["warm_target"] = stored["warm_target"]
        for key in PATCHABLE:
            if stored.get(key) is not None:
                out.setdefault(key, stored[key])
    return out


def _spawn_of(
    given: str | None, measured: SpawnToReady | None, replay: ClaimReplay
) -> tuple[SpawnToReady, str]:
    """The spawn-to-ready time replayed, and where it comes from: `--spawn-s`, the
    server's ledger (`measured`), the waits of the log's cold claims, else the default."""
    from stoker.sim.backtest import MIN_COLD_WAITS, SpawnToReady

    if given is not None:
        return SpawnToReady.parse(given), "--spawn-s"
    if measured is not None:
        return measured, "the server's ledger"
    waits = SpawnToReady.of_waits(replay.cold_waits)
    if waits is not None:
        return waits, f"the waits of the log's {len(replay.cold_waits):,} cold claims"
    return SpawnToReady(), (
        f"assumed: no server ledger, --spawn-s or {MIN_COLD_WAITS} cold claims of the log state it"
    )


def _ledger_spawn(body: Any) -> SpawnToReady | None:
    """The ledger's spawn-to-ready time: its mean as the median, and the histogram's
    bucket that holds the 99th percentile (its upper bound) as the p99."""
    from stoker.sim.backtest import SpawnToReady

    total = body.get("total") if isinstance(body, Mapping) else None
    if not isinstance(total, Mapping) or not total.get("mean_ready_s"):
        return None
    mean = float(total["mean_ready_s"])
    bounds = [float(b) for b in body.get("spawn_buckets") or []]
    counts = [int(c) for c in total.get("ready_hist") or []]
    p99 = mean
    if bounds and sum(counts):
        seen, need = 0, 0.99 * sum(counts)
        for i, count in enumerate(counts):
            seen += count
            if seen >= need:
                # The last bucket is open: twice its lower bound stands for it.
                p99 = bounds[i] if i < len(bounds) else 2 * bounds[-1]
                break
    return SpawnToReady(mean, max(mean, p99))


@dataclass(frozen=True, slots=True)
class _ConfigFile:
    """A config file as `serve` reads it (no `STOKER_*` overrides) and its domain objects:
    read once, whichever of its parts a backtest takes."""

    path: Path
    config: StokerConfig
    domain: DomainConfig

    @classmethod
    def load(cls, path: Path) -> _ConfigFile:
        from stoker.config.convert import to_domain
        from stoker.config.loading import load_config

        config = load_config(path, environ={}).config
        return cls(path, config, to_domain(config))


def _config_settings(
    file: _ConfigFile, pool: str
) -> tuple[dict[str, Any], dict[str, Any], CostSpec | None, tuple[float, float]]:
    """The pool's settings in a stoker config file, the replicas' intervals it sets (and
    the Kubernetes runtime's `prefer_session_nodes`), the pool's prices (`cost`) and its
    (CPUs, GiB) per worker, which per-resource prices apply to."""
    from stoker.config.sections import KubernetesRuntimeConfig
    from stoker.domain.errors import ConfigError
    from stoker.domain.ledger import resources_of

    loaded, path = file.config, file.path
    intervals: dict[str, Any] = {
        key: getattr(loaded.intervals, key)
        for key in ("janitor_interval_s", "reaper_interval_s")
        if key in loaded.intervals_given()
    }
    if isinstance(loaded.runtime, KubernetesRuntimeConfig):
        intervals["prefer_session_nodes"] = loaded.runtime.prefer_session_nodes
    for spec in file.domain.pools:
        if spec.name == pool:
            return (
                {
                    "warm_target": spec.warm_target,
                    "max_workers": spec.max_workers,
                    "max_workers_per_org": spec.max_workers_per_org,
                    "hot_idle_ttl": 60.0 if spec.hot_idle_ttl is None else spec.hot_idle_ttl,
                    "max_ttl": spec.max_ttl,
                    "min_hot_idle": spec.min_hot_idle,
                    "scale_down_delay": spec.scale_down_delay,
                    "lease_s": spec.lease_s,
                    "claim_timeout_s": spec.claim_timeout_s,
                    "headroom_nodes": spec.headroom_nodes,
                    "demand.quantile": spec.demand.quantile,
                    "demand.headroom": spec.demand.headroom,
                    "reuse": spec.reuse.value,
                },
                intervals,
                spec.cost,
                resources_of(spec.template),
            )
    raise ConfigError(f"{path} has no pool {pool!r}")


def _config_slots(file: _ConfigFile) -> tuple[tuple[int, float | None] | None, str]:
    """The start-up slots of the config file's local runtime (`runtime.start_limit`, else
    one per core of this machine, as the runtime derives it), and where they come from;
    none for a Kubernetes runtime. How long a start-up holds its slot no file says."""
    from stoker.adapters.runtime_local import default_start_limit
    from stoker.config.sections import LocalRuntimeConfig

    runtime = file.config.runtime
    if not isinstance(runtime, LocalRuntimeConfig):
        return None, ""
    if runtime.start_limit is not None:
        return (runtime.start_limit, None), f"runtime.start_limit in {file.path}"
    return (default_start_limit(), None), f"one per core of this machine, as {file.path} leaves it"


def _slots_line(slots: tuple[int, float | None] | None, source: str, facts: dict[str, Any]) -> str:
    """What the replay's start-ups queue for (a local pool's slots), into `facts` too."""
    if slots is None:
        facts["start_slots"] = None
        return (
            "start-ups: not bounded (no server or -c states the machine's start-up slots; a "
            "pool that outruns them live has more cold claims than this replay)"
        )
    limit, hold = slots
    facts["start_slots"] = {"limit": limit, "hold_s": hold, "source": source}
    held = (
        "each for its whole spawn-to-ready (how long a start-up holds its slot is measured "
        "by a running server only)"
        if hold is None
        else f"each held {hold:.2g} s on average"
    )
    return f"start-ups: at most {limit} at once, {held} ({source}); more wait in turn"


def _config_cap(file: _ConfigFile, pool: str) -> tuple[int, str]:
    """The pool cap the fleet of the config file at `path` runs `pool` with, and where it
    comes from: its `max_workers`, else (local processes) the memory budget over a worker's
    `memory_mb`, as the local runtime derives it, else none (0: unbounded)."""
    from stoker.adapters.runtime_local import default_memory_budget_mb, memory_cap
    from stoker.config.sections import LocalRuntimeConfig
    from stoker.domain.specs import ProcessTemplate

    path = file.path
    spec = next(p for p in file.domain.pools if p.name == pool)
    if spec.max_workers > 0:
        return spec.max_workers, f"max_workers in {path}"
    runtime, template = file.config.runtime, spec.template
    if not isinstance(runtime, LocalRuntimeConfig) or not isinstance(template, ProcessTemplate):
        return 0, f"max_workers 0 in {path}: unbounded"
    budget = runtime.memory_budget_mb
    if budget is None:
        # The local runtime's default: half the machine (this one: give the live one's
        # with --current max_workers=N when it differs).
        budget = default_memory_budget_mb()
        where = f"half of this machine's memory, {budget} MB"
    else:
        where = f"runtime.memory_budget_mb {budget}"
    cap = memory_cap(budget, template)
    return cap, f"derived in {path}: {where} / memory_mb {template.memory_mb}"


def _config_orgs(file: _ConfigFile) -> dict[str, dict[str, Any]]:
    """The per-org overrides of the config file at `path` (its `orgs:`), by org."""
    return {o.name: given for o in file.domain.orgs if (given := o.overrides())}


def _warn_orgs(
    replay: ClaimReplay,
    orgs: Mapping[str, Mapping[str, Any]],
    source: str | None,
    *,
    from_server: bool,
) -> None:
    """Say on stderr which per-org overrides the replay cannot run, and when no source
    states them at all (a server from before `org_overrides`, and no -c)."""
    from stoker.sim.backtest import unreplayed_orgs

    if source is None and from_server:
        print(
            "stoker: warning: the server does not state its per-org overrides (no "
            "org_overrides: a server from before them); give its config with -c to replay "
            "its orgs:",
            file=sys.stderr,
        )
    skipped = unreplayed_orgs(replay, orgs)
    if skipped:
        print(
            "stoker: warning: per-org overrides not replayed (the simulator has no such "
            f"setting): {_orgs_text(skipped)}; the log's holds already end where the live "
            "fleet ended them",
            file=sys.stderr,
        )


def _orgs_text(orgs: Mapping[str, Mapping[str, Any]], most: int = 10) -> str:
    from stoker.sim.backtest import settings_text

    shown = [f"{org} {settings_text(given)}" for org, given in list(orgs.items())[:most]]
    more = len(orgs) - most
    return "; ".join(shown) + (f"; and {more} more orgs" if more > 0 else "")


def _orgs_json(
    replay: ClaimReplay, orgs: Mapping[str, Mapping[str, Any]], source: str | None
) -> dict[str, Any]:
    from stoker.sim.backtest import replayed_orgs, unreplayed_orgs

    return {
        "replayed": replayed_orgs(replay, orgs),
        "not_replayed": unreplayed_orgs(replay, orgs),
        "source": source,
    }


def _orgs_line(
    replay: ClaimReplay, orgs: Mapping[str, Mapping[str, Any]], source: str | None
) -> str | None:
    """The report's line on the per-org overrides the settings replayed (None: none)."""
    from stoker.sim.backtest import replayed_orgs

    replayed = replayed_orgs(replay, orgs)
    if not replayed:
        return None
    return f"per-org overrides replayed ({source}): {_orgs_text(replayed)}"


def _cap_line(cap: int, source: str) -> str:
    """The report's line on the pool cap the current settings replayed."""
    return f"pool cap: {cap or 'unbounded'} ({source})"


# -- output ----------------------------------------------------------------------------------


def _cells(f: Figures) -> list[str]:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:,.0f} ms"

    cold = "-" if f.cold_share is None else f"{f.cold_share:.2%}"
    return [
        cold,
        f"{ms(f.claim_p50_ms)} / {ms(f.claim_p99_ms)}",
        f"{ms(f.session_p50_ms)} / {ms(f.session_p99_ms)}",
        str(f.failed),
        f"{f.idle_worker_hours:,.1f}",
        "-" if f.idle_warm_cost is None else _money(f.idle_warm_cost),
        _money(f.cost),
    ]


def _passes_line(intervals: Mapping[str, Any], source: str | None, facts: dict[str, Any]) -> str:
    """What the replay's passes run at, and whose those intervals are (`source`: who gave
    them; None: nobody did), into `facts` too."""
    from stoker.domain.specs import PlaneSettings

    defaults = PlaneSettings()
    janitor = intervals.get("janitor_interval_s", defaults.janitor_interval_s)
    reaper = intervals.get("reaper_interval_s", defaults.reaper_interval_s)
    given = {"janitor_interval_s", "reaper_interval_s"} & set(intervals)
    if source is None or not given:
        source = "stoker serve's defaults; -c gives a config file's"
    elif len(given) == 1:
        source += ", else stoker serve's defaults"
    facts["intervals"] = {"janitor_s": janitor, "reaper_s": reaper, "source": source}
    return f"passes: janitor every {janitor:g} s, reaper every {reaper:g} s ({source})"


def _span(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.1f} s"


def _claims(count: int, what: str = "claims") -> str:
    """`1 claim`, `2,000 claims` (`what` in the plural)."""
    return f"{count:,} {what[:-1] if count == 1 else what}"


def _money(value: float) -> str:
    # Short replays cost cents: four places below one unit of the currency.
    return f"{value:,.2f}" if abs(value) >= 1 else f"{value:.4f}"


_HEADERS = (
    "cold share",
    "claim p50 / p99",
    "session p50 / p99",
    "failed",
    "idle worker-h",
    "idle warm cost",
    "cost",
)


def _cost_note(rows: Sequence[Figures]) -> str:
    """What the cost column is: the pool's prices when the figures have them."""
    if any(f.priced_cost is not None for f in rows):
        return "cost: all worker time at the pool's prices (its `cost`), headroom included"
    return (
        "cost: the simulated nodes' (on-demand USD); give the pool a `cost` to price "
        "its worker time instead"
    )


def _table(title: str, rows: Sequence[Figures]) -> Table:
    table = Table(title=title)
    table.add_column("settings")
    for header in _HEADERS:
        table.add_column(header, justify="right")
    for f in rows:
        table.add_row(escape(f.name), *_cells(f))
    return table


def _print_table(replay: ClaimReplay, rows: Sequence[Figures]) -> None:
    recorded = replay.recorded_cold_share()
    # A log's pool is any text (`[/x]`): shown as it is, never as markup.
    title = f"backtest {escape(replay.pool)}" + (
        "" if recorded is None else f" (recorded cold share {recorded:.2%})"
    )
    make_console().print(_table(title, rows))
    print(_cost_note(rows))


def _markdown(replay: ClaimReplay, rows: Sequence[Figures]) -> str:
    lines = [
        f"# Backtest of pool {replay.pool}",
        "",
        f"{_claims(len(replay), 'recorded claims')} over {_span(replay.span_s)} "
        f"({replay.filled_holds} never bound, replayed with their org's median hold).",
        "",
        "| settings | " + " | ".join(_HEADERS) + " |",
        "|---|" + "---:|" * len(_HEADERS),
    ]
    lines += [f"| {f.name} | " + " | ".join(_cells(f)) + " |" for f in rows]
    lines += ["", _cost_note(rows) + "."]
    return "\n".join(lines) + "\n"


def _write_report(
    result: Any, rows: Sequence[Figures], replay: ClaimReplay, out: Path, notes: Sequence[str]
) -> None:
    from stoker.sim.report import write_report

    try:
        write_report(result, out)
        (out / "backtest.md").write_text(
            _markdown(replay, rows) + "".join(f"\n{note}.\n" for note in notes),
            encoding="utf-8",
        )
        (out / "backtest.json").write_text(
            json.dumps([f.as_dict() for f in rows], indent=2, sort_keys=True) + "\n",
            encoding="utf-8",
        )
    except OSError as exc:
        fail(f"cannot write the report to {out}: {exc}")


def _print_recommendation(
    found: Recommendation,
    replay: ClaimReplay,
    known: Mapping[str, Any],
    facts: Mapping[str, Any],
    notes: Sequence[str],
    *,
    url: str | None,
    as_json: bool,
) -> None:
    """The settings found, as the lines that apply them: to the server `url` whose log
    was replayed, when it was one."""
    from stoker.sim.backtest import patch_line, settings_text

    goal = f"{found.target} <= {found.bound:g}"
    # The claims the current settings fail (at the pool cap, which the search leaves) may
    # fail: every setting would.
    said = goal + (
        f", failing at most {found.failed_allowed} claims as the current settings do"
        if found.failed_allowed
        else ""
    )
    allowed = {"failed_allowed": found.failed_allowed}
    if found.settings is None or found.found is None:
        if as_json:
            print_json(
                {"target": goal, **allowed, "found": None, "tried": len(found.tried), **facts}
            )
        print(f"stoker: no setting tried ({len(found.tried)}) meets {said}", file=sys.stderr)
        return
    changes = {k: v for k, v in found.settings.items() if known.get(k) != v}
    line, patch, rest = patch_line(replay.pool, changes, url)
    if as_json:
        print_json(
            {
                "target": goal,
                **allowed,
                "settings": found.settings,
                "changes": changes,
                "patch": patch,
                "command": line if patch else None,
                "config_only": rest,
                "found": found.found.as_dict(),
                "confirmed": None if found.confirmed is None else found.confirmed.as_dict(),
                "confirmed_ok": found.confirmed_ok,
                "tried": len(found.tried),
                **facts,
            }
        )
        return
    rows = [found.found] + ([found.confirmed] if found.confirmed is not None else [])
    make_console().print(_table(f"cheapest of {len(found.tried)} settings with {said}", rows))
    print(_cost_note(rows))
    print(f"settings: {settings_text(found.settings) or '(the current ones)'}")
    print("\n".join(notes))
    if patch:
        print(line)
        where = "" if url is None else url.rstrip("/")
        print(f"PATCH {where}/v1/pools/{replay.pool} {json.dumps(patch, sort_keys=True)}")
    if rest:
        print(f"in the config file: {settings_text(rest)}")
    if not changes:
        print("the current settings are the cheapest found")
    verdict = "meets" if found.confirmed_ok else "does NOT meet"
    print(f"re-run at another seed {verdict} the target")
