"""Simulator replicas served in-process on a free port, from a background event-loop thread.

Tests talk to them only over HTTP, as a gateway would, and read internal state from
/admin/state and /metrics.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
from typing import Callable, Iterator

import httpx
import pytest

from model_sim.config import EngineConfig, SimConfig
from model_sim.faults import FaultSettings
from model_sim.replica import SimReplica
from model_sim.timing import TimingModel


class SimServer:
    def __init__(self, config: SimConfig):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="sim-loop", daemon=True)
        self.thread.start()

        async def start() -> tuple[SimReplica, int]:
            replica = SimReplica(config)
            return replica, await replica.start("127.0.0.1", 0)

        self.replica, self.port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(base_url=self.url, timeout=30.0)

    def state(self, blocks: bool = False) -> dict:
        r = self.http.get("/admin/state", params={"blocks": "1"} if blocks else None)
        r.raise_for_status()
        return r.json()

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.http.get("/metrics").text)

    def raw_request(self, path: str, body: bytes) -> socket.socket:
        """Send a POST on a raw socket so the test decides when the client disconnects."""
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        return sock

    def close(self) -> None:
        self.http.close()
        asyncio.run_coroutine_threadsafe(self.replica.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


_SAMPLE = re.compile(r'^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$')


_COMMON_LABELS = re.compile(r'(engine="0"|model_name="sim-model"),?')


def parse_metrics(text: str) -> dict[str, float]:
    """name{labels} -> value, without the `engine="0"` and `model_name` labels every series carries."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.groups()
        labels = _COMMON_LABELS.sub("", labels or "").replace(",}", "}")
        key = name if labels in ("", "{}") else name + labels
        out[key] = float(value)
    return out


def sim_config(*, timing: TimingModel | None = None, faults: FaultSettings | None = None, **engine) -> SimConfig:
    base = dict(num_blocks=4096)
    base.update(engine)
    extra = {k: base.pop(k) for k in ("model", "default_max_tokens", "output_length_mode", "seed", "runner",
                                      "api_key", "enable_prompt_tokens_details", "responses_store") if k in base}
    return SimConfig(
        engine=EngineConfig(**base),
        timing=timing if timing is not None else TimingModel.zero(),
        faults=faults or FaultSettings(),
        **extra,
    )


def slow(decode_ms: float = 20.0, prefill_ms: float = 0.0) -> TimingModel:
    """Steps slow enough to observe a request mid-flight, fast enough for the suite's budget."""
    return TimingModel(step_overhead_ms=1.0, prefill_ms_per_token=prefill_ms, decode_base_ms=decode_ms,
                       decode_ms_per_seq=0.0)


@pytest.fixture
def start_sim() -> Iterator[Callable[..., SimServer]]:
    servers: list[SimServer] = []

    def start(config: SimConfig | None = None, **kwargs) -> SimServer:
        server = SimServer(config or sim_config(**kwargs))
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


@pytest.fixture
def sim(start_sim) -> SimServer:
    return start_sim()

