"""What the dashboard knows about the gateway: its `/admin/state` document and its `/metrics`, fetched
server-side with a short timeout, and the TTFT histogram's quantiles (see gateway/README.md).

An unreachable or misbehaving gateway is a `GatewayView` with `error` set, never an exception: the page says
so and the rest of the dashboard keeps working.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from holdback.contract import DropReason

TIMEOUT = httpx.Timeout(2.0, connect=1.0)
TTFT = "holdback_gateway_ttft_seconds"
REJECTIONS = "holdback_gateway_rejections_total"
EVICTIONS = "holdback_gateway_evictions_total"

# What each rejection count on the gateway page counts, in the operator's words (the page's tooltips and legend).
DROP_REASON_MEANINGS = {
    DropReason.EVICTED.value: "Running sheddable (batch) requests stopped to free room for more urgent work; "
                              "the workers resume them.",
    DropReason.SATURATED.value: "Refused at arrival: the priority band's queue or ceiling was full.",
    DropReason.TTL_EXPIRED.value: "Waited in the gateway's queue past its TTL or deadline and was dropped.",
    DropReason.NO_ENDPOINTS.value: "No healthy replica served the request's model.",
    DropReason.CONTEXT_CANCELLED.value: "The caller went away while the request waited in the gateway's queue "
                                        "(a client timeout or disconnect, or a worker aborting a cancelled "
                                        "batch's request); nothing reached a replica.",
    DropReason.KV_CAPACITY.value: "KV admission refused it: its worst-case KV need did not fit the pool.",
    DropReason.KV_NEVER_FITS.value: "KV admission refused it at once: its worst-case KV need is more than a "
                                    "replica may ever hold (answered 400).",
    DropReason.QUOTA.value: "A KV quota of the tenant or traffic class was reached.",
    DropReason.CONTEXT_LENGTH.value: "The prompt leaves no room in the model's context (answered 400).",
}

# Buckets of one histogram: (upper bound, cumulative count), ascending, ending with +Inf.
Buckets = list[tuple[float, float]]


@dataclass
class GatewayView:
    url: str
    error: str | None = None
    state: dict = field(default_factory=dict)
    rejections: dict[str, int] = field(default_factory=dict)  # reason -> count, over every band
    rejections_by_band: list[tuple[str, str, int]] = field(default_factory=list)  # (reason, band, count)
    evictions: dict[str, int] = field(default_factory=dict)  # issued, confirmed, timed_out, mid_stream
    ttft: dict[str, Buckets] = field(default_factory=dict)  # objective -> buckets

    @property
    def reachable(self) -> bool:
        return self.error is None

    @property
    def pools(self) -> list[dict]:
        return pool_sections(self.state)

    @property
    def busiest(self) -> dict:
        """The pool nearest its set point: with several pools, the headline saturation is its."""
        return max(self.pools, key=lambda p: p.get("saturation") or 0.0, default={})

    def summed(self, key: str) -> int:
        """A count every pool reports (queued, in_flight, stale_replicas), over the gateway's pools."""
        return sum(int(p.get(key) or 0) for p in self.pools)

    @property
    def dispatched(self) -> int:
        return sum(int((p.get("totals") or {}).get("dispatched") or 0) for p in self.pools)


def pool_sections(state: dict) -> list[dict]:
    """Each model pool's /admin/state section with its `name`, the default pool first. The top level is the
    default pool's alone (gateway/README.md, "Observability"); a gateway that reports no `pools` has one."""
    pools = state.get("pools")
    if isinstance(pools, dict) and pools:
        return [{**section, "name": name} for name, section in pools.items() if isinstance(section, dict)]
    return [{**state, "name": state.get("pool") or "default"}] if state else []


async def fetch_gateway(base_url: str, client: httpx.AsyncClient | None = None,
                        admin_key: str | None = None) -> GatewayView:
    """The gateway's state and metrics; `admin_key` opens /admin/state once the gateway has keys."""
    url = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    view = GatewayView(url)
    own = client is None
    client = client or httpx.AsyncClient(timeout=TIMEOUT)
    try:
        state = await client.get(f"{url}/admin/state", headers=headers, timeout=TIMEOUT)
        state.raise_for_status()
        view.state = state.json()
        metrics = await client.get(f"{url}/metrics", timeout=TIMEOUT)
        metrics.raise_for_status()
        read_metrics(view, metrics.text)
    except (httpx.HTTPError, ValueError) as exc:
        view.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    finally:
        if own:
            await client.aclose()
    if not view.evictions and view.state:
        view.evictions = {k: int(v) for k, v in view.state.get("totals", {}).get("evictions", {}).items()}
    if not view.rejections and view.state:
        view.rejections = {k: int(v) for k, v in view.state.get("totals", {}).get("rejections", {}).items()}
    return view


def read_metrics(view: GatewayView, text: str) -> None:
    ttft: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == REJECTIONS:
                reason, band = s.labels.get("reason", "?"), s.labels.get("band", "?")
                view.rejections[reason] = view.rejections.get(reason, 0) + int(s.value)
                view.rejections_by_band.append((reason, band, int(s.value)))
            elif s.name == EVICTIONS:
                outcome = s.labels.get("outcome", "?")  # summed over the gateway's model pools
                view.evictions[outcome] = view.evictions.get(outcome, 0) + int(s.value)
            elif s.name == f"{TTFT}_bucket":
                le = float(s.labels["le"])
                by_le = ttft.setdefault(ttft_series_name(s.labels.get("objective", ""), s.labels.get("stream")), {})
                by_le[le] = by_le.get(le, 0.0) + s.value
    view.ttft = {objective: sorted(buckets.items()) for objective, buckets in ttft.items()}
    view.rejections_by_band.sort()


# A non-streamed answer's "first token" is the whole answer: its own series, named as such, never mixed into the
# streamed answers' time to first token.
WHOLE_ANSWER = " (whole answer)"


def ttft_series_name(objective: str, stream: str | None) -> str:
    return objective if stream in (None, "true") else objective + WHOLE_ANSWER


def ttft_objective(series: str) -> str:
    return series.removesuffix(WHOLE_ANSWER)


def ttft_buckets(text: str) -> dict[str, Buckets]:
    view = GatewayView("")
    read_metrics(view, text)
    return view.ttft


def quantile(q: float, current: Buckets, previous: Buckets | None = None) -> float | None:
    """The q-quantile of the observations between two scrapes of one histogram (Prometheus'
    histogram_quantile: linear within a bucket; the +Inf bucket answers its lower bound).

    With no previous scrape, or one from before a gateway restart (a count went down), the current
    counts are taken whole. None when nothing was observed in between."""
    counts = dict(current)
    if previous:
        before = dict(previous)
        if all(counts.get(le, 0.0) >= n for le, n in before.items()):
            counts = {le: n - before.get(le, 0.0) for le, n in counts.items()}
    bounds = sorted(counts)
    if not bounds:
        return None
    total = counts[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        if counts[le] >= rank:
            if math.isinf(le):
                return lower
            in_bucket = counts[le] - below
            return lower + (le - lower) * ((rank - below) / in_bucket if in_bucket > 0 else 1.0)
        lower, below = le, counts[le]
    return lower
