"""A pool's recorded claims (the claim log's JSON lines) as arrivals to replay.

The format is fixed (`stoker claims export` writes it): one JSON object per line and
claim, sorted by `at`, with exactly these keys:

    {"at": 1700000000.25, "pool": "workers", "org": "acme", "mode": "prefer_warm",
     "source": "warm", "wait_s": 0.012, "held_s": 412.5, "outcome": "released",
     "revision": "r-1a2b"}

`at` is the arrival (unix seconds); `source` is null for a claim that was never bound;
`held_s` (bound to ended) is null while the claim is open or when it was never bound.

A replay sends each claim at its recorded time (relative to the first) and holds the
worker it gets for its recorded `held_s`. A claim that was never bound (no capacity, a
cap, a failure) is replayed too, since under other settings it may be served; it holds
for the median `held_s` of its org (of the whole log when its org has none, else
`DEFAULT_HOLD_S`). A claim still open at the end of the log holds until the log's end.
The simulator decides every claim's source anew.

Held in flat arrays, not one object per claim: a week of a million claims is forked into
every candidate's process.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import statistics
import zlib
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from stoker.domain.errors import ConfigError, one_line
from stoker.domain.ledger import EXPORT_KEYS, OUTCOMES, SOURCES, ClaimLogEntry
from stoker.domain.states import ClaimMode
from stoker.sim.scenario import LATEST_S, MAX_RUN_S

#: The keys of one line, exactly.
KEYS = EXPORT_KEYS
#: A never-bound claim's hold when no claim of the log was ever held (seconds).
DEFAULT_HOLD_S = 600.0
#: The latest arrival a log may hold (the simulator's latest second).
LATEST_AT = LATEST_S
_MODES = tuple(mode.value for mode in ClaimMode)


def parse_line(text: str, where: str) -> ClaimLogEntry:
    """One line of the log; ConfigError naming `where` (file:line) and the problem."""
    try:
        # Without its line break: a cut-off last line reads as the cut, not as a string
        # holding a control character.
        data = json.loads(text.rstrip("\r\n"))
    except json.JSONDecodeError as exc:
        # "Unterminated string starting at column 51", "Expecting value at column 1".
        problem = f"{exc.msg.removesuffix(' at')} at column {exc.colno}"
        raise ConfigError(f"{where}: not JSON ({problem})") from None
    return parse_entry(data, where)


def parse_entry(data: Any, where: str) -> ClaimLogEntry:
    """One claim of the log as a decoded JSON object (a line, or an entry of
    `GET /v1/claims/log`); ConfigError naming `where` and the problem."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    keys = set(data)
    if keys != KEYS:
        missing, unknown = sorted(KEYS - keys), sorted(keys - KEYS)
        problem = f"missing {missing}" if missing else f"unknown keys {unknown}"
        raise ConfigError(f"{where}: {problem}")
    at = _number(data, "at", where)
    if not 0 <= at <= LATEST_AT:
        raise ConfigError(f"{where}: at must be unix seconds from 1970 to 9999, not {at!r}")
    wait = _number(data, "wait_s", where)
    held = None if data["held_s"] is None else _number(data, "held_s", where)
    for key in ("pool", "org"):
        if not isinstance(data[key], str) or not data[key]:
            raise ConfigError(f"{where}: {key} must be a non-empty string")
    _one_of(data, "mode", _MODES, where)
    if data["source"] is not None:
        _one_of(data, "source", SOURCES, where)
    _one_of(data, "outcome", OUTCOMES, where)
    revision = data["revision"]
    if revision is not None and not isinstance(revision, str):
        raise ConfigError(f"{where}: revision must be a string or null")
    if wait < 0 or (held is not None and held < 0):
        raise ConfigError(f"{where}: wait_s and held_s cannot be negative")
    return ClaimLogEntry(
        id=where,
        at=at,
        pool=data["pool"],
        org=data["org"],
        mode=data["mode"],
        source=data["source"],
        wait_s=wait,
        held_s=held,
        outcome=data["outcome"],
        revision=revision,
    )


def _number(data: dict[str, Any], key: str, where: str) -> float:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{where}: {key} must be a finite number, not {value!r}")
    return float(value)


def _one_of(data: dict[str, Any], key: str, allowed: Sequence[str], where: str) -> None:
    if data[key] not in allowed:
        raise ConfigError(f"{where}: {key} {data[key]!r} is not one of {', '.join(allowed)}")


def parse_lines(lines: Iterable[str], source: str) -> Iterator[ClaimLogEntry]:
    """Every claim of the log's lines (blank lines skipped); ConfigError on a bad line or
    a line out of order."""
    parsed = (
        (parse_line(text, f"{source}:{number}"), f"{source}:{number}")
        for number, text in enumerate(lines, start=1)
        if text.strip()
    )
    return in_order(parsed)


def in_order(claims: Iterable[tuple[ClaimLogEntry, str]]) -> Iterator[ClaimLogEntry]:
    """The claims, checked to be sorted by `at` (ConfigError naming where one is not)."""
    last = -math.inf
    for claim, where in claims:
        if claim.at < last:
            raise ConfigError(f"{where}: not sorted by at ({claim.at} < {last})")
        last = claim.at
        yield claim


@dataclass
class ClaimReplay:
    """One pool's claims as the load driver replays them: arrival seconds since the first,
    org, mode and hold, in arrival order (parallel arrays)."""

    pool: str
    #: Unix seconds of the first arrival (0.0 for an empty log).
    start: float = 0.0
    at_s: array[float] = field(default_factory=lambda: array("d"))
    hold_s: array[float] = field(default_factory=lambda: array("d"))
    org_index: array[int] = field(default_factory=lambda: array("I"))
    mode_index: array[int] = field(default_factory=lambda: array("B"))
    orgs: list[str] = field(default_factory=list)
    #: What the live run saw: bound claims by source, and claims never bound.
    recorded_sources: dict[str, int] = field(default_factory=dict)
    recorded_unbound: int = 0
    #: Never-bound claims replayed with their org's median hold.
    filled_holds: int = 0
    #: Seconds the replay waits before the first arrival (the pool fills meanwhile, as
    #: the live pool was full when the log began).
    lead_s: float = 0.0
    #: Claims exactly like an earlier one of the same instant (every field): a window
    #: exported twice and joined, most likely. Replayed as claims of their own.
    repeated: int = 0
    #: How long each claim served cold waited, in arrival order: the spawn-to-ready time
    #: its users saw (`stoker.sim.backtest.SpawnToReady.of_waits`).
    cold_waits: array[float] = field(default_factory=lambda: array("d"))

    def __len__(self) -> int:
        return len(self.at_s)

    @property
    def span_s(self) -> float:
        """Seconds from the first arrival to the last."""
        return self.at_s[-1] if self.at_s else 0.0

    def mode(self, index: int) -> ClaimMode:
        """Claim `index`'s mode."""
        return ClaimMode(_MODES[self.mode_index[index]])

    def recorded_cold_share(self) -> float | None:
        """Cold claims over bound claims, as recorded (None: none was bound)."""
        bound = sum(self.recorded_sources.values())
        return self.recorded_sources.get("cold", 0) / bound if bound else None


def build_replay(claims: Iterable[ClaimLogEntry], pool: str | None = None) -> ClaimReplay:
    """The replay of one pool's claims (`pool`, or the log's only pool); ConfigError when
    the log holds no claims, several pools and none is named, or none of the named one.

    One pass, keeping arrays, not the claims: a week of a million claims is read in the
    memory of its arrays (the holds that need the whole log, a never-bound claim's org
    median and an open claim's end, are filled in after the pass)."""
    replay: ClaimReplay | None = None
    pools: set[str] = set()
    orgs: dict[str, int] = {}
    sources: dict[str, int] = {}
    #: Each org's recorded holds, by org index.
    held: dict[int, array[float]] = {}
    #: Claims whose hold is their org's median (never bound), and claims still open with
    #: their arrival (they hold until the log's end): filled in after the pass.
    unbound: array[int] = array("q")
    still_open: array[int] = array("q")
    open_at: array[float] = array("d")
    # The claims of the instant at hand (the log is sorted by `at`): a repeat is among them.
    instant: tuple[float, set[tuple[Any, ...]]] = (-1.0, set())
    end = 0.0
    for c in claims:
        pools.add(c.pool)
        if replay is None:
            if pool is not None and c.pool != pool:
                continue
            replay = ClaimReplay(pool=c.pool, start=c.at)
        elif c.pool != replay.pool:
            continue
        fields = (c.org, c.mode, c.source, c.wait_s, c.held_s, c.outcome, c.revision)
        if c.at != instant[0]:
            instant = (c.at, set())
        if fields in instant[1]:
            replay.repeated += 1
        instant[1].add(fields)
        if c.source is not None:
            sources[c.source] = sources.get(c.source, 0) + 1
            if c.source == "cold":
                replay.cold_waits.append(c.wait_s)
        else:
            replay.recorded_unbound += 1
        org = orgs.setdefault(c.org, len(orgs))
        index = len(replay.at_s)
        if c.held_s is not None:
            held.setdefault(org, array("d")).append(c.held_s)
            replay.hold_s.append(c.held_s)
        else:
            if c.outcome == "open" and c.source is not None:
                still_open.append(index)
                open_at.append(c.at)
            else:
                unbound.append(index)
            replay.hold_s.append(0.0)
        replay.at_s.append(c.at - replay.start)
        replay.org_index.append(org)
        replay.mode_index.append(_MODES.index(c.mode))
        end = c.at
    if pool is None and len(pools) > 1:
        raise ConfigError(f"the log holds several pools ({', '.join(sorted(pools))}): name one")
    if replay is None:
        if pool is None:
            raise ConfigError("the claim log holds no claims")
        raise ConfigError(f"the log holds no claim of pool {pool!r}")
    span = end - replay.start
    if span > MAX_RUN_S:
        raise ConfigError(
            f"the claims of pool {replay.pool!r} span {span / 86_400:,.0f} days; a replay "
            f"covers at most {MAX_RUN_S / 86_400:.0f} (export a shorter window: `stoker "
            "claims export --since 30d`)"
        )
    every = [h for holds in held.values() for h in holds]
    fallback = statistics.median(every) if every else DEFAULT_HOLD_S
    medians = {org: statistics.median(holds) for org, holds in held.items()}
    for index in unbound:
        replay.hold_s[index] = medians.get(replay.org_index[index], fallback)
    replay.filled_holds = len(unbound)
    for index, at in zip(still_open, open_at, strict=True):
        replay.hold_s[index] = max(0.0, end - at)
    replay.orgs = list(orgs)
    replay.recorded_sources = dict(sorted(sources.items()))
    return replay


#: The first bytes of a gzip file.
GZIP_MAGIC = b"\x1f\x8b"


def read_claim_log(path: Path, pool: str | None = None) -> ClaimReplay:
    """The replay of a JSON-lines claim log file, or of one compressed with gzip (`gzip
    claims.jsonl`, whatever its name); ConfigError (one line) on bad input."""
    return _read(lambda: _open_text(path), one_line(str(path)), pool)


def read_claim_stream(stream: IO[bytes], pool: str | None = None) -> ClaimReplay:
    """`read_claim_log` of a stream (standard input: `stoker claims export | stoker
    backtest --from -`), gzip-compressed or not; read whole before it is parsed."""

    def text() -> IO[str]:
        raw = stream.read()  # an OSError of the stream is the read's, as a file's is
        data = io.BytesIO(raw)
        if raw[: len(GZIP_MAGIC)] == GZIP_MAGIC:
            return io.TextIOWrapper(gzip.GzipFile(fileobj=data), encoding="utf-8")
        return io.TextIOWrapper(data, encoding="utf-8")

    return _read(text, "<stdin>", pool)


def _read(opened: Callable[[], IO[str]], path: str, pool: str | None) -> ClaimReplay:
    try:
        with opened() as lines:
            return build_replay(parse_lines(lines, path), pool)
    except OSError as exc:
        # gzip's BadGzipFile is one: no strerror, its own message.
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (EOFError, zlib.error):
        raise ConfigError(f"{path}: a gzip file cut short or damaged") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None


def _open_text(path: Path) -> IO[str]:
    """`path` opened as UTF-8 text, through gzip when it starts as a gzip file does."""
    with path.open("rb") as head:
        compressed = head.read(len(GZIP_MAGIC)) == GZIP_MAGIC
    if compressed:
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def synthetic_claims(
    count: int,
    *,
    span_s: float = 7 * 86_400.0,
    orgs: int = 30,
    mean_hold_s: float = 900.0,
    start: float = 1_699_833_600.0,
    pool: str = "workers",
    seed: int = 1,
) -> Iterator[dict[str, Any]]:
    """`count` claim-log lines (as dicts) over `span_s`, arriving on a daily cycle (peak at
    14:00, a ninth of it at night; weekends at a third), holds exponential: a stand-in for
    an exported log (tests, benchmarks, trying the backtest without a server)."""
    import random

    rng = random.Random(seed)
    # Thinning against the cycle's peak gives `count` arrivals in expectation; drawing
    # uniform times and keeping them by the rate gives exactly `count` after sorting.
    times: list[float] = []
    while len(times) < count:
        t = rng.uniform(0.0, span_s)
        if rng.random() <= _weekly_rate(t):
            times.append(t)
    times.sort()
    names = [f"org-{i:03d}" for i in range(orgs)]
    for t in times:
        hold = rng.expovariate(1 / mean_hold_s)
        yield {
            "at": round(start + t, 3),
            "pool": pool,
            "org": names[min(orgs - 1, int(rng.paretovariate(1.2)) - 1)],
            "mode": "prefer_warm",
            "source": "warm",
            "wait_s": 0.02,
            "held_s": round(hold, 3),
            "outcome": "released",
            "revision": "r-1",
        }


def _weekly_rate(t: float) -> float:
    """Relative arrival rate at `t` seconds into the week (1.0 at a weekday's peak)."""
    day, second = divmod(t, 86_400.0)
    daily = (1 + 0.8 * math.cos(2 * math.pi * (second - 50_400.0) / 86_400.0)) / 1.8
    return daily * (0.33 if day % 7 >= 5 else 1.0)
