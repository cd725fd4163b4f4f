"""The Files API through the official SDK: upload, list with paging, retrieve, download, delete."""

from __future__ import annotations

import hashlib
import io
import json

import httpx
import openai
import pytest


def jsonl(n: int, tag: str = "x") -> bytes:
    lines = [
        {"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": [{"role": "user", "content": f"hello {i}"}]}}
        for i in range(n)
    ]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def test_upload_list_retrieve_download_delete(api):
    client = api.openai(api.create_key("acme"))
    contents = {}
    uploaded = []
    for i in range(7):
        body = jsonl(i + 1, tag=f"f{i}")
        purpose = "batch" if i % 2 == 0 else "user_data"
        f = client.files.create(file=(f"input-{i}.jsonl", io.BytesIO(body)), purpose=purpose)
        assert (f.object, f.status, f.purpose, f.filename, f.bytes) == ("file", "processed", purpose, f"input-{i}.jsonl", len(body))
        assert f.id.startswith("file-") and isinstance(f.created_at, int)
        # OpenAI's default: purpose=batch files expire 30 days after upload; other purposes persist.
        assert f.expires_at == (f.created_at + 30 * 24 * 3600 if purpose == "batch" else None)
        assert f.status_details is None
        contents[f.id] = body
        uploaded.append(f.id)

    # Auto-paging with a page smaller than the data: the SDK follows `after` = last id.
    page = client.files.list(limit=2)
    assert len(page.data) == 2 and page.has_more is True
    assert [f.id for f in client.files.list(limit=2)] == uploaded[::-1]
    assert [f.id for f in client.files.list(limit=3, order="asc")] == uploaded
    assert [f.id for f in client.files.list(limit=1, purpose="batch")] == uploaded[::2][::-1]

    for file_id, body in contents.items():
        f = client.files.retrieve(file_id)
        assert f.id == file_id and f.bytes == len(body)
        assert client.files.content(file_id).read() == body

    deleted = client.files.delete(uploaded[0])
    assert (deleted.id, deleted.object, deleted.deleted) == (uploaded[0], "file", True)
    for call in (client.files.retrieve, client.files.content, client.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(uploaded[0])
    assert [f.id for f in client.files.list(limit=2)] == uploaded[1:][::-1]
    for file_id in uploaded[1:]:
        assert client.files.content(file_id).read() == contents[file_id]


def test_list_envelope_and_a_deleted_cursor(api):
    key = api.create_key("acme")
    client = api.openai(key)
    ids = [client.files.create(file=(f"{i}.jsonl", io.BytesIO(b"{}\n")), purpose="batch").id for i in range(3)]
    with api.http(key) as http:
        empty_purpose = http.get("/v1/files", params={"purpose": "vision"}).json()
        assert empty_purpose == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}
        first = http.get("/v1/files", params={"limit": 2}).json()
        assert (first["first_id"], first["last_id"], first["has_more"]) == (ids[2], ids[1], True)
        # The cursor file is deleted between pages: the next page still continues after it.
        client.files.delete(ids[1])
        rest = http.get("/v1/files", params={"limit": 2, "after": ids[1]}).json()
        assert [f["id"] for f in rest["data"]] == [ids[0]] and rest["has_more"] is False


def test_expires_after_sets_expires_at(api):
    client = api.openai(api.create_key("acme"))
    f = client.files.create(
        file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="batch", expires_after={"anchor": "created_at", "seconds": 7200}
    )
    assert f.expires_at == f.created_at + 7200
    assert client.files.retrieve(f.id).expires_at == f.expires_at


def test_streamed_chunked_upload_and_download_match(api):
    """A several-MB body sent with chunked transfer encoding (no Content-Length) arrives byte for byte."""
    key = api.create_key("acme")
    line = b'{"custom_id": "c", "method": "POST", "url": "/v1/embeddings", "body": {"input": "' + b"z" * 4000 + b'"}}\n'
    chunks = [line] * 2000  # ~8 MB
    digest = hashlib.sha256(b"".join(chunks)).hexdigest()
    boundary = "hbtestboundary"

    def body():
        yield (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n").encode()
        yield (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big.jsonl\"\r\n"
               "Content-Type: application/jsonl\r\n\r\n").encode()
        yield from chunks
        yield f"\r\n--{boundary}--\r\n".encode()

    with api.http(key) as http:
        r = http.post("/v1/files", content=body(), headers={"content-type": f"multipart/form-data; boundary={boundary}"})
        assert r.status_code == 200, r.text
        file_id = r.json()["id"]
        assert r.json()["bytes"] == len(line) * 2000
    downloaded = api.openai(key).files.content(file_id).read()
    assert hashlib.sha256(downloaded).hexdigest() == digest


def test_content_answers_accept_application_binary(api):
    key = api.create_key("acme")
    f = api.openai(key).files.create(file=("a.jsonl", io.BytesIO(b'{"k": 1}\n')), purpose="batch")
    r = httpx.get(f"{api.url}/v1/files/{f.id}/content", headers={"authorization": f"Bearer {key}", "accept": "application/binary"})
    assert r.status_code == 200 and r.content == b'{"k": 1}\n'
    assert r.headers["content-length"] == "9"
