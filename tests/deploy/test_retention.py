"""Retention: OpenAI's default expiry on uploads, refusing to delete a file a running batch needs, and the
collector deleting expired bytes and old rows in bounded batches, on local disk and on S3."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
from sqlalchemy import select

from bench.lib import forkserver
from holdback.db import make_engine, make_sessionmaker, transaction
from holdback.models import Batch, File
from holdback.retention import DEFAULT_FILE_TTL, FileCollector
from holdback.storage import open_file_store
from holdback.tenancy import get_or_create_tenant
from tests.batch_api.conftest import serve
from tests.batch_processor.test_processor_support import chat, jsonl


@pytest.fixture(params=["local", "s3"])
def store_settings(request, s3_server) -> dict:  # noqa: ANN001
    """Each retention test runs on both file stores."""
    if request.param == "local":
        return {}
    env = s3_server.env(s3_server.bucket())
    return {name.removeprefix("HOLDBACK_").lower(): value for name, value in env.items()}


def test_uploads_get_openai_default_expiry_and_in_use_inputs_cannot_be_deleted(backend, store_settings) -> None:  # noqa: ANN001
    server = serve(backend.settings(**store_settings))
    try:
        key = server.create_key("acme")
        client = server.openai(key)
        batch_input = client.files.create(file=("in.jsonl", jsonl([chat(1)])), purpose="batch")
        assert batch_input.expires_at == batch_input.created_at + DEFAULT_FILE_TTL
        kept = client.files.create(file=("notes.txt", b"keep me"), purpose="user_data")
        assert kept.expires_at is None
        short = client.files.create(file=("in.jsonl", jsonl([chat(2)])), purpose="batch",
                                    extra_body={"expires_after": {"anchor": "created_at", "seconds": 3600}})
        assert short.expires_at == short.created_at + 3600

        batch = client.batches.create(input_file_id=batch_input.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        with server.http(key) as http:
            refused = http.delete(f"/v1/files/{batch_input.id}")
            assert refused.status_code == 400
            error = refused.json()["error"]
            assert error["code"] == "file_in_use" and error["param"] == "file_id" and batch.id in error["message"]
            assert "cancel" in error["message"]
            assert http.get(f"/v1/files/{batch_input.id}/content").content == jsonl([chat(1)])
            with make_sessionmaker(server.server.config.app.state.context.engine)() as s, s.begin():
                s.get(Batch, batch.id).status = "cancelled"
            assert http.delete(f"/v1/files/{batch_input.id}").json()["deleted"] is True
        assert not server.server.config.app.state.context.store.exists(batch_input.id)
    finally:
        server.stop()


def _add_file(factory, store, tenant_id: str, file_id: str, *, expires_at: int | None,  # noqa: ANN001
              deleted_at: int | None = None) -> None:
    with store.open_writer(file_id) as writer:
        writer.write(b'{"x": 1}\n')
        writer.commit()
    with transaction(factory) as s:
        s.add(File(id=file_id, tenant_id=tenant_id, filename="f.jsonl", purpose="batch", bytes=9,
                   created_at=0, expires_at=expires_at, deleted_at=deleted_at, storage_key=file_id))


def test_collector_deletes_expired_bytes_then_old_rows_in_bounded_batches(backend, store_settings) -> None:  # noqa: ANN001
    settings = backend.settings(**store_settings)
    engine = make_engine(settings.sqlalchemy_url)
    factory = make_sessionmaker(engine)
    store = open_file_store(settings)
    now = int(time.time())
    try:
        with transaction(factory) as s:
            tenant = get_or_create_tenant(s, "acme").id
        for i in range(5):
            _add_file(factory, store, tenant, f"file-old{i}", expires_at=now - 10)
        _add_file(factory, store, tenant, "file-fresh", expires_at=now + 3600)
        _add_file(factory, store, tenant, "file-forever", expires_at=None)
        _add_file(factory, store, tenant, "file-busy", expires_at=now - 10)
        _add_file(factory, store, tenant, "file-gone", expires_at=None, deleted_at=now - 100)
        with transaction(factory) as s:
            s.add(Batch(id="batch_busy", tenant_id=tenant, endpoint="/v1/chat/completions",
                        input_file_id="file-busy", completion_window="24h", window_seconds=86400,
                        status="in_progress", created_at=now, expires_at=now + 86400))

        collector = FileCollector(factory, store, grace_seconds=50, batch_size=2, max_batches=2)
        first = collector.run(now)
        assert (first.expired, first.purged) == (4, 1)  # two batches of two; the run stops there
        second = collector.run(now)
        assert (second.expired, second.kept_in_use) == (1, 1)
        assert collector.metrics.files_expired._value.get() == 5
        assert collector.metrics.rows_purged._value.get() == 1
        with factory() as s:
            live = set(s.scalars(select(File.id).where(File.deleted_at.is_(None))))
            rows = set(s.scalars(select(File.id)))
        assert live == {"file-fresh", "file-forever", "file-busy"}
        assert "file-gone" not in rows and "file-old0" in rows  # expired rows wait out the grace period
        for file_id in ("file-fresh", "file-forever", "file-busy"):
            assert store.exists(file_id)
        for i in range(5):
            assert not store.exists(f"file-old{i}")

        with transaction(factory) as s:
            s.get(Batch, "batch_busy").status = "completed"
        env = {**os.environ, **backend.env, **{f"HOLDBACK_{k.upper()}": str(v) for k, v in store_settings.items()}}
        out = forkserver.run([sys.executable, "-m", "holdback.cli", "files", "gc", "--grace-seconds", "0"],
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        summary = json.loads(out.stdout.strip().splitlines()[-1])
        assert summary["expired"] == 1 and summary["purged"] == 6 and summary["kept_in_use"] == 0
        assert not store.exists("file-busy")
        with factory() as s:
            assert set(s.scalars(select(File.id))) == {"file-fresh", "file-forever"}
    finally:
        engine.dispose()


def test_files_gc_rejects_bad_flags() -> None:
    out = forkserver.run([sys.executable, "-m", "holdback.cli", "files", "gc", "--batch-size", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--batch-size and --max-batches must be at least 1" in out.stderr
