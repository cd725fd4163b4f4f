"""The S3-compatible file store against a real S3 server: streaming parts, atomic publish, the API and
the processor using it through the same interface as local disk, and tenants kept apart."""

from __future__ import annotations

import hashlib
import os

import httpx
import pytest

from bench.lib.s3_server import S3Server
from holdback.object_store import MiB, S3FileStore
from holdback.settings import Settings
from holdback.storage import FileTooLarge, LocalFileStore, open_file_store
from tests.batch_api.conftest import serve
from tests.batch_processor.test_processor_support import Harness, chat, jsonl


@pytest.fixture
def store(s3_settings: dict) -> S3FileStore:
    s = open_file_store(Settings(**s3_settings, s3_part_size_mb=5))
    assert isinstance(s, S3FileStore)
    return s


def _objects(store: S3FileStore) -> list[str]:
    answer = store.client.list_objects_v2(Bucket=store.bucket)
    return sorted(o["Key"] for o in answer.get("Contents", []))


def test_multipart_upload_streams_parts_and_reads_back_by_line(store: S3FileStore) -> None:
    lines = [f'{{"n": {i}, "pad": "{"x" * 1000}"}}\n'.encode() for i in range(12_000)]  # ~12 MiB: three parts
    digest = hashlib.sha256(b"".join(lines)).hexdigest()
    with store.open_writer("file-big") as writer:
        for line in lines:
            writer.write(line)
        assert writer.upload_id is not None and len(writer.parts) == 2  # two 5 MiB parts sent while writing
        assert len(writer.buffer) < 5 * MiB  # never more than one part held
        size = writer.commit()
    assert size == store.size("file-big") == sum(map(len, lines))
    assert _objects(store) == [f"{store.prefix}/file-big"]
    assert hashlib.sha256(b"".join(store.iter_chunks("file-big", 64 * 1024))).hexdigest() == digest
    with store.open_read("file-big") as fh:
        assert sum(1 for _ in fh) == 12_000


def test_a_small_file_is_one_put_and_nothing_exists_before_commit(store: S3FileStore) -> None:
    writer = store.open_writer("file-small")
    writer.write(b'{"a": 1}\n')
    assert not store.exists("file-small")
    assert writer.commit() == 9
    assert store.exists("file-small") and writer.upload_id is None


def test_oversize_or_aborted_uploads_leave_no_object_and_no_open_upload(store: S3FileStore) -> None:
    writer = store.open_writer("file-over", limit=6 * MiB)
    with pytest.raises(FileTooLarge):
        for _ in range(8):
            writer.write(b"y" * MiB)
    with pytest.raises(RuntimeError), store.open_writer("file-crash") as crashing:
        crashing.write(b"z" * 6 * MiB)
        raise RuntimeError("client went away")
    assert _objects(store) == []
    assert not store.client.list_multipart_uploads(Bucket=store.bucket).get("Uploads")


def test_missing_keys_read_as_file_not_found_and_delete_is_idempotent(store: S3FileStore) -> None:
    with pytest.raises(FileNotFoundError):
        store.open_read("file-none")
    with pytest.raises(FileNotFoundError):
        store.size("file-none")
    store.delete("file-none")
    with pytest.raises(ValueError):
        store.open_writer("../escape")


def test_files_url_selects_the_store_and_bad_urls_say_what_to_write(tmp_path) -> None:  # noqa: ANN001
    assert isinstance(open_file_store(Settings(data_dir=tmp_path)), LocalFileStore)
    shared = open_file_store(Settings(files_url=f"file://{tmp_path}/shared"))
    assert isinstance(shared, LocalFileStore) and shared.root == tmp_path / "shared"
    for bad in ("s3:/no-bucket", "file://relative/dir", "gs://bucket"):
        with pytest.raises(ValueError, match="use s3://bucket/prefix"):
            Settings(files_url=bad)
    with pytest.raises(ValueError, match="s3_part_size_mb"):
        Settings(files_url="s3://b", s3_part_size_mb=4)


def test_api_uploads_downloads_and_deletes_through_s3_with_tenants_apart(backend, s3_settings: dict) -> None:  # noqa: ANN001
    server = serve(backend.settings(**s3_settings))
    try:
        store = server.server.config.app.state.context.store
        assert isinstance(store, S3FileStore)
        alice, bob = server.create_key("alice"), server.create_key("bob")
        content = jsonl([chat(i) for i in range(200)])
        created = server.openai(alice).files.create(file=("in.jsonl", content), purpose="batch")
        assert _objects(store) == [f"{store.prefix}/{created.id}"]
        with server.http(alice) as http:
            assert http.get(f"/v1/files/{created.id}/content").content == content
        with server.http(bob) as http:
            other = http.get(f"/v1/files/{created.id}/content")
            assert other.status_code == 404 and created.id in other.json()["error"]["message"]
            assert http.delete(f"/v1/files/{created.id}").status_code == 404
        assert _objects(store) == [f"{store.prefix}/{created.id}"]
        with server.http(alice) as http:
            assert http.delete(f"/v1/files/{created.id}").json()["deleted"] is True
        assert _objects(store) == []
    finally:
        server.stop()


def test_processor_expands_and_finalizes_a_batch_on_s3(backend, s3_settings: dict) -> None:  # noqa: ANN001
    harness = Harness(backend, **s3_settings)
    try:
        assert isinstance(harness.store, S3FileStore)
        batch_id = harness.submit(jsonl([chat(i) for i in range(20)]))
        processor = harness.processor(window=50)
        processor.tick()
        rows = harness.rows(batch_id)
        assert len(rows) == 20
        for row in rows[:15]:
            harness.succeed(row.id)
        for row in rows[15:]:
            harness.fail(row.id)
        assert processor.tick().finished == {batch_id: "completed"}
        batch = harness.batch(batch_id)
        assert sorted(line["custom_id"] for line in harness.read_file(batch.output_file_id)) == sorted(
            f"req-{i}" for i in range(15))
        assert len(harness.read_file(batch.error_file_id)) == 5
        assert harness.store.exists(batch.output_file_id) and harness.store.exists(batch.error_file_id)
    finally:
        harness.close()
