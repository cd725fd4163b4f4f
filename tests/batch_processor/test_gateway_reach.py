"""A processor that cannot reach its gateway claims no batch and says so on /readyz, naming the URL and what
failed; once the gateway answers it claims again, and what it held meanwhile (a batch being expanded, a running
one) carries on. The gateway here is a real HTTP server on a real port, stopped and started; the process itself,
readiness over HTTP included, is in test_processor_cli.py."""

from __future__ import annotations

import time

from batch_processor.gateway_reach import GatewayReach
from batch_processor.health import probes
from tests.batch_processor.test_processor_support import Harness, ReadHooks, StandInGateway, chat, jsonl
from tests.support import free_port, poll


def _tick_until(processor, predicate, timeout: float, what: str):  # noqa: ANN001
    """Run rounds until one satisfies `predicate`; return it."""
    def round_that_did():  # noqa: ANN202
        done = processor.tick()
        return done if predicate(done) else None
    return poll(round_that_did, timeout, what)


def _readiness(processor) -> tuple[int, dict]:  # noqa: ANN001
    """What the processor's /readyz answers (holdback.probes.serve): liveness and readiness checks."""
    checks = probes(processor)
    return checks.report({**checks.live, **checks.ready})


def test_no_batch_is_claimed_while_the_gateway_is_not_reached_and_none_held_is_lost(backend):
    gateway = StandInGateway(free_port())
    harness = Harness(backend)
    reach = GatewayReach(gateway.url, ok_seconds=0.05, retry_seconds=0.05)
    p = harness.processor(gateway=reach, window=4)
    try:
        first = harness.submit(jsonl([chat(i) for i in range(10)]))
        # Nothing listens: the round claims nothing, and readiness names the gateway and what failed.
        assert p.tick().claimed == []
        assert harness.batch(first).claimed_by is None and harness.batch(first).status == "validating"
        status, body = _readiness(p)
        reason = body["checks"]["gateway"]
        assert status == 503 and gateway.url in reason and "ConnectError" in reason, body
        assert "no new batch is claimed" in reason and "HOLDBACK_GATEWAY_URL" in reason

        # It answers: the batch is claimed. The gateway goes again while its input is being read: the
        # expansion it had begun finishes, every line a row.
        def gateway_goes() -> None:
            gateway.stop()
            poll(lambda: reach.failure() is not None, 10, "the processor seeing the gateway gone")

        p.store = ReadHooks(harness, {5: gateway_goes})
        gateway.start()
        done = _tick_until(p, lambda r: first in r.claimed, 10, "the batch claimed once the gateway answers")
        p.store = harness.store
        assert done.expanded == [first] and harness.batch(first).status == "in_progress"
        assert len(harness.rows(first)) == 10 and len(harness.queued_job_ids()) == 4

        # Still down: a new batch waits unclaimed, the running one keeps being fed and finishes.
        second = harness.submit(jsonl([chat(i) for i in range(3)]))
        for _ in range(3):
            for row_id in harness.queued_job_ids():
                harness.succeed(row_id)
            done = p.tick()
            assert done.claimed == [] and harness.batch(second).claimed_by is None
        assert done.finished == {first: "completed"}, done
        assert _readiness(p)[0] == 503

        # Back: it claims the waiting batch and is ready again.
        gateway.start()
        _tick_until(p, lambda r: second in r.claimed, 10, "the waiting batch claimed once the gateway is back")
        assert harness.batch(second).status == "in_progress"
        assert _readiness(p) == (200, {"status": "ok", "checks": {"main_loop": "ok", "database": "ok", "redis": "ok",
                                                                   "gateway": "ok"}})
    finally:
        gateway.stop()
        harness.close()


def test_the_gateway_is_asked_at_most_once_an_interval_and_a_slow_one_never_holds_a_round():
    gateway = StandInGateway(free_port()).start()
    now = [0.0]
    reach = GatewayReach(gateway.url, timeout=0.5, ok_seconds=5, retry_seconds=1, clock=lambda: now[0])
    try:
        assert all(reach.failure() is None for _ in range(50)) and gateway.asked == 1
        # Stale: the next call answers at once from the last probe while a new one waits on a gateway that
        # does not answer in time; once that one has timed out, the failure is the answer.
        gateway.release.clear()
        now[0] = 5.0
        started = time.monotonic()
        assert reach.failure() is None and time.monotonic() - started < 0.3
        reason = poll(reach.failure, 10, "the slow probe's timeout")
        assert "ReadTimeout" in reason and gateway.url in reason
        gateway.release.set()
        # A failing gateway is asked again sooner (retry_seconds); it answers, and is reached again.
        now[0] = 6.0
        reach.failure()
        poll(lambda: reach.failure() is None, 10, "the gateway reached again")
    finally:
        gateway.stop()


def test_an_answer_of_the_gateways_own_counts_and_a_5xx_does_not():
    for status, reached in ((200, True), (404, True), (401, True), (502, False), (503, False)):
        gateway = StandInGateway(free_port(), status=status).start()
        try:
            failure = GatewayReach(gateway.url).failure()
        finally:
            gateway.stop()
        assert (failure is None) is reached, (status, failure)
        if not reached:
            assert f"HTTP {status}" in failure and gateway.url in failure
    assert GatewayReach(None).failure() is None  # a processor run without a gateway on purpose
    # A URL no request can be made to fails the same way (not with an exception), naming the setting to fix.
    for url, failed in (("gateway:8200", "UnsupportedProtocol"), ("http://[::1", "InvalidURL")):
        failure = GatewayReach(url).failure()
        assert "HOLDBACK_GATEWAY_URL" in failure and failed in failure, failure
