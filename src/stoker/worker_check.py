"""`stoker worker-check -- CMD...`: a worker checked against the worker protocol.

The command is started as the local runtime starts a worker (`{port}`, `{worker_id}` and
`{python}` replaced in its argv; `STOKER_WORKER_ID`, `STOKER_PORT` and its activation
secret `STOKER_ACTIVATION_SECRET` in its environment, derived from a fresh fleet key),
then every rule of `docs/worker-protocol.md` is tried over HTTP, in order, and reported
as one row: health, the signature (none, wrong, another worker's), fencing (another
worker's id, a second org, a stale epoch, a replay), the session token (none, wrong,
revoked by a re-activation) and a stop on SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from stoker.adapters.runtime_local import free_port
from stoker.domain.activation import ActivationKey
from stoker.worker import (
    ACTIVATE_PATH,
    HEALTHZ_PATH,
    SECRET_ENV,
    SIGNATURE_HEADER,
    TRACEPARENT_HEADER,
    WORKER_ID_ENV,
    signature,
)

#: A W3C trace context as a tracing control plane sends it with an activation (outside
#: the signature): a worker must accept the activation with it.
TRACEPARENT_SAMPLE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
#: How long each HTTP request may take.
REQUEST_TIMEOUT_S = 5.0
#: How long a worker has to exit after SIGTERM (the pools' default stop grace).
STOP_GRACE_S = 10.0


@dataclass(frozen=True, slots=True)
class Row:
    """One rule, what the protocol expects, what the worker did, and whether that passes."""

    rule: str
    expected: str
    got: str
    passed: bool


@dataclass(slots=True)
class Report:
    """Every row of one check, and the worker's output when something failed."""

    rows: list[Row] = field(default_factory=list)
    output: str = ""

    @property
    def passed(self) -> bool:
        """True when every rule passed."""
        return bool(self.rows) and all(row.passed for row in self.rows)


class CannotStart(Exception):
    """The command could not be started at all."""


@contextlib.contextmanager
def started(
    argv: Sequence[str], *, worker_id: str, secret: str, host: str, log: Path
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """The worker process and its endpoint; killed (its whole session) on exit."""
    port = free_port(host)
    substitutions = {"{port}": str(port), "{worker_id}": worker_id, "{python}": sys.executable}
    command = []
    for arg in argv:
        for placeholder, value in substitutions.items():
            arg = arg.replace(placeholder, value)
        command.append(arg)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STOKER_")}
    env.update(
        {
            WORKER_ID_ENV: worker_id,
            "STOKER_POOL": "worker-check",
            "STOKER_FLEET": "worker-check",
            "STOKER_PORT": str(port),
            SECRET_ENV: secret,
        }
    )
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    with open(log, "wb") as out:
        try:
            process = subprocess.Popen(
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except (OSError, ValueError) as exc:
            raise CannotStart(f"cannot start {command[0]!r}: {exc}") from None
    try:
        yield process, f"http://{authority}"
    finally:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        process.wait(STOP_GRACE_S)


@dataclass(slots=True)
class _Checker:
    """Runs the rules against one started worker and collects their rows."""

    client: httpx.Client
    endpoint: str
    worker_id: str
    secret: str
    key: ActivationKey
    rows: list[Row] = field(default_factory=list)

    def row(self, rule: str, expected: str, got: str, passed: bool) -> bool:
        self.rows.append(Row(rule, expected, got, passed))
        return passed

    def body(self, org: str, epoch: int, token: str, worker_id: str | None = None) -> bytes:
        payload = {
            "worker_id": worker_id or self.worker_id,
            "org": org,
            "epoch": epoch,
            "token": token,
            "config": {"check": "worker-check"},
        }
        return json.dumps(payload, separators=(",", ":")).encode()

    def activate(
        self, body: bytes, signed: str | None = "own", traced: bool = False
    ) -> httpx.Response | str:
        """POST /activate: signed with the worker's secret (`own`), `signed` as given, or
        not at all (None); `traced`: with the trace context a tracing control plane sends
        (outside the signature). A transport error comes back as its text."""
        headers = {"Content-Type": "application/json"}
        if traced:
            headers[TRACEPARENT_HEADER] = TRACEPARENT_SAMPLE
        if signed == "own":
            headers[SIGNATURE_HEADER] = signature(self.secret, "POST", ACTIVATE_PATH, body)
        elif signed is not None:
            headers[SIGNATURE_HEADER] = signed
        try:
            return self.client.post(self.endpoint + ACTIVATE_PATH, content=body, headers=headers)
        except httpx.HTTPError as exc:
            return f"no answer ({type(exc).__name__})"

    def get(self, path: str, token: str | None = None) -> httpx.Response | str:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            return self.client.get(self.endpoint + path, headers=headers)
        except httpx.HTTPError as exc:
            return f"no answer ({type(exc).__name__})"

    def expect(
        self, rule: str, answer: httpx.Response | str, want: int | Callable[[int], bool], text: str
    ) -> bool:
        """A row: `answer`'s status must be `want` (or satisfy it)."""
        if isinstance(answer, str):
            return self.row(rule, text, answer, False)
        ok = want(answer.status_code) if callable(want) else answer.status_code == want
        got = str(answer.status_code)
        with contextlib.suppress(ValueError):
            body = answer.json()
            if isinstance(body, dict) and isinstance(body.get("code"), str):
                got += f" {body['code']}"
        return self.row(rule, text, got, ok)

    def run(self, process: subprocess.Popen[bytes], ready_timeout_s: float) -> None:
        if not self.wait_healthy(process, ready_timeout_s):
            return
        intruder = self.body("intruder-org", 100, "intruder-token")
        self.expect("activation without a signature", self.activate(intruder, None), 401, "401")
        wrong = "v1=" + "0" * 64
        self.expect("activation with a wrong signature", self.activate(intruder, wrong), 401, "401")
        foreign = signature(
            self.key.worker_secret(self.worker_id + "-other"), "POST", ACTIVATE_PATH, intruder
        )
        self.expect(
            "activation signed with another worker's secret",
            self.activate(intruder, foreign),
            401,
            "401",
        )
        self.expect(
            "activation naming another worker",
            self.activate(self.body("acme", 1, "tok-x", self.worker_id + "-other")),
            409,
            "409",
        )
        first = self.body("acme", 1, "tok-1")
        bound = self.expect(
            "signed activation (org acme, epoch 1); nothing bound before",
            self.activate(first),
            200,
            "200",
        )
        if not bound:
            return
        not_401 = lambda status: status != 401  # noqa: E731
        self.expect("request without the session token", self.get("/"), 401, "401")
        self.expect("request with a wrong session token", self.get("/", "tok-wrong"), 401, "401")
        self.expect("request with the session token", self.get("/", "tok-1"), not_401, "not 401")
        self.expect("/healthz without a token once bound", self.get(HEALTHZ_PATH), 200, "200")
        self.expect(
            "activation for a second org (newer epoch)",
            self.activate(self.body("globex", 2, "tok-g")),
            409,
            "409",
        )
        self.expect(
            "activation at the same epoch",
            self.activate(self.body("acme", 1, "tok-s")),
            409,
            "409",
        )
        self.expect(
            "activation at an older epoch",
            self.activate(self.body("acme", 0, "tok-s")),
            409,
            "409",
        )
        self.expect(
            "session token still good after the refusals",
            self.get("/", "tok-1"),
            not_401,
            "not 401",
        )
        again = self.body("acme", 3, "tok-2")
        self.expect(
            "re-activation by the same org (epoch 3, with a traceparent)",
            self.activate(again, traced=True),
            200,
            "200",
        )
        self.expect("previous session token revoked", self.get("/", "tok-1"), 401, "401")
        self.expect("new session token accepted", self.get("/", "tok-2"), not_401, "not 401")
        signed = signature(self.secret, "POST", ACTIVATE_PATH, again)
        self.expect("the last activation replayed", self.activate(again, signed), 409, "409")
        altered = self.body("acme", 4, "tok-intruder")
        self.expect(
            "its signature on another body (epoch 4)",
            self.activate(altered, signed),
            401,
            "401",
        )
        self.stop(process)

    def wait_healthy(self, process: subprocess.Popen[bytes], timeout_s: float) -> bool:
        deadline = time.perf_counter() + timeout_s
        last = "no answer"
        while time.perf_counter() < deadline:
            if process.poll() is not None:
                got = f"exited with status {process.returncode}"
                return self.row("GET /healthz answers 200 once ready", "200", got, False)
            answer = self.get(HEALTHZ_PATH)
            if not isinstance(answer, str) and answer.status_code == 200:
                return self.row("GET /healthz answers 200 once ready", "200", "200", True)
            last = answer if isinstance(answer, str) else str(answer.status_code)
            time.sleep(0.05)
        got = f"{last} after {timeout_s:g}s"
        return self.row("GET /healthz answers 200 once ready", "200", got, False)

    def stop(self, process: subprocess.Popen[bytes]) -> None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            got = f"still running after {STOP_GRACE_S:g}s"
            self.row("stops on SIGTERM", f"exit within {STOP_GRACE_S:g}s", got, False)
            return
        got = f"exited ({process.returncode})"
        self.row("stops on SIGTERM", f"exit within {STOP_GRACE_S:g}s", got, True)


def check_worker(
    argv: Sequence[str], *, host: str = "127.0.0.1", ready_timeout_s: float = 30.0
) -> Report:
    """Start `argv` as stoker would and check it against every rule of the protocol.

    Raises `CannotStart` when the command cannot be started at all.
    """
    key = ActivationKey(secrets.token_bytes(32))
    worker_id = f"w-check-{secrets.token_hex(4)}"
    secret = key.worker_secret(worker_id)
    report = Report()
    with tempfile.TemporaryDirectory(prefix="stoker-worker-check-") as tmp:
        log = Path(tmp) / "worker.log"
        with (
            started(argv, worker_id=worker_id, secret=secret, host=host, log=log) as (
                process,
                endpoint,
            ),
            httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False) as client,
        ):
            checker = _Checker(client, endpoint, worker_id, secret, key)
            checker.run(process, ready_timeout_s)
            report.rows = checker.rows
        if not report.passed:
            report.output = log.read_text(errors="replace")[-4000:]
    return report
