from sqlalchemy import inspect

from holdback.db import make_engine


def test_backend_has_schema_and_redis(backend):
    engine = make_engine(backend.database_url)
    tables = set(inspect(engine).get_table_names())
    assert {"tenants", "api_keys", "files", "batches", "request_rows", "attempts"} <= tables
    r = backend.redis()
    r.set(f"{backend.namespace}:probe", "1")
    assert r.get(f"{backend.namespace}:probe") == b"1"
