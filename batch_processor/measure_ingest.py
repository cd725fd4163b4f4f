"""Measure one processor round on a big batch: validate + expand N lines into rows, queue the first window.

    python -m batch_processor.measure_ingest [--lines 50000] [--window 256]

With DATABASE_URL / REDIS_URL set it measures against those (a fresh Redis namespace; the batch,
its rows and jobs are deleted afterwards); otherwise against SQLite and an embedded Redis in a
temporary directory. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from rq.job import Job
from sqlalchemy import delete, select

from batch_processor.processor import Processor, ProcessorConfig
from holdback.broker import connect, stop_embedded_redis
from holdback.db import make_engine, make_sessionmaker, transaction
from holdback.models import Batch, File, RequestRow, new_id
from holdback.schema import upgrade
from holdback.settings import Settings
from holdback.storage import LocalFileStore
from holdback.tenancy import get_or_create_tenant


def _write_input(store: LocalFileStore, lines: int) -> tuple[str, int]:
    file_id = new_id("file-")
    prompt = "Summarise the following paragraph in one sentence. " * 8
    with store.open_writer(file_id) as writer:
        for i in range(lines):
            writer.write((json.dumps({
                "custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "sim-model", "max_tokens": 64, "messages": [{"role": "user", "content": prompt}]},
            }) + "\n").encode())
        return file_id, writer.commit()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m batch_processor.measure_ingest", description=__doc__.splitlines()[0])
    p.add_argument("--lines", type=int, default=50_000)
    p.add_argument("--window", type=int, default=256)
    args = p.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="hb-ingest-"))
    base = Settings()
    settings = base.model_copy(update={"data_dir": tmp, "redis_namespace": f"measure-{uuid.uuid4().hex[:8]}",
                                       "max_batch_requests": max(base.max_batch_requests, args.lines)})
    engine = make_engine(settings.sqlalchemy_url)
    upgrade(engine)
    factory = make_sessionmaker(engine)
    store = LocalFileStore(settings.files_dir)
    redis = connect(settings)
    file_id, size = _write_input(store, args.lines)
    with transaction(factory) as s:
        tenant = get_or_create_tenant(s, "measure-ingest")
        s.add(File(id=file_id, tenant_id=tenant.id, filename="measure.jsonl", purpose="batch", bytes=size,
                   storage_key=file_id))
        batch = Batch(tenant_id=tenant.id, endpoint="/v1/chat/completions", input_file_id=file_id,
                      completion_window="24h", window_seconds=86400)
        s.add(batch)
        s.flush()
        batch_id = batch.id

    processor = Processor(settings, ProcessorConfig(name="measure", window=args.window), factory=factory,
                          connection=redis, store=store)
    started = time.perf_counter()
    done = processor.tick()
    seconds = time.perf_counter() - started
    queued = redis.llen(processor.queue.queue.key)
    with factory() as s:
        total = s.get(Batch, batch_id).total
    print(json.dumps({"backend": engine.dialect.name, "lines": args.lines, "bytes": size, "rows": total,
                      "jobs_queued": queued, "expanded": done.expanded == [batch_id],
                      "round_seconds": round(seconds, 3)}))

    with factory() as s:
        ids = list(s.scalars(select(RequestRow.id).where(RequestRow.batch_id == batch_id)))
    for start in range(0, len(ids), 1000):
        redis.delete(*(Job.key_for(i) for i in ids[start:start + 1000]))
    for key in redis.scan_iter(match=f"*{settings.redis_namespace}*"):
        redis.delete(key)
    with transaction(factory) as s:
        s.execute(delete(RequestRow).where(RequestRow.batch_id == batch_id))
        s.execute(delete(Batch).where(Batch.id == batch_id))
        s.execute(delete(File).where(File.id == file_id))
    engine.dispose()
    if settings.redis_url is None:
        stop_embedded_redis(tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
