"""Operations routes: liveness, readiness of the DB and Redis, Prometheus metrics, migrations at start."""

from __future__ import annotations

import io

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support import free_port


def samples(api, name: str) -> dict:  # noqa: ANN001
    text = httpx.get(f"{api.url}/metrics").text
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def test_healthz_and_readyz(api):
    r = httpx.get(f"{api.url}/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    r = httpx.get(f"{api.url}/readyz")
    assert r.status_code == 200
    assert r.json() == {"status": "ready", "checks": {"database": "ok", "redis": "ok"}}
    assert r.headers["x-request-id"].startswith("req_")


def test_a_callers_request_id_is_kept_and_an_unusable_one_replaced(api):
    assert httpx.get(f"{api.url}/healthz", headers={"x-request-id": "trace-abc_123"}).headers["x-request-id"] \
        == "trace-abc_123"
    for unusable in ("x" * 129, "has space"):
        kept = httpx.get(f"{api.url}/healthz", headers={"x-request-id": unusable}).headers["x-request-id"]
        assert kept.startswith("req_") and kept != unusable
    # The error envelope names the same id the response header carries.
    r = httpx.get(f"{api.url}/v1/files", headers={"x-request-id": "caller-42"})
    assert r.status_code == 401 and r.headers["x-request-id"] == "caller-42"


def test_readyz_names_an_unreachable_redis(start_api):
    api = start_api(redis_url=f"redis://127.0.0.1:{free_port()}/0")
    r = httpx.get(f"{api.url}/readyz")
    assert r.status_code == 503
    body = r.json()
    assert body["checks"]["database"] == "ok" and body["checks"]["redis"] != "ok"
    assert "redis" in body["error"]["message"] and "database" not in body["error"]["message"]
    assert body["error"]["code"] == "not_ready"


def test_readyz_names_an_unreachable_database(start_api):
    api = start_api(database_url=f"postgresql://nobody@127.0.0.1:{free_port()}/none", migrate_on_start=False)
    r = httpx.get(f"{api.url}/readyz")
    assert r.status_code == 503
    body = r.json()
    assert body["checks"]["redis"] == "ok" and body["checks"]["database"] != "ok"
    assert "database" in body["error"]["message"]


def test_metrics_count_requests_by_route_template_and_status(api):
    key = api.create_key("acme")
    client = api.openai(key)
    f = client.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    client.files.retrieve(f.id)
    for missing in ("file-a", "file-b"):
        httpx.get(f"{api.url}/v1/files/{missing}", headers={"authorization": f"Bearer {key}"})
    httpx.get(f"{api.url}/no/such/route/{f.id}")

    counts = samples(api, "holdback_api_requests_total")
    route = "/v1/files/{file_id}"
    assert counts[(("method", "GET"), ("route", route), ("status", "200"))] == 1
    assert counts[(("method", "GET"), ("route", route), ("status", "404"))] == 2
    assert counts[(("method", "POST"), ("route", "/v1/files"), ("status", "200"))] == 1
    assert counts[(("method", "GET"), ("route", "<unmatched>"), ("status", "404"))] == 1
    assert not any(f.id in value for labels in counts for _, value in labels)
    latency = samples(api, "holdback_api_request_duration_seconds_count")
    assert latency[(("method", "GET"), ("route", route))] == 3


def test_each_app_has_its_own_registry(start_api):
    first, second = start_api(), start_api()
    httpx.get(f"{first.url}/healthz")
    assert samples(first, "holdback_api_requests_total")[(("method", "GET"), ("route", "/healthz"), ("status", "200"))] == 1
    assert (("method", "GET"), ("route", "/healthz"), ("status", "200")) not in samples(second, "holdback_api_requests_total")


def test_migrations_run_at_start_on_an_empty_database(start_api, tmp_path):
    api = start_api(database_url=f"sqlite:///{tmp_path / 'fresh.db'}")
    client = api.openai(api.create_key("acme"))
    f = client.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    assert client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h").status == "validating"
