"""Admin and org tokens read from files and rotated without a restart.

The table is checked on its own (file forms, errors that name the line and never the
token, a bad reload keeping the tokens in force), then on a real `stoker serve`: a token
written to the file works after SIGHUP, and after a plain rewrite of the file (the
server watches it); the old one is refused from then on.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import uuid
from pathlib import Path

import httpx
import pytest

from servers import DEMO, STOKER, environment, kill_fleet, start_server, wait_until
from stoker.api.tokens import Principal, TokenTable
from stoker.config import ApiConfig
from stoker.domain.errors import ConfigError

ADMIN_A = "admin-token-aaaaaaaaaaaa"
ADMIN_B = "admin-token-bbbbbbbbbbbb"
ACME = "acme-token-cccccccccccccc"
SOON = 30.0


def test_tokens_come_from_the_config_and_both_files(tmp_path: Path) -> None:
    admins = tmp_path / "admins"
    admins.write_text(f"# rotated weekly\n\n{ADMIN_A}\n")
    orgs = tmp_path / "orgs"
    orgs.write_text(f"acme {ACME}\n")
    api = ApiConfig(
        admin_tokens=[ADMIN_B], admin_tokens_file=str(admins), org_tokens_file=str(orgs)
    )
    table = TokenTable(api)
    assert table.match(ADMIN_A.encode()) == Principal(admin=True)
    assert table.match(ADMIN_B.encode()) == Principal(admin=True)
    assert table.match(ACME.encode()) == Principal(admin=False, org="acme")
    assert table.match(b"unknown-token-dddddddddd") is None
    assert api.has_tokens and ApiConfig(org_tokens_file=str(orgs)).has_tokens


@pytest.mark.parametrize(
    ("admins", "orgs", "message"),
    [
        ("short\n", "", "admin_tokens_file ({admins}) line 1: a token must be 16 to 512"),
        ("", f"acme\n{ACME}\n", "org_tokens_file ({orgs}) line 1: expected '<org> <token>'"),
        ("", f"acme {ACME}\nglobex {ACME}\n", "org_tokens_file ({orgs}) line 2: repeats"),
        (f"{ADMIN_A}\n{ADMIN_A}\n", "", "admin_tokens_file ({admins}) line 2: repeats"),
        (
            f"{ADMIN_A}\n",
            f"acme {ADMIN_A}\n",
            "org_tokens_file ({orgs}) line 1: a token is both an admin and an org token",
        ),
        (None, "", "admin_tokens_file: cannot read"),
    ],
)
def test_a_bad_token_file_is_a_config_error_that_names_no_token(
    tmp_path: Path, admins: str | None, orgs: str, message: str
) -> None:
    admin_file, org_file = tmp_path / "admins", tmp_path / "orgs"
    if admins is not None:
        admin_file.write_text(admins)
    org_file.write_text(orgs)
    api = ApiConfig(admin_tokens_file=str(admin_file), org_tokens_file=str(org_file))
    with pytest.raises(ConfigError) as caught:
        TokenTable(api)
    assert message.format(admins=admin_file, orgs=org_file) in str(caught.value)
    for token in (ADMIN_A, ACME):
        assert token not in str(caught.value)


def test_a_bad_reload_keeps_the_tokens_in_force(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    admins = tmp_path / "admins"
    admins.write_text(f"{ADMIN_A}\n")
    table = TokenTable(ApiConfig(admin_tokens_file=str(admins)))
    assert not table.reload_if_changed()  # nothing changed
    admins.write_text(f"{ADMIN_B}\nshort\n")
    with caplog.at_level(logging.INFO, logger="stoker.api"):
        assert table.reload_if_changed() is False
    assert table.match(ADMIN_A.encode()) is not None
    assert table.match(ADMIN_B.encode()) is None
    assert "event=tokens_reload_failed" in caplog.text and ADMIN_B not in caplog.text
    admins.write_text(f"{ADMIN_B}\n")
    assert table.reload_if_changed()
    assert table.match(ADMIN_A.encode()) is None
    assert table.match(ADMIN_B.encode()) is not None


def config(fleet: str, admins: Path, orgs: Path) -> str:
    pool = {"name": "demo", "command": DEMO, "warm_target": 1}
    api = {"port": 0, "admin_tokens_file": str(admins), "org_tokens_file": str(orgs)}
    return (
        f"store: sqlite:///./stoker.db\nfleet: {fleet}\napi: {json.dumps(api)}\n"
        f"intervals: {{shutdown_grace_s: 5}}\npools: [{json.dumps(pool)}]\n"
    )


def pools_status(url: str, token: str) -> int:
    answer = httpx.get(url + "/v1/pools", headers={"Authorization": f"Bearer {token}"}, timeout=5)
    return answer.status_code


@pytest.mark.processes
def test_tokens_rotate_on_sighup_and_on_a_file_change(tmp_path: Path) -> None:
    admins, orgs = tmp_path / "admins", tmp_path / "orgs"
    admins.write_text(f"{ADMIN_A}\n")
    orgs.write_text(f"acme {ACME}\n")
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    srv = start_server(tmp_path / "srv", config=config(fleet, admins, orgs))
    try:
        assert pools_status(srv.url, ADMIN_A) == 200
        assert pools_status(srv.url, ACME) == 200
        assert pools_status(srv.url, ADMIN_B) == 401

        # Rotation by SIGHUP: written in place, same size, same times, so that only the
        # signal can tell.
        before = admins.stat()
        admins.write_text(f"{ADMIN_B}\n")
        os.utime(admins, ns=(before.st_atime_ns, before.st_mtime_ns))
        srv.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: pools_status(srv.url, ADMIN_B) == 200, SOON)
        assert pools_status(srv.url, ADMIN_A) == 401
        assert srv.proc.poll() is None  # SIGHUP does not stop the server

        # Rotation by the file watch: replaced the way a Kubernetes Secret is (rename).
        fresh = tmp_path / "orgs.new"
        fresh.write_text(f"globex {ACME}\n")
        fresh.replace(orgs)
        claim = {"pool": "demo", "org": "globex"}

        def globex_token() -> bool:
            answer = httpx.post(
                srv.url + "/v1/claims",
                json={**claim, "timeout_s": 0},
                headers={"Authorization": f"Bearer {ACME}"},
                timeout=SOON,
            )
            return answer.status_code != 403

        assert wait_until(globex_token, SOON)
        assert "event=tokens_reloaded admin=1 org=1" in srv.log()
        for token in (ADMIN_A, ADMIN_B, ACME):
            assert token not in srv.log()
    finally:
        srv.stop()
        kill_fleet(fleet)


def test_serve_refuses_a_missing_token_file(tmp_path: Path) -> None:
    (tmp_path / "stoker.yaml").write_text(
        config("test-x", tmp_path / "missing", tmp_path / "missing-too")
    )
    result = subprocess.run(
        [STOKER, "serve", "-c", "stoker.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env=environment(),
        check=False,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"config error: api.admin_tokens_file: cannot read '{tmp_path / 'missing'}': "
        "No such file or directory (from stoker.yaml)"
    ]
