"""The models the gateway serves, which batch validation checks each line's `body.model` against.

`ServedModels.names()` asks `GET <gateway>/v1/models` (the gateway the workers use, with their key) and keeps
the answer for `refresh_seconds`. `KnownModels` is one batch's view of it: a name the kept list lacks is looked
for once more in a fresh list before a line is refused for it, so a model added a moment ago is not refused
from an old answer. When the gateway gives no list (refused, timed out, 401/403, 5xx, 503 while no replica is
healthy, a body without `data`), `ModelsUnavailable` says why and nothing is guessed: the batch stays
`validating` and is validated again once the gateway answers, asked at most every `retry_seconds`.

vLLM's `/v1/models` says which names a server answers to (its `--served-model-name` aliases and LoRA
adapters), not which endpoints each serves, so a line's endpoint is never checked against its model here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import ClassVar

import httpx

from holdback.logs import log_event

log = logging.getLogger("batch_processor.served_models")

REFRESH_SECONDS = 30.0
RETRY_SECONDS = 2.0
TIMEOUT_SECONDS = 5.0
# A kept list younger than this is fresh enough to refuse a line from without asking again.
CONFIRM_AGE_SECONDS = 1.0
# How many served names a line error lists before it says how many more there are.
LISTED_NAMES = 20


class ModelsUnavailable(Exception):
    """The gateway gave no model list; `reason` says what it answered instead."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def parse_model_list(body: object) -> frozenset[str]:
    """The `id`s of an OpenAI model list (`{"object": "list", "data": [{"id": ...}, ...]}`); ValueError when the
    body is not one, or names no model."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise ValueError("the answer has no `data` list")
    names = frozenset(card["id"] for card in data if isinstance(card, dict) and isinstance(card.get("id"), str)
                      and card["id"])
    if not names:
        raise ValueError("the list names no model")
    return names


class ServedModels:
    """The gateway's model list, kept for `refresh_seconds`; thread-safe (one processor, several batches)."""

    _shared: ClassVar[dict[tuple, "ServedModels"]] = {}
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, gateway_url: str, gateway_key: str | None = None, *, refresh_seconds: float = REFRESH_SECONDS,
                 retry_seconds: float = RETRY_SECONDS, timeout: float = TIMEOUT_SECONDS,
                 clock: Callable[[], float] = time.monotonic):
        self.url = gateway_url.rstrip("/") + "/v1/models"
        self.key = gateway_key
        self.refresh_seconds = refresh_seconds
        self.retry_seconds = retry_seconds
        self.timeout = timeout
        self.clock = clock
        self._lock = threading.Lock()
        self._names: frozenset[str] | None = None
        self._fetched_at = float("-inf")
        self._failure: ModelsUnavailable | None = None
        self._failed_at = float("-inf")

    @classmethod
    def shared(cls, gateway_url: str, gateway_key: str | None, refresh_seconds: float) -> "ServedModels":
        """The one list of this gateway in this process: every expansion that checks models asks the same."""
        with cls._shared_lock:
            key = (gateway_url, gateway_key, refresh_seconds)
            if key not in cls._shared:
                cls._shared[key] = cls(gateway_url, gateway_key, refresh_seconds=refresh_seconds)
            return cls._shared[key]

    def names(self, max_age: float | None = None) -> frozenset[str]:
        """The served names, from a list at most `max_age` (default `refresh_seconds`) old; ModelsUnavailable
        when the gateway gave none (asked again only once `retry_seconds` have passed)."""
        max_age = self.refresh_seconds if max_age is None else max_age
        with self._lock:
            now = self.clock()
            if self._names is not None and now - self._fetched_at <= max_age:
                return self._names
            if self._failure is not None and now - self._failed_at < self.retry_seconds:
                raise self._failure
            try:
                names = self._fetch()
            except ModelsUnavailable as exc:
                if self._failure is None:
                    log_event(log, "models_unavailable", level=logging.WARNING, url=self.url, reason=exc.reason,
                              retry_in_s=self.retry_seconds)
                self._names, self._failure, self._failed_at = None, exc, self.clock()
                raise
            if self._failure is not None or names != self._names:
                log_event(log, "models_served", url=self.url, models=sorted(names))
            self._names, self._fetched_at, self._failure = names, self.clock(), None
            return names

    def _fetch(self) -> frozenset[str]:
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        try:
            resp = httpx.get(self.url, headers=headers, timeout=self.timeout)
        except httpx.HTTPError as exc:
            raise ModelsUnavailable(f"{type(exc).__name__}: {exc}") from None
        if resp.status_code != 200:
            hint = " (check HOLDBACK_GATEWAY_KEY)" if resp.status_code in (401, 403) else ""
            raise ModelsUnavailable(f"HTTP {resp.status_code}{hint}: {resp.text[:200]}")
        try:
            return parse_model_list(resp.json())
        except ValueError as exc:
            raise ModelsUnavailable(f"not a model list ({exc}): {resp.text[:200]}") from None


class KnownModels:
    """One batch's check of its lines' models: `model in known` (ModelsUnavailable when the gateway stops
    answering a second look). A name the kept list lacks is looked for in a list no older than
    `CONFIRM_AGE_SECONDS` before it is called unknown; each name is decided once per batch."""

    def __init__(self, served: ServedModels):
        self.served = served
        self.names = served.names()
        self._verdicts: dict[str, bool] = {}

    def __contains__(self, model: str) -> bool:
        if model in self.names:
            return True
        verdict = self._verdicts.get(model)
        if verdict is None:
            self.names = self.served.names(max_age=CONFIRM_AGE_SECONDS)
            verdict = self._verdicts[model] = model in self.names
        return verdict

    def listing(self) -> str:
        """The served names for a message: sorted, the first `LISTED_NAMES` of them and how many more."""
        names = sorted(self.names)
        shown = ", ".join(names[:LISTED_NAMES])
        return shown + (f" and {len(names) - LISTED_NAMES} more" if len(names) > LISTED_NAMES else "")
