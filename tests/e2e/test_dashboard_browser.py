"""The dashboard in real headless Chromium against the whole stack started as an operator starts it:
`holdback sim`, `holdback gateway` (a small pool, so batch work is evicted), `holdback api`,
`holdback processor` and `holdback worker`, with batches submitted through the official `openai` client.

Nothing is reloaded by hand: every change the tests wait for arrives through the page's own htmx polling.
Screenshots of each page at 1280 and 1920 px go to a temporary folder, or to the folder named by
HOLDBACK_SCREENSHOTS (`HOLDBACK_SCREENSHOTS=docs/screenshots make test` refreshes the committed ones), so a
plain test run leaves the working tree clean.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
from pathlib import Path

import httpx
import openai
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from tests.support import (REPO, Processes, chat_lines, free_port, free_ports, poll, submit_batch, wait_batch,
                           wait_http)

pytestmark = [pytest.mark.browser, pytest.mark.e2e]

SCREENSHOTS = Path(os.environ.get("HOLDBACK_SCREENSHOTS") or tempfile.mkdtemp(prefix="hb-shots-"))
if not SCREENSHOTS.is_absolute():
    SCREENSHOTS = REPO / SCREENSHOTS
# The system's Chromium first (what CI installs), then the browser Playwright downloaded for itself.
SYSTEM_BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--no-first-run"]
BATCH_KEY, REALTIME_KEY = "hb-dash-batch-gateway-key", "hb-dash-realtime-key"
WIDTHS = (1280, 1920)
# Two replicas x 4: batch work is held at half the pool, and realtime bursts evict it.
GATEWAY_CONFIG = """
keys:
  - {key_env: HOLDBACK_GATEWAY_REALTIME_KEY, tenant: realtime, objectives: [realtime, standard, batch], defaultObjective: realtime}
  - {key_env: HOLDBACK_GATEWAY_BATCH_KEY, tenant: batch, objectives: [batch], relaysTenants: true}
adminKeys: [{key_env: HOLDBACK_ADMIN_KEY}]
anonymous: {enabled: false}
saturation: {detector: concurrency, maxConcurrency: 4}
eviction: {enabled: true, maxPerDecision: 2}
"""
WORKER_ARGS = ["-n", "16", "--backoff-base", "0.2", "--backoff-cap", "1", "--heartbeat-ttl", "6",
               "--scheduler-interval", "0.05", "--drain-timeout", "2"]
TERMINAL = {"completed", "failed", "expired", "cancelled"}


class Stack:
    def __init__(self, backend, tmp_path: Path):
        sim_port = free_ports(2)
        self.gateway_url = f"http://127.0.0.1:{free_port()}"
        self.api_url = f"http://127.0.0.1:{free_port()}"
        self.namespace = backend.namespace
        self.admin_key = backend.admin_key
        env = {**backend.env, "HOLDBACK_GATEWAY_URL": self.gateway_url, "HOLDBACK_GATEWAY_KEY": BATCH_KEY,
               "HOLDBACK_GATEWAY_BATCH_KEY": BATCH_KEY, "HOLDBACK_GATEWAY_REALTIME_KEY": REALTIME_KEY}
        self.procs = Processes(env=env, log_dir=tmp_path / "logs")
        config = tmp_path / "gateway.yaml"
        config.write_text(GATEWAY_CONFIG)
        sim = self.procs.start("sim", "--port", str(sim_port), "--replicas", "2", "--decode-base-ms", "20", name="sim")
        replicas = [f"http://127.0.0.1:{sim_port + i}" for i in range(2)]
        for url in replicas:
            wait_http(f"{url}/health", proc=sim)
        gateway = self.procs.start("gateway", "--port", self.gateway_url.rsplit(":", 1)[1], "--replicas",
                                   ",".join(replicas), "--config", str(config), name="gateway")
        api = self.procs.start("api", "--port", self.api_url.rsplit(":", 1)[1], name="api")
        wait_http(f"{self.gateway_url}/health", timeout=30, proc=gateway)
        wait_http(f"{self.api_url}/readyz", timeout=30, proc=api)
        self.procs.start("processor", "--poll-interval", "0.1", "--reconcile-interval", "1", name="processor")
        self.procs.start("worker", *WORKER_ARGS, name="worker")
        self.admin = httpx.Client(base_url=self.api_url, headers={"authorization": f"Bearer {self.admin_key}"},
                                  timeout=10)
        key = self.admin.post("/admin/keys", json={"tenant": "acme-research"})
        key.raise_for_status()
        self.client = openai.OpenAI(base_url=f"{self.api_url}/v1", api_key=key.json()["key"], max_retries=3)

    def close(self) -> None:
        self.admin.close()
        self.procs.close()

    def submit(self, n: int, *, max_tokens: int = 40, lines: list[str] | None = None) -> str:
        return submit_batch(self.client, lines or chat_lines(n, max_tokens=max_tokens, content="summarise document {i}"))

    def wait(self, batch_id: str, until, timeout: float = 60.0, what: str = "the batch"):  # noqa: ANN001
        return wait_batch(self.client, batch_id, until, timeout,
                          lambda: f"waiting for {what}\n{self.procs.log('worker')[-2000:]}\n"
                                  f"{self.procs.log('processor')[-2000:]}")

    def completed(self, batch_id: str) -> int:
        return self.client.batches.retrieve(batch_id).request_counts.completed


@pytest.fixture
def stack(backend, tmp_path):
    s = Stack(backend, tmp_path)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")  # set up before the per-test stack: without Chromium it fails at once
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(p.chromium.executable_path), args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def chromium_path(playwright_own: str) -> str:
    """A Chromium to drive: the first of SYSTEM_BROWSERS on PATH, else Playwright's own; fail saying how to get one."""
    for name in SYSTEM_BROWSERS:
        if found := shutil.which(name):
            return found
    if playwright_own and Path(playwright_own).exists():
        return playwright_own
    pytest.fail("the browser tests need Chromium and found none: install the system's "
                "(`sudo apt-get install chromium` on Debian/Ubuntu) or Playwright's "
                "(`.venv/bin/python -m playwright install chromium`), or deselect them with `-m 'not browser'`",
                pytrace=False)


def signed_in(browser: Browser, stack: Stack, width: int = 1280, height: int = 900) -> Page:
    page = browser.new_page(viewport={"width": width, "height": height})
    page.problems = []
    page.on("console", lambda m: m.type == "error" and page.problems.append(m.text))
    page.on("pageerror", lambda e: page.problems.append(str(e)))
    page.goto(f"{stack.api_url}/dashboard")
    expect(page).to_have_url(re.compile(r"/dashboard/login"))
    page.fill("#admin_key", "not the key")
    page.click("button[type=submit]")
    expect(page.locator(".flash-error")).to_contain_text("not the admin key")
    page.fill("#admin_key", stack.admin_key)
    page.click("button[type=submit]")
    expect(page).to_have_url(f"{stack.api_url}/dashboard")
    cookie = next(c for c in page.context.cookies() if c["name"] == "holdback_dashboard")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and stack.admin_key not in cookie["value"]
    page.problems.clear()  # the refused key's 401 was logged by the browser on purpose
    return page


def shoot(browser: Browser, stack: Stack, path: str, name: str, prepare=None, full_page: bool = True,  # noqa: ANN001
          height: int = 900) -> None:
    """Screenshots of one page at each width, each in a page of its own, signed in as an operator would."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    for width in WIDTHS:
        page = signed_in(browser, stack, width, height)
        page.goto(f"{stack.api_url}{path}")
        page.wait_for_load_state("networkidle")
        if prepare is not None:
            prepare(page)
        page.screenshot(path=str(SCREENSHOTS / f"{name}-{width}.png"), full_page=full_page)
        assert not page.problems, page.problems
        page.close()


def progress_numbers(text: str) -> tuple[int, int]:
    match = re.search(r"(\d+)\s+of\s+(\d+)\s+completed", text)
    assert match, text
    return int(match.group(1)), int(match.group(2))


def realtime_bursts(gateway_url: str, stop: threading.Event, answers: list[int], size: int = 8) -> None:
    """Bursts of `size` concurrent realtime requests each second; 8 fill the pool, so batch work is evicted."""
    headers = {"Authorization": f"Bearer {REALTIME_KEY}", "x-llm-d-inference-objective": "realtime"}
    body = {"model": "sim-model", "max_tokens": 20, "messages": [{"role": "user", "content": "realtime question"}]}
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            threads = [threading.Thread(target=lambda: answers.append(
                client.post(f"{gateway_url}/v1/chat/completions", json=body, headers=headers).status_code))
                for _ in range(size)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            stop.wait(1.0)


def test_batches_progress_live_and_cancel_from_the_page(stack, browser):
    # A little realtime traffic beside the batches, so the TTFT chart has a line.
    stop, answers = threading.Event(), []
    traffic = threading.Thread(target=realtime_bursts, args=(stack.gateway_url, stop, answers, 2), daemon=True)
    traffic.start()
    try:
        batches_live_and_cancelled(stack, browser)
    finally:
        stop.set()
        traffic.join(60)
    assert answers and set(answers) == {200}


def batches_live_and_cancelled(stack: Stack, browser: Browser) -> None:
    running = stack.submit(120)
    doomed = stack.submit(80)
    invalid = stack.submit(0, lines=['{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}',
                                     "this line is not JSON"])
    stack.wait(running, lambda b: b.request_counts.completed >= 1, what="work to start")
    page = signed_in(browser, stack)

    row = page.locator(f"tr[data-batch-id='{running}']")
    progress = row.get_by_test_id("progress")
    expect(progress).to_contain_text("completed")
    first = progress.inner_text()
    expect(progress).not_to_have_text(first, timeout=30_000)  # htmx polling, no reload
    second = progress.inner_text()
    assert progress_numbers(second)[0] > progress_numbers(first)[0], (first, second)
    assert progress_numbers(second)[1] == 120

    # Cancel from the page: confirm the dialog, read the flash, see the status change without a reload.
    dialogs = []
    page.once("dialog", lambda d: (dialogs.append(d.message), d.accept()))
    page.locator(f"tr[data-batch-id='{doomed}'] button", has_text="Cancel").click()
    expect(page.get_by_test_id("flash")).to_contain_text(f"Cancelled batch {doomed}")
    assert dialogs and doomed in dialogs[0]
    assert stack.client.batches.retrieve(doomed).status in ("cancelling", "cancelled")
    expect(page.locator(f"tr[data-batch-id='{doomed}'] .badge")).to_have_text(re.compile("cancel"), timeout=15_000)
    stack.wait(doomed, lambda b: b.status == "cancelled", 30, "the cancel to finish")
    expect(page.locator(f"tr[data-batch-id='{doomed}'] .badge")).to_have_text("cancelled", timeout=15_000)
    expect(page.locator(f"tr[data-batch-id='{invalid}'] .badge")).to_have_text("failed")

    # Filter by status: only the cancelled batch.
    page.get_by_test_id("status-filter").select_option("cancelled")
    expect(page.locator("tr[data-batch-id]")).to_have_count(1)
    expect(page).to_have_url(re.compile(r"status=cancelled"))
    page.get_by_test_id("status-filter").select_option("")
    expect(page.locator("tr[data-batch-id]")).to_have_count(3)
    assert not page.problems, page.problems

    # The batch page: summary, requests, a request's attempts in the drawer.
    page.goto(f"{stack.api_url}/dashboard/batches/{running}")
    expect(page.locator("#summary")).to_contain_text("acme-research")
    expect(page.locator("tr[data-request-id]").first).to_be_visible()
    page.locator("tr[data-request-id]").first.click()
    expect(page.get_by_test_id("attempts")).to_contain_text("Attempts of line 1")
    expect(page.get_by_test_id("attempts").locator("tbody tr").first).to_contain_text("1")
    page.get_by_test_id("request-status-filter").select_option("succeeded")
    expect(page).to_have_url(re.compile(r"status=succeeded"))
    statuses = page.locator("#requests-live tbody .badge").all_inner_texts()
    assert statuses and set(statuses) == {"succeeded"}, statuses

    page.goto(f"{stack.api_url}/dashboard/batches/{invalid}")
    expect(page.locator("#summary")).to_contain_text("Validation errors")
    assert not page.problems, page.problems

    def open_attempts(p: Page) -> None:
        evicted = p.locator("tr[data-request-id]:has(td.text-warn)")  # a request with evictions, if any
        (evicted.first if evicted.count() else p.locator("tr[data-request-id]").first).click()
        expect(p.get_by_test_id("attempts")).to_be_visible()

    shoot(browser, stack, f"/dashboard/batches/{running}", "batch", full_page=False, height=1100)
    shoot(browser, stack, f"/dashboard/batches/{running}", "batch-attempts", open_attempts, full_page=False)
    shoot(browser, stack, f"/dashboard/batches/{invalid}", "batch-failed-validation")
    shoot(browser, stack, "/dashboard", "batches")

    # Once done, the output downloads through the dashboard's own (cookie) route.
    batch = stack.wait(running, lambda b: b.status in TERMINAL, 90, "the batch to complete")
    assert batch.status == "completed"
    page.goto(f"{stack.api_url}/dashboard")
    link = page.locator(f"tr[data-batch-id='{running}'] a", has_text="output")
    expect(link).to_be_visible(timeout=10_000)
    body = page.request.get(f"{stack.api_url}{link.get_attribute('href')}").text()
    assert len(body.splitlines()) == 120
    page.close()


def test_pause_holds_dispatch_and_the_gateway_page_shows_evictions(stack, browser):
    batch_id = stack.submit(160)
    stack.wait(batch_id, lambda b: b.request_counts.completed >= 3, what="work to start")
    page = signed_in(browser, stack)
    page.goto(f"{stack.api_url}/dashboard/queues")
    queue = page.locator(f"[data-queue='{stack.namespace}-requests']")
    expect(queue).to_be_visible()
    expect(page.locator("tr[data-worker]")).to_have_count(1)

    page.once("dialog", lambda d: d.accept())
    queue.get_by_role("button", name="Pause dispatch").click()
    expect(page.get_by_test_id("flash")).to_contain_text("Paused queue")
    expect(queue.locator(".badge", has_text="paused")).to_be_visible()
    # The worker logs when it sees the flag and claims nothing after; then its in-flight requests (some still
    # waiting at the gateway) finish. Waiting for both, not for a fixed time, holds on a loaded machine.
    poll(lambda: '"event":"dispatch_paused"' in stack.procs.log("worker"), 30, "the worker to see the pause",
         lambda: stack.procs.log("worker"))
    expect(queue.locator(".stat", has_text="started").locator(".stat-value")).to_have_text("0", timeout=45_000)
    held = stack.completed(batch_id)  # a worker records the row before its job leaves the started registry
    queued = int(queue.locator(".stat", has_text="queued").locator(".stat-value").inner_text())
    assert queued > 0
    assert stack.completed(batch_id) == held, "nothing completes while dispatch is paused"
    assert int(queue.locator(".stat", has_text="queued").locator(".stat-value").inner_text()) >= queued
    shoot(browser, stack, "/dashboard/queues", "queues-paused")

    queue.get_by_role("button", name="Resume dispatch").click()
    expect(page.get_by_test_id("flash")).to_contain_text("Resumed queue")
    stack.wait(batch_id, lambda b: b.request_counts.completed > held + 5, 30, "dispatch to restart")

    # Realtime bursts at the gateway evict running batch requests; the gateway page shows it.
    stop, answers = threading.Event(), []
    traffic = threading.Thread(target=realtime_bursts, args=(stack.gateway_url, stop, answers), daemon=True)
    traffic.start()
    try:
        page.goto(f"{stack.api_url}/dashboard/gateway")
        expect(page.get_by_test_id("config-digest")).to_contain_text("sha256:")
        issued = page.locator(".stat", has_text="evictions issued").locator(".stat-value")
        expect(issued).not_to_have_text("0", timeout=45_000)
        expect(page.locator(".stat", has_text="confirmed").locator(".stat-value")).not_to_have_text("0")
        expect(page.locator("tr[data-band='-10']")).to_contain_text("batch")
        expect(page.locator("tr[data-replica]")).to_have_count(2)
        # A few sampler intervals later the TTFT chart has a realtime line.
        expect(page.locator(".legend-item", has_text="realtime")).to_be_visible(timeout=20_000)
        expect(page.locator("#charts .chart-card").first.locator("polyline")).to_have_count(1, timeout=20_000)
        shoot(browser, stack, "/dashboard/gateway", "gateway")
        shoot(browser, stack, "/dashboard/queues", "queues")
    finally:
        stop.set()
        traffic.join(60)
    assert answers and set(answers) == {200}, "realtime is never shed"

    # The gateway goes away: the same page says so on its next poll instead of erroring.
    gateway = next(proc for proc, name in stack.procs.children if name == "gateway")
    stack.procs.stop(gateway)
    expect(page.get_by_test_id("gateway-unreachable")).to_contain_text("unreachable", timeout=15_000)
    expect(page.locator("#charts")).to_be_visible()
    shoot(browser, stack, "/dashboard/gateway", "gateway-unreachable")
    assert not page.problems, page.problems
    page.close()
