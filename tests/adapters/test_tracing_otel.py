"""OpenTelemetry tracing of claims (the `tracing` extra), and a server without it.

The claim test runs the whole path a user's claim takes: the real app over ASGI, the real
SQLite store, real demo-worker processes activated over HTTP by the signing activator; the
spans go to the SDK's in-memory exporter instead of a collector. Real time: it waits on
processes, each wait bounded.
"""

from __future__ import annotations

import http.server
import json
import logging
import secrets
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from servers import DEMO, STOKER, environment, kill_fleet, start_server
from stoker.adapters.tracing_otel import OtelTracer, otlp_tracer, traces_url
from stoker.api import create_app
from stoker.bootstrap import build_control_plane, build_tracer, check_extras
from stoker.config import StokerConfig
from stoker.domain.errors import ConfigError
from stoker.ports.tracer import NO_TRACER


def memory_tracer() -> tuple[OtelTracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return OtelTracer(provider), exporter


def config(tmp_path: Path, fleet: str, **more: Any) -> StokerConfig:
    return StokerConfig.model_validate(
        {
            "store": f"sqlite:///{tmp_path}/stoker.db",
            "fleet": fleet,
            "pools": [{"name": "demo", "warm_target": 1, "command": DEMO}],
            **more,
        }
    )


@asynccontextmanager
async def traced_server(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    """The app on a started plane with local demo workers, tracing into memory."""
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    tracer, exporter = memory_tracer()
    plane = build_control_plane(config(tmp_path, fleet), tracer=tracer)
    app = create_app(plane, manage_plane=False)
    await plane.start(loops=False)
    transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 40000))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://stoker") as http:
            yield http, exporter
    finally:
        await plane.stop(stop_workers=True)
        kill_fleet(fleet)


def named(spans: Sequence[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


@pytest.mark.processes
async def test_a_claim_is_one_trace_that_reaches_the_worker(tmp_path: Path) -> None:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    async with traced_server(tmp_path) as (http, exporter), httpx.AsyncClient() as direct:
        # The client's own trace: the claim continues it.
        sent = await http.post(
            "/v1/claims",
            json={"pool": "demo", "org": "acme", "mode": "cold", "config": {"k": 1}},
            headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
        )
        assert sent.status_code == 201, sent.text
        claim = sent.json()
        held = await direct.get(
            claim["worker"]["endpoint"] + "/",
            headers={"Authorization": f"Bearer {claim['worker']['token']}"},
        )
        spans = exporter.get_finished_spans()
    [root] = named(spans, "stoker.claim")
    assert f"{root.context.trace_id:032x}" == trace_id
    assert root.parent is not None and f"{root.parent.span_id:016x}" == parent_id
    assert root.attributes is not None
    assert root.attributes["stoker.claim.id"] == claim["id"]
    assert root.attributes["org"] == "acme" and root.attributes["stoker.claim.source"] == "cold"
    steps = [s for s in spans if s.name in ("stoker.reserve", "stoker.activate", "stoker.bind")]
    assert {s.name for s in steps} == {"stoker.reserve", "stoker.activate", "stoker.bind"}
    for step in steps:
        assert step.parent is not None and step.parent.span_id == root.context.span_id
        assert step.context.trace_id == root.context.trace_id
    [activate] = named(spans, "stoker.activate")
    [bind] = named(spans, "stoker.bind")
    assert activate.end_time is not None and bind.start_time is not None
    assert activate.end_time <= bind.start_time
    # The worker got the activation span's context (the signature still held: it is bound).
    assert held.status_code == 200, held.text
    assert held.json()["org"] == "acme"
    assert held.json()["traceparent"] == f"00-{trace_id}-{activate.context.span_id:016x}-01"


@pytest.mark.processes
async def test_a_failed_claim_is_a_failed_span(tmp_path: Path) -> None:
    async with traced_server(tmp_path) as (http, exporter):
        assert (await http.post("/v1/claims", json={"pool": "nope", "org": "a"})).status_code == 404
        [root] = named(exporter.get_finished_spans(), "stoker.claim")
    assert root.status.status_code is StatusCode.ERROR
    assert root.parent is None


# -- configuration and the extra --------------------------------------------------------------


def test_tracing_is_off_unless_asked_for(tmp_path: Path) -> None:
    plain = config(tmp_path, "f")
    assert build_tracer(plain, environ={}) is NO_TRACER
    assert plain.tracing.mode({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) == "implied"
    disabled = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}
    assert plain.tracing.mode(disabled) == "off"
    off = config(tmp_path, "f", tracing={"enabled": False})
    assert off.tracing.mode({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) == "off"


def test_the_config_names_the_collector_the_service_and_the_ratio(tmp_path: Path) -> None:
    cfg = config(
        tmp_path,
        "f",
        tracing={
            "enabled": True,
            "endpoint": "http://collector:4318",
            "service_name": "stoker-eu",
            "sample_ratio": 0.25,
        },
    )
    tracer = build_tracer(cfg, environ={})
    assert isinstance(tracer, OtelTracer)
    try:
        assert tracer.provider.resource.attributes["service.name"] == "stoker-eu"
        assert "0.25" in tracer.provider.sampler.get_description()
    finally:
        tracer.close()
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://c:4318/custom/path") == "http://c:4318/custom/path"


def test_the_service_name_comes_from_the_environment_else_stoker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    for environ in ({}, {"OTEL_SERVICE_NAME": "from-env"}):
        for key, value in environ.items():
            monkeypatch.setenv(key, value)
        tracer = otlp_tracer(environ=environ)
        try:
            expected = environ.get("OTEL_SERVICE_NAME", "stoker")
            assert tracer.provider.resource.attributes["service.name"] == expected
        finally:
            tracer.close()


@pytest.mark.parametrize("value", [{"sample_ratio": 2}, {"endpoint": "collector:4318"}])
def test_bad_tracing_settings_are_config_errors(tmp_path: Path, value: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="tracing"):
        config(tmp_path, "f", tracing=value)


def test_tracing_enabled_without_the_extra_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    cfg = config(tmp_path, "f", tracing={"enabled": True})
    message = (
        "config error: tracing.enabled: tracing needs the 'tracing' extra: "
        "pip install 'stoker[tracing]'"
    )
    with pytest.raises(ConfigError) as checked:
        check_extras(cfg)
    assert str(checked.value) == message
    with pytest.raises(ConfigError) as built:
        build_tracer(cfg, environ={})
    assert str(built.value) == message


def test_an_endpoint_in_the_environment_without_the_extra_only_warns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    caplog.set_level(logging.WARNING, logger="stoker")
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}
    assert build_tracer(config(tmp_path, "f"), environ=environ) is NO_TRACER
    assert "event=tracing_off" in caplog.text and "stoker[tracing]" in caplog.text


#: Makes OpenTelemetry's SDK and exporter unimportable in a `stoker` process (as in a base
#: install, where only the API comes, with FastAPI).
WITHOUT_SDK = (
    "import sys\n"
    "sys.modules.update(dict.fromkeys(['opentelemetry.sdk', 'opentelemetry.sdk.trace',\n"
    "    'opentelemetry.exporter', 'opentelemetry.exporter.otlp.proto.http']))\n"
)


def without_sdk(tmp_path: Path, **extra: str) -> dict[str, str]:
    """An environment whose Python processes cannot import the `tracing` extra."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(WITHOUT_SDK)
    return environment(PYTHONPATH=str(site), **extra)


@pytest.mark.processes
def test_serve_with_tracing_enabled_without_the_extra_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "stoker.yaml").write_text("api: {port: 0}\ntracing: {enabled: true}\n")
    result = subprocess.run(
        [STOKER, "serve", "-c", "stoker.yaml"],
        cwd=tmp_path,
        env=without_sdk(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [
        "config error: tracing.enabled: tracing needs the 'tracing' extra: "
        "pip install 'stoker[tracing]' (from stoker.yaml)"
    ]


@pytest.mark.processes
def test_a_server_without_the_extra_serves_claims(tmp_path: Path) -> None:
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    env = without_sdk(tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9/")
    srv = start_server(
        tmp_path / "srv",
        config=f"fleet: {fleet}\napi: {{port: 0}}\npools: [{{name: demo, command: {DEMO!r}}}]\n",
        args=["--stop-workers"],
        env=env,
    )
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            claim = http.post("/v1/claims", json={"pool": "demo", "org": "acme"})
            assert claim.status_code == 201, claim.text
            worker = claim.json()["worker"]
            held = httpx.get(
                worker["endpoint"] + "/", headers={"Authorization": f"Bearer {worker['token']}"}
            )
            assert held.status_code == 200 and "traceparent" not in held.json()
    finally:
        assert srv.stop() == 0
        kill_fleet(fleet)
    assert "event=tracing_off" in srv.log() and "stoker[tracing]" in srv.log()


class _Collector(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP collector that keeps what it is sent."""

    received: ClassVar[list[tuple[str, str, bytes]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        self.received.append((self.path, self.headers.get("content-type", ""), body))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


@pytest.mark.processes
def test_serve_exports_its_claims_to_the_configured_collector(tmp_path: Path) -> None:
    collector = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}"
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    srv = start_server(
        tmp_path,
        config=(
            f"fleet: {fleet}\napi: {{port: 0}}\npools: [{{name: demo, command: {DEMO!r}}}]\n"
            f"tracing: {{enabled: true, endpoint: '{endpoint}', service_name: stoker-test}}\n"
        ),
        args=["--stop-workers"],
    )
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as http_client:
            claim = http_client.post("/v1/claims", json={"pool": "demo", "org": "acme"})
            assert claim.status_code == 201, claim.text
    finally:
        # Stopping flushes the spans still buffered.
        assert srv.stop() == 0
        kill_fleet(fleet)
        collector.shutdown()
        collector.server_close()
    sent = [body for path, kind, body in _Collector.received if path == "/v1/traces"]
    assert sent, _Collector.received
    assert all(kind == "application/x-protobuf" for _, kind, _ in _Collector.received)
    exported = b"".join(sent)
    for name in (b"stoker.claim", b"stoker.reserve", b"stoker.activate", b"stoker.bind"):
        assert name in exported
    assert b"stoker-test" in exported


@pytest.mark.processes
def test_config_check_names_the_missing_extra_and_masks_the_collector_s_password(
    tmp_path: Path,
) -> None:
    (tmp_path / "stoker.yaml").write_text(
        "tracing: {enabled: true, endpoint: 'https://otel:s3cret-pass@collector:4318'}\n"
    )

    def check(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [STOKER, "config", "check", "-c", "stoker.yaml", "--json"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
            check=False,
        )

    missing = check(without_sdk(tmp_path))
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines() == [
        "config error: tracing.enabled: tracing needs the 'tracing' extra: "
        "pip install 'stoker[tracing]' (from stoker.yaml)"
    ]
    shown = check(environment())
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["tracing"]["endpoint"] == "https://otel:***@collector:4318"
    assert "s3cret-pass" not in shown.stdout
