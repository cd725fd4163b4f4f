"""A full file store: the upload is answered 507 naming the store, nothing of it is kept, and the OpenAI SDK
does not send it again (a whole upload re-sent to a full disk fails the same way each time). On local disk a
small tmpfs really fills; an S3-compatible server out of room is played by a loopback server that answers as
MinIO does (507 `XMinioStorageFull`)."""

from __future__ import annotations

import http.server
import os
import threading
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from tests.support import small_disk

MiB = 1024 * 1024


def _counting_client(api, key: str) -> tuple[OpenAI, list[str]]:  # noqa: ANN001
    sent: list[str] = []
    http_client = httpx.Client(event_hooks={"request": [lambda r: sent.append(f"{r.method} {r.url.path}")]},
                               timeout=60)
    return OpenAI(base_url=f"{api.url}/v1", api_key=key, max_retries=3, http_client=http_client), sent


def _assert_refused_once(client: OpenAI, sent: list[str], size: int, where: str) -> None:
    with pytest.raises(openai.APIStatusError) as exc:
        client.files.create(file=("big.jsonl", b'{"a": 1}\n' * (size // 9)), purpose="batch")
    err = exc.value
    assert err.status_code == 507, err
    body = err.body if isinstance(err.body, dict) else {}
    assert body.get("code") == "storage_full", err.body
    assert where in body["message"] and "full or over its quota" in body["message"], body
    assert "may be retried" not in body["message"]
    assert sent.count("POST /v1/files") == 1, ("the SDK re-sent the upload", sent)


@pytest.fixture
def full_disk(tmp_path: Path):  # noqa: ANN201
    with small_disk(tmp_path / "files") as mount:
        yield mount


def test_a_full_local_disk_answers_507_keeps_nothing_and_the_sdk_does_not_resend(start_api, full_disk):
    api = start_api(files_url=f"file://{full_disk}")
    key = api.create_key("acme")
    client, sent = _counting_client(api, key)
    _assert_refused_once(client, sent, 6 * MiB, "local disk")
    assert os.listdir(full_disk) == [], "no partial file is left behind"
    assert client.files.list().data == [], "no file row for the refused upload"
    # The space the refused upload took is back: a file that fits is stored.
    stored = client.files.create(file=("small.jsonl", b'{"a": 1}\n' * 1000), purpose="batch")
    assert stored.bytes == 9000 and [f.id for f in client.files.list().data] == [stored.id]


class _FullS3(http.server.BaseHTTPRequestHandler):
    """An S3-compatible server with no room left: reads answer empty, every write MinIO's 507."""

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/xml")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(200, b"")

    def do_GET(self) -> None:  # noqa: N802
        self._answer(200, b'<?xml version="1.0"?><ListBucketResult><KeyCount>0</KeyCount></ListBucketResult>')

    def _full(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        self._answer(507, b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>XMinioStorageFull</Code>'
                          b"<Message>Storage backend has reached its minimum free drive threshold. "
                          b"Please delete a few objects to proceed.</Message></Error>")

    do_PUT = do_POST = _full  # noqa: N815

    def log_message(self, *args: object) -> None:
        pass


def test_a_full_object_store_answers_507_and_the_sdk_does_not_resend(start_api):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FullS3)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        api = start_api(files_url="s3://full-bucket/files",
                        s3_endpoint_url=f"http://127.0.0.1:{server.server_address[1]}",
                        s3_access_key_id="k", s3_secret_access_key="s")
        key = api.create_key("acme")
        client, sent = _counting_client(api, key)
        _assert_refused_once(client, sent, 64 * 1024, "s3://full-bucket")
        assert client.files.list().data == []
    finally:
        server.shutdown()
