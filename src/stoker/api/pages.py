"""What a browser loads: the dashboard (`/ui`) and the API docs (`/docs`, `/redoc`).

Every file is shipped in the package (`stoker/api/static/`): the dashboard's HTML,
script and style sheet, and the vendored Swagger UI and ReDoc bundles, so the pages
work without network access. The pages themselves are public, as static files are:
they hold no data. The dashboard asks for a token and sends it as a bearer header on
each `/v1/` call it makes, where the API's usual rules apply (docs/getting-started.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from starlette.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from starlette.staticfiles import StaticFiles

#: The package's static files.
STATIC_DIR = Path(__file__).parent / "static"
#: Where they are served.
STATIC_URL = "/static"
_SWAGGER = f"{STATIC_URL}/vendor/swagger-ui"
_REDOC = f"{STATIC_URL}/vendor/redoc"

#: The dashboard loads its own files and calls its own server, nothing else: a page that
#: holds an admin token in its session storage runs no script from anywhere else.
DASHBOARD_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
#: The docs pages may run their bundles' inline code but fetch nothing from elsewhere:
#: ReDoc's sidebar would load its vendor's logo from a CDN (it hides the image when that
#: fails), and no page of this server shows what another server sends.
DOCS_POLICY = (
    "img-src 'self' data:; font-src 'self' data:; connect-src 'self'; "
    "frame-ancestors 'none'; base-uri 'none'"
)

#: The docs pages, on the vendored bundles; each is given the document's URL and a title.
_SWAGGER_UI = functools.partial(
    get_swagger_ui_html,
    swagger_js_url=f"{_SWAGGER}/swagger-ui-bundle.js",
    swagger_css_url=f"{_SWAGGER}/swagger-ui.css",
    swagger_favicon_url=f"{_SWAGGER}/favicon-32x32.png",
    # No badge from the public validator: the page calls this server only.
    swagger_ui_parameters={"validatorUrl": None},
)
_REDOC_PAGE = functools.partial(
    get_redoc_html,
    redoc_js_url=f"{_REDOC}/redoc.standalone.js",
    redoc_favicon_url=f"{_SWAGGER}/favicon-32x32.png",
    with_google_fonts=False,
)


def add_pages(app: FastAPI, *, openapi_url: str) -> None:
    """Serve the static files, the dashboard at `/ui` and the docs at `/docs`, `/redoc`."""
    app.mount(STATIC_URL, StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/ui", include_in_schema=False)
    async def dashboard() -> Response:
        return FileResponse(
            STATIC_DIR / "ui" / "index.html",
            headers={
                "content-security-policy": DASHBOARD_POLICY,
                "cache-control": "no-cache",
                "referrer-policy": "no-referrer",
            },
        )

    @app.get("/ui/", include_in_schema=False)
    async def dashboard_slash() -> Response:
        return RedirectResponse("/ui")

    for path, render in (("/docs", _SWAGGER_UI), ("/redoc", _REDOC_PAGE)):
        _docs_page(app, path, render, openapi_url=openapi_url)


def _docs_page(
    app: FastAPI, path: str, render: Callable[..., HTMLResponse], *, openapi_url: str
) -> None:
    """Serve the page `render` writes for the document at `openapi_url`, at `path`, under
    `DOCS_POLICY`."""

    @app.get(path, include_in_schema=False)
    async def docs_page() -> HTMLResponse:
        page = render(openapi_url=openapi_url, title=f"{app.title} - API")
        page.headers["content-security-policy"] = DOCS_POLICY
        return page
