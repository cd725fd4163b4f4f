"""The API's front door: `/` leads to the dashboard, and `/docs` renders the API with no network (Swagger UI's
assets come from the API itself, and the version served renders the OpenAPI 3.1 document FastAPI writes)."""

from __future__ import annotations

import re

import httpx
import pytest
from playwright.sync_api import sync_playwright

from tests.e2e.test_dashboard_browser import CHROMIUM_ARGS, chromium_path


def test_the_root_redirects_to_the_dashboard(api):
    r = httpx.get(f"{api.url}/", timeout=30)
    assert r.status_code == 307 and r.headers["location"] == "/dashboard"
    landed = httpx.get(f"{api.url}/", timeout=30, follow_redirects=True)
    assert landed.status_code == 200 and "/dashboard/login" in str(landed.url)


def test_the_docs_page_loads_nothing_from_elsewhere(api):
    page = httpx.get(f"{api.url}/docs", timeout=30)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    referenced = re.findall(r"""(?:src|href)=["']([^"']+)["']""", page.text)
    assert referenced and not [u for u in referenced if not u.startswith("/")], referenced
    assert "/openapi.json" in page.text
    for url in referenced:
        asset = httpx.get(f"{api.url}{url}", timeout=30)
        assert asset.status_code == 200 and len(asset.content) > 500, url
    licence = httpx.get(f"{api.url}/docs/assets/LICENSE", timeout=30)
    assert licence.status_code == 200 and "Apache License" in licence.text
    assert httpx.get(f"{api.url}/redoc", timeout=30).status_code == 404  # ReDoc would need a CDN: off
    assert "/docs" not in httpx.get(f"{api.url}/openapi.json", timeout=30).json()["paths"]


@pytest.mark.browser
def test_the_docs_render_every_route_with_the_network_cut_off(api):
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(p.chromium.executable_path), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            refused, problems = [], []
            # Anything not from the API itself is refused, as on a machine without a network.
            page.route("**/*", lambda route: route.continue_() if route.request.url.startswith(api.url)
                       else (refused.append(route.request.url), route.abort()))
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.goto(f"{api.url}/docs")
            page.wait_for_selector(".opblock-summary-path", timeout=30_000)
            paths = set(page.locator(".opblock-summary-path").all_inner_texts())
            assert {"/v1/files", "/v1/batches", "/v1/batches/{batch_id}"} <= {p.replace("\u200b", "") for p in paths}
            assert page.locator(".errors-wrapper").count() == 0, page.locator(".errors-wrapper").all_inner_texts()
            assert not refused and not problems, (refused, problems)
        finally:
            browser.close()
