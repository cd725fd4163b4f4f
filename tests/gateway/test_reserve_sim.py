"""The adaptive reserve over real HTTP: one simulator replica, one gateway, both `holdback` subprocesses.

The batch band's ceiling must rise while realtime is idle, fall as soon as realtime arrives (eviction making
room for the requests the forecast did not foresee) and climb back once realtime has left.
"""

from __future__ import annotations

import asyncio

import httpx

from tests.gateway.test_gateway_sim import body, obj, wait_until

CONFIG = """saturation: {maxConcurrency: 8}
usageLimit:
  policy: adaptive-reserve
  minCeiling: 0.25
  adaptive: {margin: 0.125, halfLifeSeconds: 0.5, peakWindowSeconds: 1}
"""


def test_batch_ceiling_follows_realtime_demand(stack):
    sims = stack.sim(1)
    gw = stack.gateway(sims, CONFIG)

    def batch_ceiling() -> float:
        return gw.state()["holdback"]["ceilings"]["-10"]

    async def main():
        async with httpx.AsyncClient(base_url=gw.url, timeout=120) as client:
            batch = [asyncio.create_task(client.post("/v1/completions", json=body(3000), headers=obj("batch")))
                     for _ in range(10)]
            # Realtime idle: batch may use all but the margin, 7 of 8 slots.
            idle = await wait_until(lambda: (s := gw.state())["holdback"]["ceilings"]["-10"] == 0.875
                                    and (b := _band(s, -10))["in_flight"] == 7 and b["queued"] == 3 and s, 30,
                                    what=lambda: _seen(gw.state()))
            realtime = [asyncio.create_task(client.post("/v1/completions", json=body(3000), headers=obj("realtime")))
                        for _ in range(4)]
            # Four realtime requests are half the pool: the ceiling falls to 1 − 0.5 − 0.125 at once, and
            # eviction frees the slots batch held beyond what was left.
            busy = await wait_until(lambda: (s := gw.state())["holdback"]["ceilings"]["-10"] == 0.375
                                    and _band(s, 100)["in_flight"] == 4 and s, 30, what=lambda: _seen(gw.state()))
            for t in realtime:
                t.cancel()
            await asyncio.gather(*realtime, return_exceptions=True)
            # The callers left: the gateway sees each connection close and ends its request. (Two of them once
            # stayed until the replica answered them: their cancellations met their replica connections opening,
            # and Python 3.11's wait_for dropped them; tests/gateway/test_cancel_meets_completion.py.)
            await wait_until(lambda: gw.band(100)["in_flight"] == 0, 30, what=lambda: _seen(gw.state()))
            # Realtime gone: after the peak window the average decays and batch refills to 7.
            recovered = await wait_until(lambda: batch_ceiling() >= 0.85 and gw.band(-10)["in_flight"] == 7, 60,
                                         what=lambda: _seen(gw.state()))
            metrics = (await client.get("/metrics")).text
            for t in batch:
                t.cancel()
            await asyncio.gather(*batch, return_exceptions=True)
        return idle, busy, recovered, metrics

    idle, busy, recovered, metrics = asyncio.run(main())
    assert idle["holdback"]["policy"] == "adaptive-reserve"
    assert idle["holdback"]["forecast"]["forecast"] == 0.0
    assert busy["holdback"]["forecast"]["forecast"] >= 0.5
    assert busy["totals"]["evictions"]["issued"] >= 3  # 7 batch + 4 realtime > 8 slots
    # Batch holds at most what realtime left; the queued batch stayed queued above its ceiling.
    assert _band(busy, -10)["in_flight"] <= 4 and _band(busy, -10)["queued"] == 3, _band(busy, -10)
    assert recovered is True
    assert 'holdback_gateway_reserve_demand{pool="default",reading="forecast"}' in metrics
    assert 'holdback_gateway_band_ceiling{band="-10",pool="default"}' in metrics


def _seen(state: dict) -> str:
    """The figures this test waits on, for its failure message."""
    bands = {b["priority"]: {k: b[k] for k in ("in_flight", "queued")} for b in state["bands"]}
    return f"ceilings {state['holdback']['ceilings']}, forecast {state['holdback'].get('forecast')}, bands {bands}"


def _band(state: dict, priority: int) -> dict:
    return next(b for b in state["bands"] if b["priority"] == priority)
