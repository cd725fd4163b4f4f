"""The API's front door: `/` leads to the dashboard, and `/docs` is Swagger UI over `/openapi.json`.

FastAPI's own docs page loads Swagger UI from a CDN, so it is blank without a network. Here its assets come
from the installed `swagger-ui-py` package (Swagger UI 5, which renders OpenAPI 3.1; its Apache-2.0 LICENSE is
served beside them), following FastAPI's recipe for self-hosted docs assets.
"""

from __future__ import annotations

import importlib.util
from importlib.resources import files
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

DOCS_ASSETS = "/docs/assets"
ASSETS = ("swagger-ui-bundle.js", "swagger-ui.css", "favicon-32x32.png", "LICENSE")


def swagger_ui_assets() -> Path:
    """The folder of Swagger UI's files inside the installed package; fails at start-up when one is missing."""
    # Found, not imported: the package's __init__ loads its web-framework handlers, Jinja2 and YAML, none used here.
    spec = importlib.util.find_spec("swagger_ui")
    package = Path(spec.origin).parent if spec is not None and spec.origin else Path(str(files("swagger_ui")))
    folder = package / "static"
    missing = [name for name in ASSETS if not (folder / name).is_file()]
    if missing:
        raise RuntimeError(f"the swagger-ui-py package at {folder} lacks {', '.join(missing)}; reinstall holdback "
                           "(`make install`, or pip install 'swagger-ui-py>=25.7,<26')")
    return folder


def install_front_door(app: FastAPI) -> None:
    """`/` and `/docs` (the app must be made with docs_url=None and redoc_url=None)."""
    app.mount(DOCS_ASSETS, StaticFiles(directory=swagger_ui_assets()), name="docs-assets")

    @app.get("/", include_in_schema=False)
    def front_door() -> RedirectResponse:
        return RedirectResponse("/dashboard", status_code=307)

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url, title=f"{app.title} - docs",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js", swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png",
        )
