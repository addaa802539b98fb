"""The several-replicas example of deploy/replicas/: the config loads as every replica reads
it, and the systemd unit and the HAProxy config agree with it.

HAProxy and systemd cannot run here; what these tests check is what would break quietly in
production: a key stoker rejects, a stop timeout shorter than the shutdown grace (systemd
would SIGKILL a replica mid-drain), a proxy timeout shorter than a claim's wait, a unit that
stops the workers with their replica, a backend that misses a replica.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stoker.config import load_config

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "replicas"
PORTS = (8081, 8082, 8083)


def _env_file() -> dict[str, str]:
    lines = (DEPLOY / "stoker.env.example").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def _unit() -> dict[str, str]:
    lines = (DEPLOY / "stoker@.service").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))


def _seconds(text: str) -> float:
    match = re.fullmatch(r"(\d+)(ms|s|m)?", text.strip())
    assert match is not None, text
    return int(match[1]) * {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}[match[2]]


@pytest.mark.parametrize("port", PORTS)
def test_every_replica_loads_the_config_with_its_environment(port: int) -> None:
    env = {**_env_file(), "STOKER_API__PORT": str(port)}
    loaded = load_config(DEPLOY / "stoker.yaml", environ=env)
    config = loaded.config
    assert config.api.port == port and config.api.host == "127.0.0.1"
    assert config.store == env["STOKER_STORE"] and config.store.startswith("postgresql://")
    assert config.leader_election.kind == "store"
    # Behind a proxy on the same host every request comes from loopback: tokens are a must.
    assert config.api.admin_tokens
    assert "STOKER_API__ADMIN_TOKENS" in loaded.overrides


def test_the_unit_runs_one_replica_per_port_and_leaves_its_workers_running() -> None:
    unit = _unit()
    config = load_config(DEPLOY / "stoker.yaml", environ=_env_file()).config
    assert unit["Environment"] == "STOKER_API__PORT=%i"
    assert unit["ExecStart"].endswith("stoker serve -c /etc/stoker/stoker.yaml")
    assert unit["EnvironmentFile"] == "/etc/stoker/stoker.env"
    # Workers outlive their replica and are adopted; killing the cgroup would kill them.
    assert unit["KillMode"] == "process"
    assert _seconds(unit["TimeoutStopSec"]) > config.intervals.shutdown_grace_s
    assert config.runtime.kind == "local"
    assert f"/var/log/{unit['LogsDirectory']}" == config.runtime.log_dir


def test_haproxy_balances_over_every_replica_and_outwaits_a_claim() -> None:
    text = (DEPLOY / "haproxy.cfg").read_text()
    servers = re.findall(r"^\s*server \S+ 127\.0\.0\.1:(\d+)", text, re.MULTILINE)
    assert tuple(int(p) for p in servers) == PORTS
    assert re.search(r"option httpchk GET /readyz", text)
    config = load_config(DEPLOY / "stoker.yaml", environ=_env_file()).config
    longest_wait = max(p.claim_timeout_s for p in config.pools)
    (server_timeout,) = re.findall(r"timeout server (\S+)", text)
    assert _seconds(server_timeout) > longest_wait
