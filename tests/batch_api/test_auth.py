"""Keys and tenants: every /v1 route is scoped to the caller's tenant; the admin key is separate."""

from __future__ import annotations

import io

import httpx
import openai
import pytest
from sqlalchemy import update

from holdback.db import make_engine, make_sessionmaker, transaction
from holdback.models import ApiKey
from holdback.tenancy import hash_key


def make_tenant_with_data(api, name: str):  # noqa: ANN001
    key = api.create_key(name)
    client = api.openai(key)
    file_id = client.files.create(file=("in.jsonl", io.BytesIO(b'{"n": 1}\n')), purpose="batch").id
    batch_id = client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h").id
    return key, client, file_id, batch_id


def test_other_tenants_ids_are_not_found_everywhere(api):
    _, alice, alice_file, alice_batch = make_tenant_with_data(api, "alice")
    bob_key, bob, bob_file, bob_batch = make_tenant_with_data(api, "bob")

    attempts = [
        lambda: bob.files.retrieve(alice_file),
        lambda: bob.files.content(alice_file),
        lambda: bob.files.delete(alice_file),
        lambda: bob.batches.create(input_file_id=alice_file, endpoint="/v1/embeddings", completion_window="24h"),
        lambda: bob.batches.retrieve(alice_batch),
        lambda: bob.batches.cancel(alice_batch),
        lambda: bob.files.list(after=alice_file),
        lambda: bob.batches.list(after=alice_batch),
    ]
    for attempt in attempts:
        with pytest.raises(openai.NotFoundError) as exc:
            attempt()
        assert exc.value.body["type"] == "invalid_request_error"

    # The same message as an id that never existed, so a 404 leaks nothing.
    with pytest.raises(openai.NotFoundError) as foreign:
        bob.files.retrieve(alice_file)
    with pytest.raises(openai.NotFoundError) as unknown:
        bob.files.retrieve("file-000000000000000000000000")
    assert foreign.value.message.replace(alice_file, "ID") == unknown.value.message.replace("file-000000000000000000000000", "ID")

    # Lists only show the caller's own things.
    assert [f.id for f in bob.files.list()] == [bob_file]
    assert [b.id for b in bob.batches.list()] == [bob_batch]

    # Nothing of Alice's was touched by Bob's attempts.
    assert alice.files.retrieve(alice_file).id == alice_file
    assert alice.files.content(alice_file).read() == b'{"n": 1}\n'
    assert alice.batches.retrieve(alice_batch).status == "validating"
    assert [f.id for f in alice.files.list()] == [alice_file]


ROUTES = [
    ("POST", "/v1/files"),
    ("GET", "/v1/files"),
    ("GET", "/v1/files/file-x"),
    ("GET", "/v1/files/file-x/content"),
    ("DELETE", "/v1/files/file-x"),
    ("POST", "/v1/batches"),
    ("GET", "/v1/batches"),
    ("GET", "/v1/batches/batch_x"),
    ("POST", "/v1/batches/batch_x/cancel"),
]


def test_missing_wrong_and_admin_keys(api):
    api.create_key("acme")
    cases = [
        ({}, 401),
        ({"authorization": "Bearer"}, 401),
        ({"authorization": "Basic abc"}, 401),
        ({"authorization": "Bearer hb-not-a-real-key"}, 401),
        ({"authorization": f"Bearer {api.settings.admin_key}"}, 403),
    ]
    for method, path in ROUTES:
        for headers, status in cases:
            r = httpx.request(method, api.url + path, headers=headers)
            assert r.status_code == status, (method, path, headers, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            if status == 403:
                assert "tenant key" in error["message"]
            else:
                assert "Authorization: Bearer" in error["message"]


def test_sdk_sees_authentication_and_permission_errors(api):
    api.create_key("acme")
    with pytest.raises(openai.AuthenticationError):
        api.openai("hb-wrong").files.list()
    with pytest.raises(openai.PermissionDeniedError) as exc:
        api.openai(api.settings.admin_key).batches.list()
    assert exc.value.code == "tenant_key_required"


def test_revoked_key_is_refused(api, backend):
    key = api.create_key("acme")
    client = api.openai(key)
    assert client.files.list().data == []
    engine = make_engine(backend.database_url)
    with transaction(make_sessionmaker(engine)) as session:
        session.execute(update(ApiKey).where(ApiKey.key_hash == hash_key(key)).values(revoked_at=1))
    engine.dispose()
    with pytest.raises(openai.AuthenticationError) as exc:
        client.files.list()
    # The refusal says the key was revoked, when, and what to do; a key never issued is only "invalid".
    assert exc.value.code == "revoked_api_key"
    assert "was revoked at 1970-01-01 00:00:01 UTC" in exc.value.message and "tenant acme" in exc.value.message
    assert "holdback keys create --tenant acme" in exc.value.message
    with pytest.raises(openai.AuthenticationError) as never:
        api.openai("hb-never-issued").files.list()
    assert never.value.code == "invalid_api_key"


def test_admin_routes(api):
    alice_key, _, _, alice_batch = make_tenant_with_data(api, "alice")
    _, _, _, bob_batch = make_tenant_with_data(api, "bob")
    _, _, _, bob_batch2 = make_tenant_with_data(api, "bob")  # a second key for the same tenant
    admin = {"authorization": f"Bearer {api.settings.admin_key}"}

    r = httpx.get(f"{api.url}/admin/batches", headers=admin, params={"limit": 2})
    assert r.status_code == 200, r.text
    first = r.json()
    assert [b["id"] for b in first["data"]] == [bob_batch2, bob_batch] and first["has_more"] is True
    rest = httpx.get(f"{api.url}/admin/batches", headers=admin, params={"limit": 2, "after": bob_batch}).json()
    assert [b["id"] for b in rest["data"]] == [alice_batch] and rest["has_more"] is False
    tenants = {b["tenant_id"] for b in first["data"] + rest["data"]}
    assert len(tenants) == 2
    filtered = httpx.get(f"{api.url}/admin/batches", headers=admin, params={"status": "completed"}).json()
    assert filtered["data"] == []

    for headers, status in [({}, 401), ({"authorization": "Bearer nope"}, 401), ({"authorization": f"Bearer {alice_key}"}, 403)]:
        for method, path, body in [("GET", "/admin/batches", None), ("POST", "/admin/keys", {"tenant": "eve"})]:
            r = httpx.request(method, api.url + path, headers=headers, json=body)
            assert r.status_code == status, (path, headers, r.text)
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    r = httpx.post(f"{api.url}/admin/keys", headers=admin, json={"tenant": " "})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tenant"


def test_admin_routes_are_off_without_an_admin_key(start_api):
    api = start_api(admin_key=None)
    r = httpx.get(f"{api.url}/admin/batches", headers={"authorization": "Bearer anything"})
    assert r.status_code == 403
    assert "HOLDBACK_ADMIN_KEY" in r.json()["error"]["message"]
