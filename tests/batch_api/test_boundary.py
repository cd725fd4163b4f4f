"""What every request is checked for before it reaches a route, the database or Redis: the caller's key
first, then NUL bytes in every string (PostgreSQL's text cannot hold one, SQLite's can: both backends must
answer the same 400), then a JSON body that is UTF-8 and standard JSON. Also the statuses around them:
405 with a complete `Allow`, 503 while Redis is down, and an OpenAPI schema that tells clients all of it.
"""

from __future__ import annotations

import io

import httpx
import pytest

from tests.batch_api.test_admin_dashboard import signed_in
from tests.batch_api.test_errors import LINE, assert_error, multipart
from tests.support import free_port


@pytest.fixture
def tenant(api):  # noqa: ANN001
    """The API, a tenant key, and one batch file and batch of that tenant."""
    key = api.create_key("acme")
    client = api.openai(key)
    file = client.files.create(file=("a.jsonl", io.BytesIO(LINE)), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h")
    return api, key, file.id, batch.id


# ---- NUL bytes -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "params", "param"),
    [
        ("GET", "/v1/files", {"after": "file-\x00"}, "after"),
        ("GET", "/v1/files", {"purpose": "batch\x00"}, "purpose"),
        ("GET", "/v1/batches", {"after": "batch_\x00"}, "after"),
        ("GET", "/v1/files/file-%00", {}, "file_id"),
        ("GET", "/v1/files/file-%00/content", {}, "file_id"),
        ("DELETE", "/v1/files/file-%00", {}, "file_id"),
        ("GET", "/v1/batches/batch_%00", {}, "batch_id"),
        ("POST", "/v1/batches/batch_%00/cancel", {}, "batch_id"),
    ],
)
def test_a_nul_byte_in_an_id_cursor_or_filter_is_a_400(tenant, method, path, params, param):
    api, key, _, _ = tenant
    with api.http(key) as http:
        r = http.request(method, path, params=params)
    err = assert_error(r, 400, "NUL", "remove", param=param)
    assert err["code"] == "invalid_characters"


def test_a_nul_byte_in_operator_routes_is_a_400(api):
    admin = {"authorization": f"Bearer {api.settings.admin_key}"}
    with httpx.Client(base_url=api.url, headers=admin, timeout=30) as http:
        assert_error(http.get("/admin/batches", params={"after": "batch_\x00"}), 400, "NUL", param="after")
        assert_error(http.get("/admin/batches/batch_%00"), 400, "NUL", param="batch_id")
        assert_error(http.post("/admin/keys", json={"tenant": "ac\x00me"}), 400, "NUL", param="tenant")


def test_a_nul_byte_in_dashboard_ids_and_filters_is_a_400(api):
    client, _ = signed_in(api)
    for path, params, param in [("/dashboard/batches/batch_%00", {}, "batch_id"),
                                ("/dashboard", {"after": "batch_\x00"}, "after"),
                                ("/dashboard/fragments/requests/r%00/attempts", {}, "row_id")]:
        assert_error(client.get(path, params=params), 400, "NUL", param=param)


def test_a_nul_byte_in_a_batch_body_is_a_400(tenant):
    api, key, file_id, _ = tenant
    body = {"input_file_id": file_id, "endpoint": "/v1/embeddings", "completion_window": "24h"}
    with api.http(key) as http:
        r = http.post("/v1/batches", json={**body, "input_file_id": file_id + "\x00"})
        assert_error(r, 400, "NUL", param="input_file_id")
        r = http.post("/v1/batches", json={**body, "metadata": {"k": "v\x00"}})
        assert_error(r, 400, "NUL", param="metadata.k")
        r = http.post("/v1/batches", json={**body, "metadata": {"k\x00": "v"}})
        assert_error(r, 400, "NUL", param="metadata")
        # Nothing was created by the refused requests.
        assert len(http.get("/v1/batches").json()["data"]) == 1


def test_a_nul_byte_in_an_upload_filename_or_purpose_is_a_400(tenant):
    api, key, _, _ = tenant
    with api.http(key) as http:
        content, headers = multipart([("purpose", None, b"batch"), ("file", "in\x00put.jsonl", LINE)])
        assert_error(http.post("/v1/files", content=content, headers=headers), 400, "NUL", param="file")
        content, headers = multipart([("purpose", None, b"bat\x00ch"), ("file", "input.jsonl", LINE)])
        assert_error(http.post("/v1/files", content=content, headers=headers), 400, param="purpose")
        assert len(http.get("/v1/files").json()["data"]) == 1


# ---- Redis down ------------------------------------------------------------------------------------------------


def test_queue_and_worker_routes_answer_503_while_redis_is_down(start_api):
    api = start_api(redis_url=f"redis://127.0.0.1:{free_port()}/0")
    admin = {"authorization": f"Bearer {api.settings.admin_key}"}
    for method, path in [("GET", "/admin/queues"), ("GET", "/admin/workers"),
                         ("POST", f"/admin/queues/{api.settings.redis_namespace}-requests/pause")]:
        r = httpx.request(method, api.url + path, headers=admin, timeout=30)
        err = assert_error(r, 503, "Redis", "retry")
        assert err["code"] == "redis_unavailable" and err["type"] == "server_error"
        assert r.headers["retry-after"].isdigit()
    # Dashboard sessions and the sign-in count live in Redis too: sign-in says so rather than failing.
    r = httpx.post(api.url + "/dashboard/login", data={"admin_key": api.settings.admin_key}, timeout=30)
    assert_error(r, 503, "Redis")


# ---- authentication first, then the body ---------------------------------------------------------------------


@pytest.mark.parametrize("body", [b"{not json", b"\xff\xfe{}", b'{"input_file_id": NaN}'])
def test_a_bad_body_without_a_key_is_a_401(api, body):
    for path in ("/v1/batches", "/admin/keys"):
        r = httpx.post(api.url + path, content=body, headers={"content-type": "application/json"})
        assert_error(r, 401, "API key" if path.startswith("/v1") else "key")
        wrong = {"content-type": "application/json", "authorization": "Bearer not-a-key"}
        assert_error(httpx.post(api.url + path, content=body, headers=wrong), 401)


def test_a_body_that_is_not_utf8_says_so_with_a_code(tenant):
    api, key, _, _ = tenant
    with api.http(key) as http:
        r = http.post("/v1/batches", content=b'{"input_file_id": "\xff\xfe"}', headers={"content-type": "application/json"})
    err = assert_error(r, 400, "UTF-8", "0xff")
    assert err["code"] == "invalid_encoding"


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_not_json(tenant, constant):
    api, key, file_id, _ = tenant
    body = ('{"input_file_id": "%s", "endpoint": "/v1/embeddings", "completion_window": "24h", '
            '"metadata": {"k": %s}}') % (file_id, constant)
    with api.http(key) as http:
        r = http.post("/v1/batches", content=body.encode(), headers={"content-type": "application/json"})
    err = assert_error(r, 400, "not valid JSON", constant)
    assert err["code"] == "invalid_json"


def test_a_number_beyond_a_double_is_not_stored_as_infinity(tenant):
    api, key, file_id, _ = tenant
    body = ('{"input_file_id": "%s", "endpoint": "/v1/embeddings", "completion_window": "24h", '
            '"metadata": {"k": 1e400}}') % file_id
    with api.http(key) as http:
        before = http.get("/v1/batches").json()["data"]
        r = http.post("/v1/batches", content=body.encode(), headers={"content-type": "application/json"})
        err = assert_error(r, 400, "not valid JSON", "1e400", "64-bit float")
        assert err["code"] == "invalid_json"
        assert http.get("/v1/batches").json()["data"] == before  # nothing was created


def test_a_deeply_nested_body_is_a_400(tenant):
    api, key, _, _ = tenant
    with api.http(key) as http:
        for depth in (40, 5_000):  # past our limit; past Python's recursion limit
            body = b'{"input_file_id": "x", "metadata": ' + b"[" * depth + b"]" * depth + b"}"
            r = http.post("/v1/batches", content=body, headers={"content-type": "application/json"})
            err = assert_error(r, 400, "nested", "32")
            assert err["code"] == "invalid_json"
            if depth == 40:
                assert err["param"].startswith("metadata.0.0"), err


def test_an_oversized_json_body_is_a_413(tenant):
    api, key, _, _ = tenant
    body = b'{"input_file_id": "' + b"x" * (2 << 20) + b'"}'
    with api.http(key) as http:
        r = http.post("/v1/batches", content=body, headers={"content-type": "application/json"})
    err = assert_error(r, 413, "larger than")
    assert err["code"] == "request_too_large"


# ---- 405 -------------------------------------------------------------------------------------------------------


def test_405_allow_names_every_method_that_works(tenant):
    api, key, file_id, batch_id = tenant
    with api.http(key) as http:
        for path, allowed in [("/v1/files", {"GET", "POST"}), (f"/v1/files/{file_id}", {"GET", "DELETE"}),
                              ("/v1/batches", {"GET", "POST"}), (f"/v1/batches/{batch_id}/cancel", {"POST"})]:
            r = http.put(path)
            err = assert_error(r, 405, "PUT")
            assert {m.strip() for m in r.headers["allow"].split(",")} == allowed, (path, r.headers["allow"])
            for method in allowed:
                assert method in err["message"]


# ---- the OpenAPI schema ----------------------------------------------------------------------------------------


def test_openapi_describes_the_upload_body_and_the_real_error_statuses(api):
    schema = httpx.get(api.url + "/openapi.json").json()
    upload = schema["paths"]["/v1/files"]["post"]
    form = upload["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert set(form["required"]) == {"file", "purpose"}
    assert form["properties"]["file"]["format"] == "binary" and "batch" in form["properties"]["purpose"]["enum"]
    envelope = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses, (method, path)
            if path.startswith(("/v1/", "/admin/")):
                for status in ("400", "401", "500"):
                    assert responses[status]["content"]["application/json"]["schema"] == envelope, (method, path, status)
            if "{" in path:
                assert "404" in responses, (method, path)
    assert "413" in upload["responses"]
    assert "503" in schema["paths"]["/admin/queues"]["get"]["responses"]
    assert "HTTPValidationError" not in schema["components"]["schemas"]
