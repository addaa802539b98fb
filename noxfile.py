"""Every extra on its own: the wheel and sdist built and checked, then installed into a fresh
virtual environment per extra, each running the commands that extra is for.

    nox                      # dist, then base, postgres, kubernetes, sim, tracing
    nox -s "extra(extra='sim')"   # one of them (builds the dist first)
    make test-extras         # the same, from the project's virtualenv

The test suite runs with every extra installed, so it cannot see a module that only a
missing extra brings; these sessions can. Each environment is new, and uv installs the
wheel with its dependencies (from its cache when warm): nothing of the lock is reused.
(uv resolves the wheel's metadata as pip does, in a second instead of half a minute per
environment; `make test-extras NOX_ARGS="--default-venv-backend venv"` uses pip.)
PostgreSQL's session needs a server (`STOKER_TEST_POSTGRES_URL`, by default
postgresql://postgres@127.0.0.1:5432/test).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
DIST = ROOT / ".nox" / "dist"
EXTRAS = ["base", "postgres", "kubernetes", "sim", "tracing"]
POSTGRES_URL = os.environ.get(
    "STOKER_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
#: What `import stoker` (the SDK) must never load: the server's and the extras' libraries.
SERVER_LIBRARIES = [
    "fastapi",
    "uvicorn",
    "sqlite3",
    "psycopg",
    "lightkube",
    "matplotlib",
    "opentelemetry",
    "stoker.api",
    "stoker.control",
    "stoker.adapters",
]
#: A demo pool whose workers carry a label of their own, so that none outlives a session.
DEMO_POOL = (
    'pools:\n  - {name: demo, warm_target: 1, command: ["{python}", "-m", "stoker.demo_worker",'
    ' "--port", "{port}", "--worker-id", "{worker_id}"]}\n'
)

nox.options.sessions = ["dist", "extra"]
nox.options.default_venv_backend = "uv"
nox.options.error_on_missing_interpreters = True


@nox.session(venv_backend="none")
def dist(session: nox.Session) -> None:
    """Build the sdist and, from it, the wheel (with the locked backend), and check both."""
    shutil.rmtree(DIST, ignore_errors=True)
    session.run(sys.executable, "-m", "build", "--no-isolation", "--outdir", str(DIST), str(ROOT))
    built = sorted(str(p) for p in DIST.iterdir())
    session.run(sys.executable, "-m", "twine", "check", "--strict", *built)


def _wheel() -> Path:
    wheels = sorted(DIST.glob("stoker-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel in {DIST} (run the dist session): {wheels}")
    return wheels[0]


@nox.session(requires=["dist"])
@nox.parametrize("extra", EXTRAS)
def extra(session: nox.Session, extra: str) -> None:
    """Install the wheel with `extra` into a fresh environment and run what it is for."""
    wheel = _wheel()
    session.install(str(wheel) if extra == "base" else f"stoker[{extra}] @ {wheel.as_uri()}")
    session.chdir(session.create_tmp())
    _import_contract(session)
    version = session.run("stoker", "--version", silent=True)
    session.log(f"installed: {str(version).strip()}")
    {
        "base": _base,
        "postgres": _postgres,
        "kubernetes": _kubernetes,
        "sim": _sim,
        "tracing": _tracing,
    }[extra](session)


def _import_contract(session: nox.Session) -> None:
    """`import stoker` and its SDK load no server library."""
    check = (
        "import sys, stoker; stoker.Client; "
        f"loaded = sorted(m for m in {SERVER_LIBRARIES!r} if m in sys.modules); "
        "assert not loaded, f'import stoker loaded {loaded}'"
    )
    session.run("python", "-c", check)


# -- what each extra is for ------------------------------------------------------------------


def _base(session: nox.Session) -> None:
    """`stoker serve` on the embedded defaults and a claim; the extras it lacks are each
    one line naming the extra, never a traceback."""
    with _serving(session, DEMO_POOL) as url:
        _claim_and_release(session, url)
    _refused(session, ["scaletest", "cold-ramp", "--short", "--out", "r"], "sim")
    Path("k8s.yaml").write_text(_KUBERNETES_CONFIG)
    _refused(session, ["config", "check", "--config", "k8s.yaml"], "kubernetes")
    Path("pg.yaml").write_text(f"store: {POSTGRES_URL}\n" + _ACTIVATION)
    _refused(session, ["config", "check", "--config", "pg.yaml"], "postgres")
    Path("tracing.yaml").write_text("tracing: {enabled: true}\n")
    _refused(session, ["config", "check", "--config", "tracing.yaml"], "tracing")


_ACTIVATION = "activation: {key_file: ./activation.key}\n"


def _postgres(session: nox.Session) -> None:
    """The PostgreSQL quick start: `stoker serve -c examples/replicas.yaml` on the server,
    a claim, and the schema dropped afterwards."""
    schema = f"nox_{uuid.uuid4().hex[:8]}"
    env = {
        "STOKER_STORE": POSTGRES_URL,
        "STOKER_STORE_OPTIONS__SCHEMA": schema,
        "STOKER_API__PORT": "0",
    }
    try:
        with _serving(session, None, config=ROOT / "examples" / "replicas.yaml", env=env) as url:
            _claim_and_release(session, url)
    finally:
        drop = (
            "import sys, psycopg; "
            "c = psycopg.connect(sys.argv[1], autocommit=True); "
            "c.execute(f'DROP SCHEMA IF EXISTS \"{sys.argv[2]}\" CASCADE')"
        )
        session.run("python", "-c", drop, POSTGRES_URL, schema, silent=True)


_KUBERNETES_CONFIG = (
    "runtime: {kind: kubernetes, namespace: stoker}\n"
    "pools:\n  - {name: db, pod: {image: 'ghcr.io/example/worker:1', cpu: 500m, memory: 256Mi}}\n"
)


def _kubernetes(session: nox.Session) -> None:
    """A Kubernetes config checked as `serve` would check it (no cluster needed)."""
    Path("k8s.yaml").write_text(_KUBERNETES_CONFIG)
    config = json.loads(_stdout(session, ["config", "check", "--config", "k8s.yaml", "--json"]))
    if config["runtime"]["kind"] != "kubernetes":
        session.error(f"config check did not keep the runtime: {config['runtime']}")


def _sim(session: nox.Session) -> None:
    """`stoker scaletest cold-ramp --short --out r`, with its report and plots."""
    session.run("stoker", "scaletest", "cold-ramp", "--short", "--out", "r", "--no-progress")
    for name in ("summary.json", "report.md"):
        if not (Path("r") / name).is_file():
            session.error(f"scaletest wrote no r/{name}")
    if not list(Path("r").glob("*.png")):
        session.error("scaletest drew no plot")


def _tracing(session: nox.Session) -> None:
    """A traced claim: the spans reach an OTLP/HTTP collector (a small one, here)."""
    with _collector() as (endpoint, received):
        config = f"tracing: {{enabled: true, endpoint: {endpoint}}}\n" + DEMO_POOL
        with _serving(session, config) as url:
            _claim_and_release(session, url)
        # The server exports what is left of its spans as it stops.
    if not received:
        session.error("no span reached the collector")
    session.log(f"the collector received {len(received)} export(s) of spans")


# -- helpers --------------------------------------------------------------------------------


def _claim_and_release(session: nox.Session, url: str) -> None:
    claim = json.loads(_stdout(session, ["--url", url, "claim", "--pool", "demo", "--org", "acme"]))
    if claim["state"] != "bound":
        session.error(f"the claim is not bound: {claim}")
    session.run("stoker", "release", claim["id"], "--url", url, silent=True)


def _stdout(session: nox.Session, args: list[str]) -> str:
    """What `stoker ARGS` prints on stdout; it must succeed, and say nothing on stderr."""
    session.log(f"stoker {' '.join(args)}")
    result = subprocess.run(
        [str(Path(str(session.bin)) / "stoker"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    if result.returncode != 0 or result.stderr:
        session.error(f"stoker {' '.join(args)}: {result.returncode} {result.stderr.strip()}")
    return result.stdout


def _refused(session: nox.Session, args: list[str], extra: str) -> None:
    """`stoker ARGS` without `extra`: exit 1, and lines naming the extra, no traceback."""
    result = subprocess.run(
        [str(Path(str(session.bin)) / "stoker"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    said = result.stderr.strip()
    wanted = f"pip install 'stoker[{extra}]'"
    if result.returncode != 1 or "Traceback" in said or wanted not in said:
        session.error(f"stoker {' '.join(args)} without [{extra}]: {result.returncode} {said}")
    session.log(f"without [{extra}]: {said}")


@contextlib.contextmanager
def _serving(
    session: nox.Session,
    config_text: str | None,
    *,
    config: Path | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[str]:
    """`stoker serve --stop-workers` on a free port until the block ends (SIGTERM)."""
    if config is None:
        config = Path("stoker.yaml")
        config.write_text(
            "store: sqlite:///./stoker.db\napi: {port: 0}\n"
            "intervals: {shutdown_grace_s: 5}\n" + (config_text or "")
        )
    fleet = f"nox-{uuid.uuid4().hex[:8]}"
    environ = {**os.environ, **(env or {}), "STOKER_FLEET": fleet}
    stoker = str(Path(str(session.bin)) / "stoker")
    proc = subprocess.Popen(
        [stoker, "serve", "--config", str(config), "--stop-workers"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=environ,
        start_new_session=True,
    )
    lines: list[str] = []
    try:
        url = _listening(proc, lines)
        if url is None:
            session.error("stoker serve did not start:\n" + "".join(lines))
        _wait_warm(session, url)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        rest = proc.stdout.read() if proc.stdout else ""
        if "Traceback" in "".join(lines) + rest:
            session.error("stoker serve printed a traceback:\n" + "".join(lines) + rest)
        session.log(f"stoker serve exited {proc.returncode}")


def _listening(proc: subprocess.Popen[str], lines: list[str]) -> str | None:
    """The URL of the server's `listening on URL` line, read until it comes or it exits."""
    assert proc.stdout is not None
    found: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            match = re.search(r"listening on (http://\S+)", line)
            if match:
                found.append(match.group(1))
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(90)
    return found[0] if found else None


def _wait_warm(session: nox.Session, url: str) -> None:
    """Until the demo pool holds a warm worker (a claim then takes one, not a cold start)."""
    wait = (
        "import sys, time, stoker\n"
        "with stoker.Client(sys.argv[1]) as c:\n"
        "    for _ in range(600):\n"
        "        if any(p.counts.get('warm', 0) for p in c.pools()): break\n"
        "        time.sleep(0.1)\n"
        "    else: sys.exit('no warm worker within 60 s')\n"
    )
    session.run("python", "-c", wait, url, silent=True)


@contextlib.contextmanager
def _collector() -> Iterator[tuple[str, list[bytes]]]:
    """An OTLP/HTTP collector on a free port that keeps the bodies POSTed to /v1/traces."""
    received: list[bytes] = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path == "/v1/traces" and body:
                received.append(body)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            return

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()
