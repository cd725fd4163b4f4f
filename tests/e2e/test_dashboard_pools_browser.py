"""The Gateway page in real headless Chromium against a gateway with two model pools (issue #49): the realtime
TTFT chart with streamed and non-streamed clients at once, and every pool's replicas, bands and saturation.

The stack is `holdback sim` (two `model-a` replicas and one `model-b`), `holdback gateway` with a `pools`
config and `holdback api`; no processor or workers, the page only reads the gateway. The browser and the
sign-in are tests/e2e/test_dashboard_browser.py's. Nothing is reloaded by hand: every change the tests wait
for arrives through the page's own polling (the gateway fragment every 2 s, the charts every 5 s).
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Locator, expect

from tests.e2e.test_dashboard_browser import (  # noqa: F401 - the browser fixture
    BATCH_KEY, REALTIME_KEY, browser, shoot, signed_in,
)
from tests.support import Processes, free_port, free_ports, poll, wait_http

pytestmark = [pytest.mark.browser, pytest.mark.e2e]

# pool-a: two replicas x 4 requests, one ceiling for every band; pool-b: one replica x 2, batch held at half.
GATEWAY_CONFIG = """
keys:
  - {{key_env: HOLDBACK_GATEWAY_REALTIME_KEY, tenant: realtime, objectives: [realtime, standard, batch], defaultObjective: realtime}}
  - {{key_env: HOLDBACK_GATEWAY_BATCH_KEY, tenant: batch, objectives: [batch], relaysTenants: true}}
adminKeys: [{{key_env: HOLDBACK_ADMIN_KEY}}]
anonymous: {{enabled: false}}
saturation: {{detector: concurrency, maxConcurrency: 4}}
pools:
  - {{name: pool-a, models: [model-a], replicas: [{a0}, {a1}]}}
  - name: pool-b
    models: [model-b]
    replicas: [{b0}]
    saturation: {{maxConcurrency: 2}}
    usageLimit: {{policy: priority-holdback, minCeiling: 0.5}}
"""
DECODE_MS = 25  # per generated token: a 60-token answer takes 1.5 s whole, its first token a step or two
# The gateway's TTFT histogram bounds (gateway/metrics.py): the page's p95 is interpolated within one of them.
TTFT_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class PoolsStack:
    def __init__(self, backend, tmp_path: Path):
        first = free_ports(3)
        self.pool_a = [f"http://127.0.0.1:{first}", f"http://127.0.0.1:{first + 1}"]
        self.pool_b = [f"http://127.0.0.1:{first + 2}"]
        self.gateway_url = f"http://127.0.0.1:{free_port()}"
        self.api_url = f"http://127.0.0.1:{free_port()}"
        self.admin_key = backend.admin_key
        env = {**backend.env, "HOLDBACK_GATEWAY_URL": self.gateway_url, "HOLDBACK_GATEWAY_KEY": BATCH_KEY,
               "HOLDBACK_GATEWAY_BATCH_KEY": BATCH_KEY, "HOLDBACK_GATEWAY_REALTIME_KEY": REALTIME_KEY}
        self.procs = Processes(env=env, log_dir=tmp_path / "logs")
        timing = ("--decode-base-ms", str(DECODE_MS), "--log-level", "WARNING")
        sims = [self.procs.start("sim", "--port", str(first), "--replicas", "2", "--model", "model-a", *timing,
                                 name="sim-a"),
                self.procs.start("sim", "--port", str(first + 2), "--model", "model-b", *timing, name="sim-b")]
        for url, sim in zip(self.pool_a + self.pool_b, sims[:1] * 2 + sims[1:]):
            wait_http(f"{url}/health", proc=sim)
        config = tmp_path / "gateway.yaml"
        config.write_text(GATEWAY_CONFIG.format(a0=self.pool_a[0], a1=self.pool_a[1], b0=self.pool_b[0]))
        gateway = self.procs.start("gateway", "--port", self.gateway_url.rsplit(":", 1)[1], "--config", str(config),
                                   name="gateway")
        api = self.procs.start("api", "--port", self.api_url.rsplit(":", 1)[1], name="api")
        wait_http(f"{self.gateway_url}/health", timeout=30, proc=gateway)
        wait_http(f"{self.api_url}/readyz", timeout=30, proc=api)
        poll(self.all_healthy, 30, "every replica of both pools to be healthy", lambda: self.procs.log("gateway"))

    def all_healthy(self) -> bool:
        state = httpx.get(f"{self.gateway_url}/admin/state",
                          headers={"Authorization": f"Bearer {self.admin_key}"}).json()
        pools = state.get("pools") or {}
        return set(pools) == {"pool-a", "pool-b"} and all(r["healthy"] for p in pools.values() for r in p["replicas"])

    def close(self) -> None:
        self.procs.close()


@pytest.fixture
def pools_stack(backend, tmp_path):
    s = PoolsStack(backend, tmp_path)
    try:
        yield s
    finally:
        s.close()


class Clients:
    """Realtime clients looping through the gateway until stopped, each recording what it measured: a streamed
    answer's time to its first event, a non-streamed answer's time to the whole body."""

    def __init__(self, gateway_url: str):
        self.url = gateway_url + "/v1/chat/completions"
        self.stop = threading.Event()
        self.streamed: list[float] = []
        self.whole: list[float] = []
        self.statuses: list[int] = []
        self.threads: list[threading.Thread] = []

    def start(self, model: str, *, streamed: int = 0, whole: int = 0, max_tokens: int = 60) -> None:
        for stream, n in ((True, streamed), (False, whole)):
            for _ in range(n):
                t = threading.Thread(target=self._loop, args=(model, stream, max_tokens), daemon=True)
                t.start()
                self.threads.append(t)

    def _loop(self, model: str, stream: bool, max_tokens: int) -> None:
        body = {"model": model, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
                "messages": [{"role": "user", "content": "a realtime question"}]}
        headers = {"Authorization": f"Bearer {REALTIME_KEY}"}
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                started = time.monotonic()
                with client.stream("POST", self.url, json=body, headers=headers) as r:
                    first = None
                    for line in r.iter_lines():
                        if first is None and line.startswith("data:"):
                            first = time.monotonic() - started
                    self.statuses.append(r.status_code)
                    if r.status_code == 200:
                        (self.streamed if stream else self.whole).append(first if stream else
                                                                         time.monotonic() - started)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def seconds(text: str) -> float | None:
    """A chart legend's value ("337 ms", "1.52 s", "—") in seconds; None for "—"."""
    text = text.strip()
    if text == "—":
        return None
    match = re.fullmatch(r"([\d.]+) (ms|s)", text)
    assert match, text
    return float(match.group(1)) / (1000 if match.group(2) == "ms" else 1)


def bound_above(value: float) -> float:
    return next(b for b in TTFT_BOUNDS if b >= value)


def bound_below(value: float) -> float:
    return max((b for b in TTFT_BOUNDS if b <= value), default=0.0)


def legend_value(page, series: str) -> Locator:  # noqa: ANN001
    return page.locator(f"#charts [data-chart='ttft'] .legend-item[data-series='{series}'] b")


def test_streamed_ttft_and_whole_answers_are_charted_apart_with_mixed_clients(pools_stack, browser):  # noqa: F811
    """Streaming and non-streaming realtime clients at once: the realtime TTFT series is the streamed answers'
    first token as the streaming clients measured it, the non-streamed whole answers are their own series, and
    once the traffic stops both show "—" instead of their last value."""
    stack, clients = pools_stack, Clients(pools_stack.gateway_url)
    page = signed_in(browser, stack)
    page.goto(f"{stack.api_url}/dashboard/gateway")
    expect(page.locator("#charts [data-chart='ttft']")).to_contain_text("No realtime requests")
    clients.start("model-a", streamed=2, whole=2)
    try:
        streamed, whole = legend_value(page, "realtime"), legend_value(page, "realtime (whole answer)")
        # A sample measures the 5 s since the one before: two samples of traffic, then the chart's next poll.
        expect(streamed).to_have_text(re.compile(r"\d"), timeout=45_000)
        expect(whole).to_have_text(re.compile(r"\d"), timeout=45_000)
        shown = {"streamed": seconds(streamed.inner_text()), "whole": seconds(whole.inner_text())}
    finally:
        clients.close()
    assert clients.streamed and clients.whole and set(clients.statuses) == {200}, clients.statuses
    measured = {"streamed": max(clients.streamed), "whole": min(clients.whole)}
    detail = f"page {shown}, clients measured streamed {sorted(clients.streamed)} whole {sorted(clients.whole)}"
    # The gateway sees each answer no later than its client did: the streamed p95 lies within the histogram
    # bucket of the slowest first token the clients saw, never up among the whole answers.
    assert shown["streamed"] <= bound_above(measured["streamed"]), detail
    assert shown["streamed"] < bound_below(DECODE_MS * 60 / 1000) <= shown["whole"], detail
    assert shown["whole"] <= bound_above(max(clients.whole)), detail
    assert max(clients.streamed) < min(clients.whole), detail

    # No traffic: the legend's latest values go stale and read "—", not the p95 from before.
    expect(streamed).to_have_text("—", timeout=60_000)
    expect(whole).to_have_text("—", timeout=15_000)
    assert not page.problems, page.problems
    page.close()


def test_the_gateway_page_shows_every_pools_replicas_bands_and_saturation(pools_stack, browser):  # noqa: F811
    """Two model pools: each has its own section with its replicas (URL, health, in flight), its bands (with its
    own ceilings) and its saturation; the second model's replica and its load are not lost behind the first's."""
    stack, clients = pools_stack, Clients(pools_stack.gateway_url)
    page = signed_in(browser, stack)
    page.goto(f"{stack.api_url}/dashboard/gateway")
    a, b = (page.locator(f"[data-testid='pool'][data-pool='{name}']") for name in ("pool-a", "pool-b"))
    for pool, urls in ((a, stack.pool_a), (b, stack.pool_b)):
        expect(pool.locator("tr[data-replica]")).to_have_count(len(urls))
        for url in urls:
            expect(pool.locator(f"tr[data-replica='{url}']")).to_contain_text("healthy")
        expect(pool.locator("tr[data-band]")).to_have_count(3)
    expect(a.locator("tr[data-band='-10'] [data-testid=ceiling]")).to_have_text("100%")
    expect(b.locator("tr[data-band='-10'] [data-testid=ceiling]")).to_have_text("50%")  # its own usageLimit

    # Three long model-b answers at once: pool-b's two slots fill and the third waits in its realtime band,
    # while pool-a stays idle.
    clients.start("model-b", whole=3, max_tokens=200)
    try:
        expect(b.get_by_test_id("pool-saturation")).to_have_text("100%", timeout=30_000)
        expect(b.locator(f"tr[data-replica='{stack.pool_b[0]}']")).to_contain_text("2 / 2", timeout=30_000)
        expect(b.locator("tr[data-band='100'] [data-testid=queued]")).to_have_text("1", timeout=30_000)
        expect(a.get_by_test_id("pool-saturation")).to_have_text("0%")
        for url in stack.pool_a:
            expect(a.locator(f"tr[data-replica='{url}']")).to_contain_text("0 / 4")
        shoot(browser, stack, "/dashboard/gateway", "gateway-pools")
    finally:
        clients.close()
    assert set(clients.statuses) == {200}, clients.statuses
    assert not page.problems, page.problems
    page.close()
