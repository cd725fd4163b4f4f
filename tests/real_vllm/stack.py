"""holdback's components in front of real vLLM servers, started as `holdback up` starts them.

One gateway (with the test's YAML), the API, the processor and one worker, on the test's backend; the
replicas are the vLLM servers the test brings. Timings are shortened (backoff, heartbeats) so that a retry
takes a second, not a minute.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import httpx
import openai
from sqlalchemy import func, select

from holdback.db import make_engine, make_sessionmaker
from holdback.models import Attempt, RequestRow
from tests.real_vllm.conftest import PRIORITIES
from tests.support import Processes, free_port, poll, wait_http

BATCH_KEY, REALTIME_KEY = "hb-real-batch-gateway-key", "hb-real-realtime-key"
WORKER_FAST = ["--backoff-base", "0.2", "--backoff-cap", "2", "--heartbeat-ttl", "6", "--scheduler-interval", "0.05",
               "--drain-timeout", "2"]
PROCESSOR_FAST = ["--poll-interval", "0.1", "--reconcile-interval", "1", "--reconcile-grace", "2",
                  "--running-grace", "4"]
TERMINAL = {"completed", "failed", "expired", "cancelled"}
KEYS = """
adminKeys: [{key_env: HOLDBACK_ADMIN_KEY}]
keys:
  - {key_env: HOLDBACK_GATEWAY_REALTIME_KEY, tenant: realtime, objectives: [realtime, standard, batch], defaultObjective: realtime}
  - {key_env: HOLDBACK_GATEWAY_BATCH_KEY, tenant: batch, objectives: [batch], relaysTenants: true}
anonymous: {enabled: false}
"""


class RealStack:
    def __init__(self, backend, tmp_path: Path, replicas: list[str], *, gateway_config: str = "", keys: str = KEYS,
                 worker_args: tuple[str, ...] = (), gateway_env: dict[str, str] | None = None):
        self.backend = backend
        self.replicas = replicas
        self.gateway_url = f"http://127.0.0.1:{free_port()}"
        self.api_url = f"http://127.0.0.1:{free_port()}"
        env = {**backend.env, "HOLDBACK_GATEWAY_URL": self.gateway_url, "HOLDBACK_GATEWAY_KEY": BATCH_KEY,
               "HOLDBACK_GATEWAY_BATCH_KEY": BATCH_KEY, "HOLDBACK_GATEWAY_REALTIME_KEY": REALTIME_KEY}
        self.procs = Processes(env=env, log_dir=tmp_path / "logs", nice=PRIORITIES.stack_nice)
        self.config_path = tmp_path / "gateway.yaml"
        self.config_path.write_text(keys + gateway_config)
        self.gateway_env = gateway_env or {}
        api = self.procs.start("api", "--port", self.api_url.rsplit(":", 1)[1], name="api")
        self.processor = self.procs.start("processor", *PROCESSOR_FAST, name="processor")
        self.worker = self.procs.start("worker", "-n", "16", *WORKER_FAST, *worker_args, name="worker")
        self.gateway = self.start_gateway()
        wait_http(f"{self.api_url}/readyz", timeout=60, proc=api)
        key = httpx.post(f"{self.api_url}/admin/keys", json={"tenant": "real"},
                         headers={"Authorization": f"Bearer {backend.admin_key}"}, timeout=10)
        key.raise_for_status()
        self.client = openai.OpenAI(base_url=f"{self.api_url}/v1", api_key=key.json()["key"], max_retries=5)
        self.db = make_sessionmaker(make_engine(backend.database_url))

    def start_gateway(self):
        proc = self.procs.start("gateway", "--port", self.gateway_url.rsplit(":", 1)[1], "--replicas",
                                ",".join(self.replicas), "--config", str(self.config_path), name="gateway",
                                env=self.gateway_env)
        wait_http(f"{self.gateway_url}/health", timeout=60, proc=proc)
        return proc

    def close(self) -> None:
        self.procs.close()
        self.db.kw["bind"].dispose()

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{self.procs.log(n)}" for n in ("gateway", "worker", "processor"))

    # -- the gateway --------------------------------------------------------------------------------------

    def state(self) -> dict:
        r = httpx.get(f"{self.gateway_url}/admin/state", timeout=10,
                      headers={"Authorization": f"Bearer {self.backend.admin_key}"})
        r.raise_for_status()
        return r.json()

    def wait_identified(self, timeout: float = 60.0) -> list[dict]:
        """Wait until the gateway has read every replica's served model from `/v1/models`."""
        def identified():
            replicas = self.state().get("replicas") or []
            return replicas if replicas and all(r.get("model") and r.get("healthy") for r in replicas) else None
        return poll(identified, timeout, "the gateway to identify its replicas",
                    lambda: json.dumps(self.state().get("replicas")))

    def realtime(self, path: str, body: dict, **kw) -> httpx.Response:
        return httpx.post(f"{self.gateway_url}{path}", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {REALTIME_KEY}"}, **kw)

    # -- batches --------------------------------------------------------------------------------------------

    def submit(self, lines: list[dict], endpoint: str = "/v1/chat/completions", window: str = "24h") -> str:
        data = "\n".join(json.dumps(line) for line in lines).encode()
        f = self.client.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch")
        return self.client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window=window).id

    def wait(self, batch_id: str, timeout: float = 240.0, until=lambda b: b.status in TERMINAL):
        return poll(lambda: (lambda b: b if until(b) else None)(self.client.batches.retrieve(batch_id)), timeout,
                    f"batch {batch_id}", lambda: f"{self.client.batches.retrieve(batch_id)}\n{self.logs()}",
                    interval=0.3)

    def lines(self, file_id: str | None) -> dict[str, dict]:
        if file_id is None:
            return {}
        text = self.client.files.content(file_id).text
        return {line["custom_id"]: line for line in map(json.loads, filter(None, text.splitlines()))}

    def attempts(self, batch_id: str) -> list[Attempt]:
        with self.db() as s:
            return list(s.scalars(select(Attempt).where(Attempt.batch_id == batch_id)
                                  .order_by(Attempt.request_id, Attempt.number)))

    def outcomes(self, batch_id: str) -> dict[str, int]:
        with self.db() as s:
            return dict(s.execute(select(Attempt.outcome, func.count()).where(Attempt.batch_id == batch_id)
                                  .group_by(Attempt.outcome)).all())

    def rows(self, batch_id: str) -> list[RequestRow]:
        with self.db() as s:
            return list(s.scalars(select(RequestRow).where(RequestRow.batch_id == batch_id)))


def chat(custom_id: str, content: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": content}], **body}}


def completion(custom_id: str, prompt, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": prompt, **body}}
