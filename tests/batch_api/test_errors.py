"""Bad input gets the right status, the OpenAI error envelope and a message that says what to change,
and never costs a previously stored file or batch anything."""

from __future__ import annotations

import io
import socket
import time

import httpx
import openai
import pytest
from sqlalchemy import text

from holdback.db import make_engine

BATCH_LIMIT = 1024
UPLOAD_LIMIT = 4096
LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", "input": "hi"}}\n'


class Seeded:
    """A tenant with stored files and batches, and a way to prove they are untouched."""

    def __init__(self, api):  # noqa: ANN001
        self.api = api
        self.key = api.create_key("acme")
        self.client = api.openai(self.key)
        self.files = {}
        for name, purpose, body in [("a.jsonl", "batch", LINE), ("b.jsonl", "batch", LINE * 3), ("notes.txt", "user_data", b"notes")]:
            f = self.client.files.create(file=(name, io.BytesIO(body)), purpose=purpose)
            self.files[f.id] = body
        batch_file = next(iter(self.files))
        self.batch = self.client.batches.create(
            input_file_id=batch_file, endpoint="/v1/embeddings", completion_window="24h", metadata={"k": "v"}
        )
        self.snapshot = self._state()

    def _state(self):  # noqa: ANN202
        files = [f.model_dump() for f in self.client.files.list()]
        contents = {fid: self.client.files.content(fid).read() for fid in self.files}
        batches = [b.model_dump() for b in self.client.batches.list()]
        stored = sorted(p.name for p in self.api.settings.files_dir.iterdir())
        return files, contents, batches, stored

    def assert_intact(self) -> None:
        files, contents, batches, stored = self._state()
        assert (files, batches) == (self.snapshot[0], self.snapshot[2])
        assert contents == self.files
        # Nothing half-written is left behind: exactly the stored files, no temp parts.
        assert stored == sorted(self.files)

    def http(self) -> httpx.Client:
        return self.api.http(self.key)


@pytest.fixture
def seeded(start_api) -> Seeded:  # noqa: ANN001
    return Seeded(start_api(max_batch_file_bytes=BATCH_LIMIT, max_upload_bytes=UPLOAD_LIMIT))


def assert_error(r: httpx.Response, status: int, *words: str, param: str | None = "<any>") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    for word in words:
        assert word in body["error"]["message"], (word, body)
    if param != "<any>":
        assert body["error"]["param"] == param, body
    return body["error"]


def multipart(parts: list[tuple[str, str | None, bytes]], boundary: str = "b0undary") -> tuple[bytes, dict]:
    body = b""
    for name, filename, value in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        body += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + value + b"\r\n"
    body += f"--{boundary}--\r\n".encode()
    return body, {"content-type": f"multipart/form-data; boundary={boundary}"}


# ---- uploads -----------------------------------------------------------------------------------


def test_oversize_batch_file_is_413_with_the_limit(seeded):
    with pytest.raises(openai.APIStatusError) as exc:
        seeded.client.files.create(file=("big.jsonl", io.BytesIO(LINE * 20)), purpose="batch")
    assert exc.value.status_code == 413
    assert str(BATCH_LIMIT) in exc.value.message and exc.value.body["param"] == "file"
    seeded.assert_intact()


def test_oversize_upload_without_content_length_is_413(seeded):
    """Chunked body, so only the streaming byte count can catch it."""
    def body():
        yield b'--bb\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nuser_data\r\n'
        yield b'--bb\r\nContent-Disposition: form-data; name="file"; filename="x.bin"\r\n\r\n'
        for _ in range(10):
            yield b"x" * 1000
        yield b"\r\n--bb--\r\n"

    with seeded.http() as http:
        r = http.post("/v1/files", content=body(), headers={"content-type": "multipart/form-data; boundary=bb"})
    assert_error(r, 413, str(UPLOAD_LIMIT), param="file")
    seeded.assert_intact()


def test_oversize_content_length_is_refused_before_the_body(seeded):
    """A declared body over the limit is answered without sending any of it."""
    host, port = "127.0.0.1", seeded.api.port
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + seeded.key.encode() + b"\r\n"
            b"Content-Type: multipart/form-data; boundary=bb\r\nContent-Length: 10000000000\r\n\r\n"
        )
        response = b""
        while b"\r\n\r\n" not in response:
            chunk = sock.recv(65536)
            if not chunk:
                break
            response += chunk
    assert response.startswith(b"HTTP/1.1 413"), response[:200]
    seeded.assert_intact()


def test_wrong_purpose_lists_the_accepted_ones(seeded):
    with pytest.raises(openai.BadRequestError) as exc:
        seeded.client.files.create(file=("a.jsonl", io.BytesIO(LINE)), purpose="batch_output")
    for purpose in ("assistants", "batch", "fine-tune", "vision", "user_data", "evals"):
        assert purpose in exc.value.message
    assert exc.value.body["param"] == "purpose"
    seeded.assert_intact()


def test_batch_file_must_be_jsonl(seeded):
    with pytest.raises(openai.BadRequestError) as exc:
        seeded.client.files.create(file=("input.csv", io.BytesIO(LINE)), purpose="batch")
    assert ".jsonl" in exc.value.message and "input.csv" in exc.value.message
    seeded.assert_intact()


MALFORMED = {
    "not-multipart": (b"purpose=batch", {"content-type": "application/x-www-form-urlencoded"}, ["multipart/form-data"]),
    "no-boundary": (b'--bb\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n',
                    {"content-type": "multipart/form-data"}, ["boundary"]),
    # The closing boundary never comes.
    "truncated": (b'--bb\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--bb\r\n'
                  b'Content-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n{"a": 1}\n',
                  {"content-type": "multipart/form-data; boundary=bb"}, ["closing boundary"]),
    "garbage": (b"this is not multipart at all", {"content-type": "multipart/form-data; boundary=bb"}, ["Malformed multipart"]),
    "no-disposition": (b"--bb\r\nX-Nothing: 1\r\n\r\nbatch\r\n--bb--\r\n",
                       {"content-type": "multipart/form-data; boundary=bb"}, ["Content-Disposition"]),
}


def test_malformed_multipart_is_400(seeded):
    with seeded.http() as http:
        for case, (content, headers, words) in MALFORMED.items():
            r = http.post("/v1/files", content=content, headers=headers)
            assert r.status_code == 400, case
            assert_error(r, 400, *words)
    seeded.assert_intact()


def test_missing_parts_and_bad_expiry(seeded):
    cases = [
        ([("purpose", None, b"batch")], ["'file'"], "file"),
        ([("file", "a.jsonl", LINE)], ["purpose"], "purpose"),
        ([("purpose", None, b"batch"), ("file", None, LINE)], ["filename"], "file"),
        ([("purpose", None, b"batch"), ("file", "a.jsonl", LINE), ("file", "b.jsonl", LINE)], ["exactly one"], "file"),
        ([("purpose", None, b"batch"), ("expires_after[anchor]", None, b"created_at"),
          ("expires_after[seconds]", None, b"60"), ("file", "a.jsonl", LINE)], ["3600", "2592000"], "expires_after.seconds"),
        ([("purpose", None, b"batch"), ("expires_after[anchor]", None, b"last_active_at"),
          ("expires_after[seconds]", None, b"3600"), ("file", "a.jsonl", LINE)], ["created_at"], "expires_after.anchor"),
    ]
    with seeded.http() as http:
        for parts, words, param in cases:
            content, headers = multipart(parts)
            assert_error(http.post("/v1/files", content=content, headers=headers), 400, *words, param=param)
    seeded.assert_intact()


def test_purpose_after_the_file_part_is_still_checked(seeded):
    """Fields may follow the file; the limits and purpose rules still hold, and a good upload still lands."""
    with seeded.http() as http:
        content, headers = multipart([("file", "late.jsonl", LINE * 20), ("purpose", None, b"batch")])
        assert_error(http.post("/v1/files", content=content, headers=headers), 413, str(BATCH_LIMIT))
        content, headers = multipart([("file", "late.txt", LINE), ("purpose", None, b"batch")])
        assert_error(http.post("/v1/files", content=content, headers=headers), 400, ".jsonl")
        seeded.assert_intact()
        content, headers = multipart([("file", "late.jsonl", LINE), ("purpose", None, b"batch")])
        r = http.post("/v1/files", content=content, headers=headers)
    assert r.status_code == 200 and r.json()["purpose"] == "batch"
    assert seeded.client.files.content(r.json()["id"]).read() == LINE


# ---- batches -----------------------------------------------------------------------------------


def create_batch(seeded, **overrides) -> httpx.Response:  # noqa: ANN001
    body = {"input_file_id": seeded.batch.input_file_id, "endpoint": "/v1/embeddings", "completion_window": "24h"}
    body.update(overrides)
    with seeded.http() as http:
        return http.post("/v1/batches", json={k: v for k, v in body.items() if v is not None})


def test_unknown_endpoint_names_the_accepted_ones(seeded):
    err = assert_error(create_batch(seeded, endpoint="/v1/images/generations"), 400, "/v1/images/generations",
                       param="endpoint")
    for endpoint in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"):
        assert endpoint in err["message"]
    seeded.assert_intact()


def test_bad_completion_window_says_the_format(seeded):
    for window in ["25 hours", "24", "h", "0h", "59s", "8d", "1.5h", "-1h", "", "24H"]:
        r = create_batch(seeded, completion_window=window)
        assert r.status_code == 400, window
        assert_error(r, 400, "24h", "30m", param="completion_window")
    seeded.assert_intact()


def test_metadata_limits(seeded):
    too_many = {f"k{i}": "v" for i in range(17)}
    assert_error(create_batch(seeded, metadata=too_many), 400, "16", param="metadata")
    assert_error(create_batch(seeded, metadata={"k" * 65: "v"}), 400, "64", param="metadata")
    assert_error(create_batch(seeded, metadata={"k": "v" * 513}), 400, "512", param="metadata")
    assert_error(create_batch(seeded, metadata={"k": 5}), 400, "string", param="metadata.k")
    # The limits themselves are allowed.
    ok = create_batch(seeded, metadata={f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)})
    assert ok.status_code == 200, ok.text
    seeded.snapshot = seeded._state()
    seeded.assert_intact()


def test_batch_input_file_checks(seeded):
    assert_error(create_batch(seeded, input_file_id="file-unknown"), 404, "file-unknown", param="input_file_id")
    notes = next(fid for fid, body in seeded.files.items() if body == b"notes")
    assert_error(create_batch(seeded, input_file_id=notes), 400, "purpose", param="input_file_id")
    assert_error(create_batch(seeded, input_file_id=None), 400, "input_file_id", param="input_file_id")
    seeded.assert_intact()
    # A deleted file is gone for new batches too.
    spare = seeded.client.files.create(file=("spare.jsonl", io.BytesIO(LINE)), purpose="batch").id
    seeded.client.files.delete(spare)
    assert_error(create_batch(seeded, input_file_id=spare), 404, spare, param="input_file_id")
    seeded.assert_intact()


def test_request_validation_uses_the_envelope(seeded):
    with seeded.http() as http:
        assert_error(http.get("/v1/batches", params={"limit": 0}), 400, "limit", param="limit")
        assert_error(http.get("/v1/batches", params={"limit": 101}), 400, "100", param="limit")
        assert_error(http.get("/v1/files", params={"limit": 10_001}), 400, "10000", param="limit")
        assert_error(http.get("/v1/files", params={"order": "sideways"}), 400, "asc", param="order")
        assert_error(http.post("/v1/batches", content=b"{not json", headers={"content-type": "application/json"}), 400, "JSON")
        assert_error(create_batch(seeded, surprise=1), 400, "surprise", param="surprise")
        assert_error(create_batch(seeded, output_expires_after={"anchor": "created_at", "seconds": 10}), 400,
                     param="output_expires_after.seconds")
        assert_error(http.get("/v1/nothing-here"), 404, "/v1/nothing-here")
        assert_error(http.put("/v1/files"), 405, "PUT")
        assert_error(http.get("/v1/files/file-nope"), 404, "file-nope")
        assert_error(http.get("/v1/batches/batch_nope"), 404, "batch_nope")
    seeded.assert_intact()


def test_server_errors_use_the_envelope_too(api, backend):
    key = api.create_key("acme")
    engine = make_engine(backend.database_url)
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE batches RENAME TO batches_gone"))
    engine.dispose()
    r = httpx.get(f"{api.url}/v1/batches", headers={"authorization": f"Bearer {key}"})
    err = assert_error(r, 500, "internal error")
    assert err["type"] == "server_error"
    assert r.headers["x-request-id"] in err["message"]
    assert "batches" not in err["message"]  # no internals leak to the client


def test_client_disconnect_mid_upload_leaves_nothing_behind(seeded):
    head = b'--bb\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nuser_data\r\n' \
           b'--bb\r\nContent-Disposition: form-data; name="file"; filename="cut.bin"\r\n\r\n'
    with socket.create_connection(("127.0.0.1", seeded.api.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + seeded.key.encode() + b"\r\n"
            b"Content-Type: multipart/form-data; boundary=bb\r\nContent-Length: 4000\r\n\r\n" + head + b"x" * 1000
        )
    # The server answers the cut-off upload with a 400 in its request log and metrics once it notices.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{seeded.api.url}/metrics").text
        if 'holdback_api_requests_total{method="POST",route="/v1/files",status="400"} 1.0' in metrics:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the server never finished the cut-off upload")
    seeded.assert_intact()
