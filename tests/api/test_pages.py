"""The pages a browser loads, served from the package's own files: `/ui`, `/docs`, `/redoc`.

In-process (`httpx.ASGITransport`): what each page refers to is served by this app and
nothing points elsewhere. tests/api/test_pages_browser.py renders them in Chromium.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from fakes import MemoryRuntime
from stoker.api import create_app
from stoker.api.pages import STATIC_DIR
from stoker.bootstrap import build_control_plane
from stoker.config import StokerConfig

#: `src="..."` and `href="..."` and the URLs FastAPI's doc pages pass to their scripts.
_REFERENCE = re.compile(r"""(?:src|href|url)\s*[=:]\s*['"]([^'"]+)['"]""")


@pytest.fixture
async def http(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    cfg = StokerConfig.model_validate(
        {
            "store": f"sqlite:///{tmp_path}/stoker.db",
            "pools": [{"name": "demo", "command": ["worker", "{port}"]}],
            "api": {"admin_tokens": ["admin-token-0123456789"]},
        }
    )
    runtime = MemoryRuntime()
    plane = build_control_plane(cfg, runtime=runtime, activator=runtime)
    app = create_app(plane, cfg.api, manage_plane=False)
    transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 40000))
    async with httpx.AsyncClient(transport=transport, base_url="http://stoker") as client:
        yield client


async def references(http: httpx.AsyncClient, page: str) -> list[str]:
    """What `page` refers to, after checking each one is served here."""
    answer = await http.get(page)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/html")
    found = _REFERENCE.findall(answer.text)
    assert found
    for url in found:
        assert url.startswith("/"), f"{page} refers to {url}, outside this server"
        asset = await http.get(url)
        assert asset.status_code == 200, url
        assert asset.content, url
    return found


async def test_the_dashboard_is_public_and_loads_only_its_own_files(
    http: httpx.AsyncClient,
) -> None:
    # The page holds no data: no token is needed for it, only for the API calls it makes.
    found = await references(http, "/ui")
    assert set(found) == {"/static/ui/dashboard.css", "/static/ui/dashboard.js"}
    page = await http.get("/ui")
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    script = (await http.get("/static/ui/dashboard.js")).text
    assert "sessionStorage" in script and "Authorization" in script
    # The rollout view: a section with the share and the workers of each revision.
    for element in ('id="rollout"', 'id="share-chart"', 'id="revision-chart"'):
        assert element in page.text
    assert "rollout_waits" in script and "revisions" in script
    assert (await http.get("/ui/", follow_redirects=False)).headers["location"] == "/ui"
    assert (await http.get("/v1/pools")).status_code == 401


@pytest.mark.parametrize(
    ("page", "bundle"),
    [
        ("/docs", "/static/vendor/swagger-ui/swagger-ui-bundle.js"),
        ("/redoc", "/static/vendor/redoc/redoc.standalone.js"),
    ],
)
async def test_the_api_docs_load_their_bundles_from_this_server(
    http: httpx.AsyncClient, page: str, bundle: str
) -> None:
    found = await references(http, page)
    assert bundle in found and "/openapi.json" in found


def test_the_vendored_bundles_ship_with_their_licenses() -> None:
    vendor = STATIC_DIR / "vendor"
    for folder, files in {
        "swagger-ui": ["swagger-ui-bundle.js", "swagger-ui.css", "LICENSE", "NOTICE"],
        "redoc": ["redoc.standalone.js", "LICENSE"],
    }.items():
        for name in files:
            assert (vendor / folder / name).stat().st_size > 0, f"{folder}/{name}"


@pytest.mark.skipif(shutil.which("node") is None, reason="no node to parse the script with")
def test_the_dashboard_script_parses() -> None:
    checked = subprocess.run(
        ["node", "--check", str(STATIC_DIR / "ui" / "dashboard.js")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert checked.returncode == 0, checked.stderr
