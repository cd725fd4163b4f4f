"""The operator's first hour in real headless Chromium against the whole stack (tests/e2e/test_dashboard_browser.py
starts it): a key created on the Keys page, a batch whose every line the replica refuses with a 400 (its message
in the table, its status and body in the drawer, not a green "completed"), a cancel shown as cancelled rather than
failed, search and the tenant filter, the Usage page against the operator API, the banner while dispatch is
paused or the gateway is down, a batch's throughput and ETA, and the charts' ranges.

Nothing is reloaded by hand where the page polls; screenshots go where test_dashboard_browser.py puts them.
"""

from __future__ import annotations

import io
import re

import openai
import pytest
from playwright.sync_api import Page, expect

from tests.e2e.test_dashboard_browser import (  # noqa: F401 - fixtures
    Stack, browser, shoot, signed_in, stack,
)
from tests.support import chat_lines, poll

# Browser tests run once, in the embedded pass (the Makefile's test-services says why).
pytestmark = [pytest.mark.browser, pytest.mark.e2e]

REFUSED = "n must be at least 1, got 0."
TERMINAL = ("completed", "cancelled", "failed", "expired")


def clipped(page: Page, selector: str) -> list[str]:
    """Texts of the cells matching `selector` whose content is wider than the cell shows."""
    return page.eval_on_selector_all(
        selector, "cells => cells.filter(c => c.scrollWidth > c.clientWidth + 1).map(c => c.innerText)")


def create_key(page: Page, stack: Stack, tenant: str) -> tuple[str, str]:
    page.goto(f"{stack.api_url}/dashboard/keys")
    page.get_by_test_id("new-key-tenant").fill(tenant)
    page.get_by_role("button", name="Create key").click()
    created = page.get_by_test_id("new-key")
    expect(created).to_contain_text(f"for tenant {tenant}")
    secret, key_id = page.get_by_test_id("new-key-secret").inner_text().strip(), created.get_attribute("data-key-id")
    # The list refreshes with the new key (its id, never the secret), and no key id is cut off at 1280 px.
    expect(page.locator(f"tr[data-key='{key_id}']")).to_contain_text(tenant)
    assert secret not in page.locator("table.keys").inner_text()
    assert clipped(page, "table.keys td") == []
    return secret, key_id


def test_refused_lines_cancels_search_and_usage(stack, browser):  # noqa: F811
    page = signed_in(browser, stack)
    secret, key_id = create_key(page, stack, "beta-lab")
    shoot(browser, stack, "/dashboard/keys", "keys", lambda p: create_key(p, stack, "gamma-lab"))
    beta = openai.OpenAI(base_url=f"{stack.api_url}/v1", api_key=secret, max_retries=3)
    upload = beta.files.create(file=("in.jsonl", io.BytesIO("\n".join(chat_lines(4, max_tokens=8)).encode())),
                               purpose="batch")
    zebra = beta.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h",
                                metadata={"project": "zebra"}).id

    refused = stack.submit(0, lines=chat_lines(3, max_tokens=8, extra_body={"n": 0}))
    doomed = stack.submit(200, max_tokens=400)
    stack.wait(doomed, lambda b: b.request_counts.completed >= 1, what="the doomed batch to start")
    page.goto(f"{stack.api_url}/dashboard")
    page.once("dialog", lambda d: d.accept())
    page.locator(f"tr[data-batch-id='{doomed}'] button", has_text="Cancel").click()
    expect(page.get_by_test_id("flash")).to_contain_text(f"Cancelled batch {doomed}")
    for batch_id in (refused, zebra, doomed):  # of two tenants: asked through the operator API
        poll(lambda: stack.admin.get(f"/admin/batches/{batch_id}").json()["status"] in TERMINAL, 90,
             f"batch {batch_id} to end", lambda: stack.procs.log("worker")[-2000:])
    api_batch = stack.client.batches.retrieve(refused)
    assert api_batch.status == "completed" and api_batch.request_counts.failed == 3, "the API keeps OpenAI's status"

    # The list: every line refused is not a green completed; a cancel is cancelled, not failed.
    badge = page.locator(f"tr[data-batch-id='{refused}'] .badge")
    expect(badge).to_have_text("completed · all failed", timeout=15_000)
    assert "badge-all-failed" in badge.get_attribute("class")
    cancelled = page.locator(f"tr[data-batch-id='{doomed}'] [data-testid=progress]")
    expect(cancelled.get_by_test_id("cancelled-count")).to_be_visible(timeout=15_000)
    expect(cancelled.get_by_test_id("failed-count")).to_have_count(0)
    counts = stack.client.batches.retrieve(doomed).request_counts
    assert f"{counts.failed} cancelled" in cancelled.inner_text(), "OpenAI's failed are all cancels here"
    # The cancel is charted apart: the throughput chart's failure axis does not take it.
    expect(page.locator("[data-chart=cancelled] polyline").first).to_be_visible(timeout=30_000)
    shoot(browser, stack, "/dashboard", "batches-cancelled")

    # Search by metadata, by batch id, and the tenant filter: the page's own form, the URL follows.
    search = page.get_by_test_id("batch-search")
    search.fill("project=zebra")
    search.press("Enter")
    expect(page).to_have_url(re.compile(r"q=project%3Dzebra"))
    expect(page.locator("tr[data-batch-id]")).to_have_count(1)
    expect(page.locator(f"tr[data-batch-id='{zebra}']")).to_contain_text("beta-lab")
    page.get_by_test_id("batch-search").fill(refused[:16])
    page.get_by_test_id("batch-search").press("Enter")
    expect(page.locator("tr[data-batch-id]")).to_have_count(1)
    expect(page.locator(f"tr[data-batch-id='{refused}']")).to_be_visible()
    page.get_by_test_id("batch-search").fill("")
    page.get_by_test_id("batch-search").press("Enter")
    expect(page.locator("tr[data-batch-id]")).to_have_count(3)  # the form is swapped in anew: wait for it,
    # and for htmx to settle it: it binds the new form's triggers then, and a change before that is not sent (CI once
    # chose the tenant in between and the URL never followed)
    expect(page.locator(".htmx-settling, .htmx-added")).to_have_count(0)
    page.get_by_test_id("tenant-filter").select_option(label="beta-lab")
    expect(page).to_have_url(re.compile(r"tenant=tnt_"))
    expect(page.locator("tr[data-batch-id]")).to_have_count(1)
    expect(page.locator(f"tr[data-batch-id='{zebra}']")).to_be_visible()
    expect(page.get_by_test_id("tenant-filter")).to_have_value(re.compile(r"^tnt_"))
    page.get_by_test_id("tenant-filter").select_option(label="acme-research")
    expect(page.locator("tr[data-batch-id]")).to_have_count(2)
    assert not page.problems, page.problems

    # The refused batch's page: the replica's message per line; the drawer has its status and body.
    page.goto(f"{stack.api_url}/dashboard/batches/{refused}")
    expect(page.locator("#summary .badge").first).to_have_text("completed · all failed")
    errors = page.get_by_test_id("row-error")
    expect(errors).to_have_count(3)
    assert set(errors.all_inner_texts()) == {REFUSED}, errors.all_inner_texts()
    page.locator("tr[data-request-id]").first.click()
    drawer = page.get_by_test_id("attempts")
    expect(drawer.get_by_test_id("attempt-reply")).to_have_text(f"the replica answered HTTP 400: {REFUSED}")
    expect(drawer.get_by_test_id("result")).to_contain_text("HTTP 400")
    expect(drawer.get_by_test_id("result-body")).to_contain_text(REFUSED)
    assert clipped(page, "#drawer td") == [], "the drawer shows every cell whole at 1280 px"

    def open_refused(p: Page) -> None:
        p.locator("tr[data-request-id]").first.click()
        expect(p.get_by_test_id("result-body")).to_be_visible()
    shoot(browser, stack, f"/dashboard/batches/{refused}", "batch-refused", open_refused, full_page=False)

    # A succeeded line's output opens the same way.
    page.goto(f"{stack.api_url}/dashboard/batches/{zebra}")
    page.locator("tr[data-request-id]").first.click()
    expect(page.get_by_test_id("result")).to_contain_text("Output")
    expect(page.get_by_test_id("result-body")).to_contain_text('"choices"')

    # Usage: the page's figures are the operator API's over the same database.
    page.goto(f"{stack.api_url}/dashboard/usage?period=1h")
    table = page.get_by_test_id("usage")
    expect(table.locator("tr[data-tenant]")).to_have_count(2)
    since, until = float(table.get_attribute("data-since")), float(table.get_attribute("data-until"))
    answer = stack.admin.get("/admin/usage", params={"since": since, "until": until}).json()["data"]
    assert {u["tenant"] for u in answer} == {"acme-research", "beta-lab"}
    for u in answer:
        row = table.locator(f"tr[data-tenant='{u['tenant_id']}']")
        for field in ("batches", "succeeded", "failed", "cancelled", "input_tokens", "output_tokens"):
            shown = row.locator(f"[data-field={field}]").inner_text().replace(",", "")
            assert int(shown) == u[field], (u["tenant"], field, shown, u[field])
    acme = next(u for u in answer if u["tenant"] == "acme-research")
    assert acme["failed"] == 3 and acme["cancelled"] == counts.failed and acme["batches"] == 2
    assert not page.problems, page.problems
    shoot(browser, stack, "/dashboard/usage?period=1h", "usage")
    page.close()


def test_banner_while_paused_or_the_gateway_is_down_pace_and_chart_ranges(stack, browser):  # noqa: F811
    batch_id = stack.submit(150, max_tokens=40)
    stack.wait(batch_id, lambda b: b.request_counts.completed >= 3, what="work to start")
    page = signed_in(browser, stack)

    # The batch page: its throughput over the last minute, and an ETA for what is left.
    page.goto(f"{stack.api_url}/dashboard/batches/{batch_id}")
    expect(page.get_by_test_id("throughput")).to_have_text(re.compile(r"^[\d.]+/s$"), timeout=15_000)
    expect(page.get_by_test_id("eta")).to_have_text(re.compile(r"\d+(\.\d)? ?(ms|s|m \d\ds)$"), timeout=15_000)

    # Pause dispatch: every page says so until it is resumed.
    page.goto(f"{stack.api_url}/dashboard/queues")
    page.once("dialog", lambda d: d.accept())
    page.get_by_role("button", name="Pause dispatch").click()
    banner = page.locator(f"[data-alert=paused][data-subject='{stack.namespace}-requests']")
    expect(banner).to_contain_text("Dispatch is paused")
    for path in ("/dashboard", f"/dashboard/batches/{batch_id}", "/dashboard/usage", "/dashboard/keys"):
        page.goto(stack.api_url + path)
        expect(banner).to_be_visible()
    shoot(browser, stack, "/dashboard/keys", "banner-paused", lambda p: expect(
        p.locator("[data-alert=paused]")).to_be_visible(), full_page=False)
    page.goto(f"{stack.api_url}/dashboard/queues")
    page.get_by_role("button", name="Resume dispatch").click()
    expect(page.get_by_test_id("flash")).to_contain_text("Resumed queue")
    expect(banner).to_have_count(0, timeout=15_000)

    # Chart ranges: the same history over an hour; the gateway page charts KV usage and queue depth too.
    page.goto(f"{stack.api_url}/dashboard/gateway")
    kv = page.locator("[data-chart=kv]")
    expect(kv.locator(".legend-item")).to_have_count(2, timeout=30_000)  # one line per replica
    page.get_by_test_id("chart-range").get_by_role("button", name="1 hour").click()
    expect(page.locator("#charts")).to_have_attribute("data-range", "1h")
    expect(kv.locator("svg.chart title")).to_have_text("KV cache usage, last 1 hour")
    expect(page.locator("[data-chart=depth] .legend-item", has_text="RQ queued")).to_be_visible()
    poll(lambda: page.locator("#charts").get_attribute("data-range") == "1h" and
         page.locator("[data-chart=kv] polyline").count() >= 1, 30, "the KV chart to draw a line over an hour")
    shoot(browser, stack, "/dashboard/gateway?range=1h", "gateway-history")
    stack.wait(batch_id, lambda b: b.status == "completed", 120, "the batch to finish")

    # The gateway goes away: the banner says so on every page, not only on the gateway's.
    gateway = next(proc for proc, name in stack.procs.children if name == "gateway")
    stack.procs.stop(gateway)
    page.goto(f"{stack.api_url}/dashboard/keys")
    expect(page.locator("[data-alert=gateway]")).to_contain_text("is unreachable", timeout=15_000)
    assert not page.problems, page.problems
    page.close()
