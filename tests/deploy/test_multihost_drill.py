"""The multi-host drill: two API servers, two processors and three worker processes on PostgreSQL, Redis
and a real S3 server, each process on its own host (a network namespace, or loopback where the machine
does not allow namespaces; the test output says which). A 5,000-line batch runs while one worker host
and the processor that owns the batch are killed (SIGKILL); every request still ends with exactly one
final result and the output file is complete."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from bench.lib.cluster import Cluster, ClusterSpec
from tests.conftest import POSTGRES_URL, REDIS_URL

LINES = 5_000


@pytest.fixture
def cluster(tmp_path) -> Cluster:  # noqa: ANN001
    try:
        create_engine(POSTGRES_URL).connect().close()
    except OperationalError as exc:
        pytest.skip(f"the drill needs PostgreSQL at {POSTGRES_URL} (set HOLDBACK_TEST_POSTGRES_URL): {exc.orig}")
    with Cluster(ClusterSpec(postgres_url=POSTGRES_URL, redis_url=REDIS_URL), tmp_path) as running:
        yield running


@pytest.mark.e2e
@pytest.mark.services  # on PostgreSQL and Redis servers: `make test`'s second pass runs it
def test_drill_kills_a_worker_host_and_the_owning_processor_and_loses_nothing(cluster: Cluster) -> None:
    print(f"drill hosts: {cluster.network.describe()}")
    batch_id = cluster.submit(LINES, upload_via="api-1", create_via="api-2")

    running = cluster.wait_batch(batch_id, lambda b: b["request_counts"]["completed"] >= LINES // 5, 300,
                                 "a fifth of the batch")
    assert running["status"] == "in_progress"
    engine = create_engine(cluster.admin_database_url)
    with engine.connect() as conn:
        owner = conn.execute(text("SELECT claimed_by FROM batches WHERE id = :id"), {"id": batch_id}).scalar()
    assert owner in ("processor-1", "processor-2"), owner
    cluster.kill("worker-1")
    cluster.kill(owner)

    done = cluster.wait_batch(batch_id, lambda b: b["status"] in ("completed", "failed", "expired", "cancelled"),
                              600, "the batch to finish after the kills")
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}

    with engine.connect() as conn:
        final = conn.execute(text(
            "SELECT status, count(*) FROM request_rows WHERE batch_id = :id GROUP BY status"), {"id": batch_id}).all()
        successes = conn.execute(text(
            "SELECT count(*) FROM attempts WHERE batch_id = :id AND outcome = 'success'"), {"id": batch_id}).scalar()
        abandoned = conn.execute(text(
            "SELECT count(*) FROM attempts WHERE batch_id = :id AND outcome = 'abandoned'"), {"id": batch_id}).scalar()
        taken_over = conn.execute(text("SELECT claimed_by FROM batches WHERE id = :id"), {"id": batch_id}).scalar()
    engine.dispose()
    assert dict(final) == {"succeeded": LINES}
    assert successes == LINES, "a request was answered twice (or not at all)"
    assert taken_over is None  # released at finalization, by the surviving processor

    other_api = "api-2"  # not the one the file was uploaded through: the bytes come from S3
    with cluster.http(other_api) as http:
        output = http.get(f"/v1/files/{done['output_file_id']}/content")
    assert output.status_code == 200
    lines = [json.loads(line) for line in output.text.splitlines()]
    assert len(lines) == LINES and done.get("error_file_id") is None
    assert sorted(line["custom_id"] for line in lines) == sorted(f"req-{i}" for i in range(LINES))
    assert all(line["response"]["status_code"] == 200 for line in lines)
    seconds = done["completed_at"] - done["in_progress_at"]
    print(f"drill: {LINES} requests in {seconds} s after the kills of worker-1 and {owner}; "
          f"{abandoned} attempts abandoned by the killed worker and retried")
