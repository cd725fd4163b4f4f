"""Whether this processor reaches the gateway it hands work to (`HOLDBACK_GATEWAY_URL`, the workers' too).

`GatewayReach.failure()` is None while the gateway answers `GET /health` (its liveness; vLLM answers it too),
else what failed, naming the URL. While it fails the processor claims no batch (one it took could only wait in
`validating`, where a processor that reaches the gateway would run it) and its /readyz says why; the batches it
already holds carry on. The gateway is asked at most every `ok_seconds` while it answers and every
`retry_seconds` while it does not, by a probe of its own thread, so a round never waits on a slow gateway.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import httpx

from holdback.logs import log_event

log = logging.getLogger("batch_processor.gateway_reach")

PROBE_PATH = "/health"
TIMEOUT_SECONDS = 2.0
OK_SECONDS = 5.0
RETRY_SECONDS = 1.0


class GatewayReach:
    """The last answer of the gateway at `gateway_url`; thread-safe (the round and the /readyz probe ask it).
    `gateway_url` None: no gateway is checked (a processor run without one on purpose), `failure()` is None."""

    def __init__(self, gateway_url: str | None, *, timeout: float = TIMEOUT_SECONDS, ok_seconds: float = OK_SECONDS,
                 retry_seconds: float = RETRY_SECONDS, clock: Callable[[], float] = time.monotonic):
        self.url = gateway_url.rstrip("/") if gateway_url else None
        self.timeout = timeout
        self.ok_seconds = ok_seconds
        self.retry_seconds = retry_seconds
        self.clock = clock
        self._lock = threading.Lock()
        self._answered = threading.Event()
        self._failure: str | None = None
        self._checked_at: float | None = None
        self._probing = False

    def failure(self) -> str | None:
        """None if the gateway answered the last probe, else what failed. The first call waits for its probe;
        later ones answer at once, starting a new probe in the background once the answer is stale."""
        if self.url is None:
            return None
        with self._lock:
            first = self._checked_at is None
            age = float("inf") if first else self.clock() - self._checked_at
            start = not self._probing and age >= (self.retry_seconds if self._failure else self.ok_seconds)
            self._probing = self._probing or start
        if start and first:
            self._record(self._probe())
        elif start:
            threading.Thread(target=lambda: self._record(self._probe()), name="gateway-reach", daemon=True).start()
        elif first:
            self._answered.wait(self.timeout + 1)  # another caller runs the first probe
        return self._failure

    def _probe(self) -> str | None:
        try:
            answer = httpx.get(self.url + PROBE_PATH, timeout=self.timeout)
        except Exception as exc:  # noqa: BLE001 - a bad URL too: every failure is an answer, never an exception
            failed = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        else:
            # Any answer below 500 is the gateway's own (a server with no /health answers 404); 5xx is a proxy
            # in front of it, or a gateway failing.
            if answer.status_code < 500:
                return None
            failed = f"HTTP {answer.status_code}"
        return (f"the gateway at {self.url} (HOLDBACK_GATEWAY_URL) is not reached: GET {PROBE_PATH} failed with "
                f"{failed}; no new batch is claimed until it answers")

    def _record(self, failure: str | None) -> None:
        with self._lock:
            before = self._failure
            self._failure, self._checked_at, self._probing = failure, self.clock(), False
        self._answered.set()
        if failure is not None and before is None:
            log_event(log, "gateway_unreachable", level=logging.WARNING, url=self.url, reason=failure,
                      retry_in_s=self.retry_seconds)
        elif failure is None and before is not None:
            log_event(log, "gateway_reachable", url=self.url)
