"""The dashboard and the API docs in a real headless Chromium, against a real `stoker serve`.

Debian's `chromium` and `chromium-driver`, driven by selenium (`.ci/run` installs them).
The browser resolves no host name but the server's, so a page that needed the network
would not render; each test also checks that every request the page made went to the
server. Without the browser the tests skip, except under CI=true, where they fail.
A screenshot of the dashboard is kept in the test's tmp dir and, when
$STOKER_TEST_ARTIFACTS is set, in that folder.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import (
    NoSuchElementException,
    StaleElementReferenceException,
    TimeoutException,
)
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from servers import DEMO, Server, kill_fleet, start_server, wait_until
from stoker.adapters._ledger import LEDGER_COLUMNS, ledger_rows
from stoker.domain.ledger import HOUR_S, LedgerCounts, LedgerKey, hour_of

pytestmark = pytest.mark.processes

ADMIN = "dashboard-admin-token-0123456789"
HEADERS = {"Authorization": f"Bearer {ADMIN}"}
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
#: Bound for each wait on the page (a condition, polled; never a fixed sleep).
WAIT_S = 30.0


def _browser_missing() -> str | None:
    for path in (CHROMIUM, CHROMEDRIVER):
        if not Path(path).exists():
            return f"{path} is not installed (apt-get install chromium chromium-driver)"
    return None


def ui_config(fleet: str, *, warm_target: int) -> str:
    """A config of one demo pool on SQLite, the admin token, and short intervals."""
    pool = {"name": "demo", "command": DEMO, "warm_target": warm_target}
    return (
        f"store: sqlite:///./stoker.db\nfleet: {fleet}\n"
        f"api: {{port: 0, admin_tokens: [{ADMIN}]}}\n"
        "intervals: {janitor_interval_s: 0.2, reaper_interval_s: 1, pool_sample_s: 1, "
        "shutdown_grace_s: 5}\n"
        f"pools:\n  - {json.dumps(pool)}\n"
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    config = ui_config(fleet, warm_target=2)
    srv = start_server(tmp_path_factory.mktemp("ui"), config=config, args=["--stop-workers"])
    try:
        yield srv
    finally:
        srv.stop()
        kill_fleet(fleet)


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    missing = _browser_missing()
    if missing is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the browser tests must run in CI: {missing}")
        pytest.skip(missing)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
        # No name resolves but loopback's: a page that needs the network cannot load it.
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver: WebDriver, what: str, condition: Any) -> Any:
    """Poll `condition(driver)` until it is truthy (bounded by WAIT_S). The dashboard
    redraws its tables as fresh answers come: an element the condition found may be
    replaced before it reads it (stale), and the next poll reads the new one."""
    try:
        return WebDriverWait(
            driver,
            WAIT_S,
            poll_frequency=0.1,
            ignored_exceptions=(NoSuchElementException, StaleElementReferenceException),
        ).until(condition)
    except TimeoutException:
        status = driver.find_elements(By.ID, "status")
        shown = status[0].text if status else driver.page_source[:2000]
        raise AssertionError(f"waited {WAIT_S}s for {what}; the page shows: {shown}") from None


def requested(driver: WebDriver, *, images: bool = True) -> list[str]:
    """Every URL the page loaded or fetched (`images`: also the images it tried)."""
    names = driver.execute_script(
        "return [location.href].concat(performance.getEntriesByType('resource')"
        ".filter(e => arguments[0] || e.initiatorType !== 'img').map(e => e.name))",
        images,
    )
    assert isinstance(names, list)
    return [str(n) for n in names]


def cells(driver: WebDriver, selector: str) -> list[str]:
    """The texts of the cells under `selector`, read in one step in the page (a redraw
    cannot replace them halfway)."""
    texts = driver.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0]), td => td.innerText.trim())",
        selector + " td",
    )
    assert isinstance(texts, list)
    return [str(t) for t in texts]


def keep_screenshot(driver: WebDriver, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    assert driver.save_screenshot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    artifacts = os.environ.get("STOKER_TEST_ARTIFACTS")
    if artifacts:
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(artifacts) / name)
    return path


def test_dashboard_asks_for_the_token_then_shows_pools_and_follows_a_claim(
    server: Server, browser: WebDriver, tmp_path: Path
) -> None:
    browser.get(server.url + "/ui")
    # The server has tokens: the page's first calls answer 401 and it asks for one.
    wait_for(
        browser, "the token prompt", lambda d: "admin token" in d.find_element(By.ID, "status").text
    )
    browser.find_element(By.ID, "token").send_keys(ADMIN)
    browser.find_element(By.CSS_SELECTOR, "#token-form button[type=submit]").click()
    wait_for(
        browser, "the demo pool", lambda d: d.find_elements(By.CSS_SELECTOR, "tr[data-pool=demo]")
    )
    wait_for(
        browser,
        "two warm workers",
        lambda d: len(d.find_elements(By.CSS_SELECTOR, "#workers tr[data-state=warm]")) == 2,
    )
    row = cells(browser, "#pools tr[data-pool=demo]")
    assert row[:3] == ["demo", row[1], "2"], row  # name, revision, warm target
    assert browser.execute_script("return sessionStorage.getItem('stoker.token')") == ADMIN
    assert browser.find_elements(By.CSS_SELECTOR, "#events tr[data-kind=spawned]")

    headers = {"Authorization": f"Bearer {ADMIN}"}
    claim = httpx.post(
        server.url + "/v1/claims", json={"pool": "demo", "org": "acme"}, headers=headers, timeout=30
    ).json()
    try:
        wait_for(
            browser,
            "the claim in the open claims",
            lambda d: d.find_elements(By.CSS_SELECTOR, f"#claims tr[data-claim='{claim['id']}']"),
        )
        worker = claim["worker"]["id"]
        wait_for(
            browser,
            "the claimed worker hot for acme",
            lambda d: cells(d, f"#workers tr[data-worker='{worker}']")[2:4] == ["hot", "acme"],
        )
        # pool, revision, target, desired, demand, cap, spawning, warm, reserved, activating, hot
        wait_for(
            browser,
            "one hot worker in the pool row",
            lambda d: cells(d, "#pools tr[data-pool=demo]")[10] == "1",
        )
        claim_row = cells(browser, f"#claims tr[data-claim='{claim['id']}']")
        assert claim_row[1:5] == ["demo", "acme", worker, "warm"], claim_row
        # The chart has the server's samples and the live point.
        wait_for(
            browser,
            "the chart's points",
            lambda d: int(d.find_element(By.ID, "chart").get_attribute("data-points") or 0) >= 2,
        )
        shot = keep_screenshot(browser, tmp_path, "dashboard.png")
        assert shot.stat().st_size > 10_000
    finally:
        httpx.delete(f"{server.url}/v1/claims/{claim['id']}", headers=headers, timeout=30)
    wait_for(
        browser,
        "the released claim gone from the open claims",
        lambda d: not d.find_elements(By.CSS_SELECTOR, f"#claims tr[data-claim='{claim['id']}']"),
    )
    assert all(url.startswith(server.url) for url in requested(browser)), requested(browser)


def test_dashboard_shows_what_the_pools_warmth_cost(
    server: Server, browser: WebDriver, tmp_path: Path
) -> None:
    browser.get(server.url + "/ui")
    browser.find_element(By.ID, "token").send_keys(ADMIN)
    browser.find_element(By.CSS_SELECTOR, "#token-form button[type=submit]").click()
    # The warm workers' hours reach the store with each replica's pass, the page reads them.
    wait_for(
        browser,
        "an hour of the ledger with warm worker time",
        lambda d: (
            len(rows := d.find_elements(By.CSS_SELECTOR, "#ledger tbody tr")) >= 2
            and float(rows[0].find_elements(By.TAG_NAME, "td")[1].text) > 0
        ),
    )
    total = cells(browser, "#ledger tbody tr:last-child")
    assert total[0] == "total" and float(total[1]) > 0, total
    bars = browser.find_element(By.ID, "ledger-chart").get_attribute("data-bars")
    assert int(bars or 0) >= 1
    keep_screenshot(browser, tmp_path, "dashboard-ledger.png")
    assert all(url.startswith(server.url) for url in requested(browser)), requested(browser)


def test_the_ledger_chart_gives_each_hour_of_the_window_its_own_bar(
    browser: WebDriver, tmp_path: Path
) -> None:
    """The last 24 hours touch 25 hours of the ledger (the first and the last in part):
    each is drawn as a bar of its own, none on top of another."""
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    workdir = tmp_path / "hours"
    server = start_server(workdir, config=ui_config(fleet, warm_target=0), args=["--stop-workers"])
    try:
        answer = httpx.get(
            f"{server.url}/v1/pools/demo/ledger", params={"since": "24h"}, headers=HEADERS
        ).json()
        revision = httpx.get(f"{server.url}/v1/pools/demo", headers=HEADERS).json()["revision"]
        now = answer["until"]
        cells = {
            LedgerKey("demo", revision, "", hour_of(now - n * HOUR_S)): LedgerCounts(warm_s=1800.0)
            for n in range(25)
        }
        with sqlite3.connect(workdir / "stoker.db") as db:
            marks = ", ".join("?" * len(LEDGER_COLUMNS))
            db.executemany(
                f"INSERT INTO ledger ({', '.join(LEDGER_COLUMNS)}) VALUES ({marks})",
                ledger_rows("cp-elsewhere", cells, now),
            )
        browser.get(server.url + "/ui")
        browser.find_element(By.ID, "token").send_keys(ADMIN)
        browser.find_element(By.CSS_SELECTOR, "#token-form button[type=submit]").click()
        rows = wait_for(
            browser,
            "the ledger's hours in the table",
            lambda d: (
                len(found := d.find_elements(By.CSS_SELECTOR, "#ledger tbody tr")) >= 24 and found
            ),
        )
        hours = len(rows) - 1  # and the total
        # The bars along the plot's bottom line: runs of drawn pixels, one per bar.
        bars = browser.execute_script(
            """
            const canvas = document.getElementById("ledger-chart");
            const g = canvas.getContext("2d");
            const y = Math.floor(canvas.height - 20 * (window.devicePixelRatio || 1));
            const line = g.getImageData(0, y, canvas.width, 1).data;
            let runs = 0, inside = false;
            for (let x = 0; x < canvas.width; x++) {
              const drawn = line[4 * x + 3] > 0;
              if (drawn && !inside) runs++;
              inside = drawn;
            }
            return runs;
            """
        )
        assert bars == hours, (bars, hours)
        keep_screenshot(browser, tmp_path, "dashboard-ledger-hours.png")
    finally:
        server.stop()
        kill_fleet(fleet)


def test_dashboard_shades_a_sizing_no_replica_renews(browser: WebDriver, tmp_path: Path) -> None:
    """A replica that does not lead shows the last sizing any replica published; once
    nobody has renewed it for three janitor intervals it is stale, and the chart shades
    that stretch instead of drawing old figures as if decided now. The standby is made by
    giving the store's lease to a replica that is not there."""
    fleet = f"test-{uuid.uuid4().hex[:8]}"
    config = ui_config(fleet, warm_target=1) + "leader_election: {kind: store}\n"
    headers = {"Authorization": f"Bearer {ADMIN}"}
    workdir = tmp_path / "stale"
    try:
        leader = start_server(workdir, config=config, args=["--stop-workers"])
        try:

            def sized() -> bool:
                shown = httpx.get(leader.url + "/v1/pools", headers=headers, timeout=10).json()
                return bool(shown["pools"][0]["sized_by"])

            assert wait_until(sized, WAIT_S), "the leader never sized the pool"
        finally:
            leader.stop()
        with sqlite3.connect(workdir / "stoker.db") as db:
            held = db.execute(
                "UPDATE leases SET holder = 'cp-gone', duration_s = 864000000"
            ).rowcount
        assert held >= 1
        standby = start_server(workdir, config=config, args=["--stop-workers"])
        try:
            shown = httpx.get(standby.url + "/v1/pools", headers=headers, timeout=10).json()
            assert shown["pools"][0]["sizing_stale"] is True, shown
            browser.get(standby.url + "/ui")
            browser.find_element(By.ID, "token").send_keys(ADMIN)
            browser.find_element(By.CSS_SELECTOR, "#token-form button[type=submit]").click()
            wait_for(
                browser,
                "the stale stretch shaded on the chart",
                lambda d: (
                    int(d.find_element(By.ID, "chart").get_attribute("data-shaded") or 0) >= 2
                ),
            )
            assert "stale" in browser.find_element(By.ID, "chart-note").text
            keep_screenshot(browser, tmp_path, "dashboard-stale.png")
        finally:
            standby.stop()
    finally:
        kill_fleet(fleet)


def test_docs_render_the_operations_without_network(server: Server, browser: WebDriver) -> None:
    browser.get(server.url + "/docs")
    wait_for(
        browser,
        "Swagger UI's claim operations",
        lambda d: d.find_elements(By.CSS_SELECTOR, ".opblock-summary-path[data-path='/v1/claims']"),
    )
    paths = {
        e.get_attribute("data-path")
        for e in browser.find_elements(By.CSS_SELECTOR, ".opblock-summary-path")
    }
    assert {"/v1/claims", "/v1/claims/{claim_id}", "/v1/claims/{claim_id}/renew"} <= paths
    assert all(url.startswith(server.url) for url in requested(browser)), requested(browser)

    browser.get(server.url + "/redoc")
    wait_for(
        browser,
        "ReDoc's claim operation",
        lambda d: "Claim a worker" in d.find_element(By.TAG_NAME, "body").text,
    )
    # ReDoc's sidebar tries its vendor's logo from a CDN (the page's policy blocks it and
    # ReDoc hides the image); every script, style sheet and fetch came from the server.
    loaded = requested(browser, images=False)
    assert all(url.startswith(server.url) for url in loaded), loaded
