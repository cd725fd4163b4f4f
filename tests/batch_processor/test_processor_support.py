"""Shared setup for the processor tests (no tests here): batches written straight into the
database and the file store, the real processor driven one round at a time, and the worker's
side of a request played through `holdback.results` (the functions the worker itself calls).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterator

import pytest
from rq.job import Job
from sqlalchemy import select

from batch_processor.gateway_reach import GatewayReach
from batch_processor.jobqueue import RequestQueue
from batch_processor.processor import Processor
from batch_processor.processor_config import ProcessorConfig
from holdback.attempts.transactions import begin_attempt
from holdback.db import make_engine, make_sessionmaker, transaction
from holdback.models import Batch, File, RequestRow, RequestStatus, new_id
from holdback.results import FinalResult, TokenUsage, record_final
from holdback.storage import open_file_store
from holdback.tenancy import get_or_create_tenant

ENDPOINT = "/v1/chat/completions"


def chat(i: int, model: str = "m1", **body) -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": ENDPOINT,
            "body": {"model": model, "messages": [{"role": "user", "content": f"hello {i}"}], **body}}


def jsonl(items) -> bytes:
    out = []
    for item in items:
        if isinstance(item, bytes):
            out.append(item)
        elif isinstance(item, str):
            out.append(item.encode())
        else:
            out.append(json.dumps(item).encode())
    return b"".join(line + b"\n" for line in out)


class Harness:
    def __init__(self, backend, **settings):
        self.backend = backend
        # These tests' lines name models no gateway serves; the model check has its own tests
        # (tests/batch_processor/test_served_models.py).
        settings.setdefault("validate_models", False)
        self.settings = backend.settings(**settings)
        self.engine = make_engine(self.settings.sqlalchemy_url)
        self.factory = make_sessionmaker(self.engine)
        self.store = open_file_store(self.settings)
        self.redis = backend.redis()
        self.queue = RequestQueue(self.redis, self.settings.redis_namespace)
        self.processors: list[Processor] = []

    def submit(self, content: bytes, *, tenant: str = "t1", endpoint: str = ENDPOINT,
               expires_in: float = 86400, status: str = "validating") -> str:
        """Upload `content` as a batch input file and create a batch over it, as the API does."""
        file_id = new_id("file-")
        with self.store.open_writer(file_id) as writer:
            writer.write(content)
            size = writer.commit()
        now = int(time.time())
        with transaction(self.factory) as s:
            t = get_or_create_tenant(s, tenant)
            s.add(File(id=file_id, tenant_id=t.id, filename="input.jsonl", purpose="batch", bytes=size,
                       storage_key=file_id))
            batch = Batch(tenant_id=t.id, endpoint=endpoint, input_file_id=file_id, completion_window="24h",
                          window_seconds=86400, status=status, created_at=now, expires_at=int(now + expires_in))
            s.add(batch)
            s.flush()
            return batch.id

    def processor(self, gateway: GatewayReach | None = None, **config) -> Processor:
        """A processor of these settings; it claims without asking a gateway unless `gateway` is given (these
        tests run none; tests/batch_processor/test_gateway_reach.py has a gateway come and go)."""
        config.setdefault("name", f"p{len(self.processors)}")
        config.setdefault("reconcile_interval", 3600.0)  # tests reconcile explicitly
        # One tick does every batch's whole-batch step (the round budget's own tests set theirs): on a loaded machine
        # one batch's validation outlasted the default second, and the next batch waited for the next round.
        config.setdefault("round_work_seconds", 600.0)
        p = Processor(self.settings, ProcessorConfig(**config), factory=self.factory,
                      connection=self.backend.redis(), store=self.store, gateway=gateway or GatewayReach(None))
        self.processors.append(p)
        return p

    def batch(self, batch_id: str) -> Batch:
        with self.factory() as s:
            return s.get(Batch, batch_id)

    def rows(self, batch_id: str) -> list[RequestRow]:
        with self.factory() as s:
            return list(s.scalars(select(RequestRow).where(RequestRow.batch_id == batch_id).order_by(RequestRow.line)))

    def set_batch(self, batch_id: str, **values) -> None:
        with transaction(self.factory) as s:
            batch = s.get(Batch, batch_id)
            for k, v in values.items():
                setattr(batch, k, v)

    def take_job(self, row_id: str) -> None:
        """A worker dequeued the row's job (and, with result_ttl=0, its hash goes when it finishes)."""
        self.redis.lrem(self.queue.queue.key, 0, row_id)
        self.redis.delete(Job.key_for(row_id))

    def succeed(self, row_id: str, tokens: int = 3, content: str = "hi") -> None:
        """What a worker does for a 200: take the job, open the attempt, then the compare-and-set."""
        self.take_job(row_id)
        with transaction(self.factory) as s:
            begin_attempt(s, row_id, "test-worker")
            body = {"id": "x", "choices": [{"message": {"content": content}}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": tokens}}
            assert record_final(s, row_id, FinalResult(RequestStatus.succeeded, 200, body, usage=TokenUsage(5, tokens)))

    def fail(self, row_id: str, status: int = 400) -> None:
        self.take_job(row_id)
        with transaction(self.factory) as s:
            begin_attempt(s, row_id, "test-worker")
            body = {"error": {"message": "bad request", "type": "invalid_request_error", "param": None, "code": None}}
            assert record_final(s, row_id, FinalResult(RequestStatus.failed, status, body))

    def queued_job_ids(self) -> list[str]:
        return [x.decode() for x in self.redis.lrange(self.queue.queue.key, 0, -1)]

    def read_file(self, file_id: str) -> list[dict]:
        with self.factory() as s:
            f = s.get(File, file_id)
        with self.store.open_read(f.storage_key) as fh:
            return [json.loads(line) for line in fh]

    def file_digest(self, file_id: str) -> str:
        with self.factory() as s:
            key = s.get(File, file_id).storage_key
        return hashlib.sha256(b"".join(self.store.iter_chunks(key))).hexdigest()

    def close(self) -> None:
        for p in self.processors:
            p.handoff.close(drain_timeout=1)
        # RQ's job hashes live under rq:job:<row id>, outside the test namespace: remove ours.
        with self.factory() as s:
            ids = list(s.scalars(select(RequestRow.id)))
        for start in range(0, len(ids), 1000):
            self.redis.delete(*(Job.key_for(i) for i in ids[start:start + 1000]))
        self.engine.dispose()


@pytest.fixture
def harness(backend) -> Iterator[Harness]:
    h = Harness(backend)
    try:
        yield h
    finally:
        h.close()


class ReadHooks:
    """The harness's store, whose input files call `hooks[n]()` (in the reading thread) before line n is read:
    to do something while the processor is part-way through a file."""

    def __init__(self, harness: Harness, hooks: dict[int, Callable[[], None]]):
        self.harness, self.hooks = harness, hooks

    def __getattr__(self, name: str):
        return getattr(self.harness.store, name)

    @contextmanager
    def open_read(self, key: str):
        with self.harness.store.open_read(key) as fh:
            yield self._lines(fh)

    def _lines(self, fh):
        for n, line in enumerate(fh, start=1):
            if n in self.hooks:
                self.hooks[n]()
            yield line


class StandInGateway:
    """A real HTTP server on `port` that answers `GET /health` with `status` (404 elsewhere), started and stopped
    at will: the gateway a processor checks before it claims. While `release` is clear, answers wait for it."""

    def __init__(self, port: int, status: int = 200):
        self.port, self.status = port, status
        self.url = f"http://127.0.0.1:{port}"
        self.asked = 0
        self.release = threading.Event()
        self.release.set()
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> "StandInGateway":
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server hook's name
                stand_in.asked += 1
                stand_in.release.wait(30)
                self.send_response(stand_in.status if self.path == "/health" else 404)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="stand-in-gateway", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self.release.set()
            self._server.shutdown()
            self._server.server_close()
            self._server = None
