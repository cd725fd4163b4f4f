"""Measure ingest against the database's own bulk load of the same rows, in the same run.

    python -m batch_processor.measure_ingest [--lines 50000] [--window 256] [--rounds 3] [--file input.jsonl]

Each round times (a) one processor round on a fresh `validating` batch: validate + expand N lines into rows,
move the batch to in_progress, queue the first window; (b) the baseline: the same number of row tuples,
built beforehand, loaded by the database's own bulk path in one transaction (COPY on PostgreSQL, the
DB-API's executemany on SQLite); (c) validation alone (read + parse + check every line, no database).
Reported: the median of per-round ratios baseline ÷ ingest (1.0 = as fast as the bulk load), and where
the rest of the ingest's time goes. The two measurements alternate which goes first; an untimed ingest of
a 1,000-line file runs before them (the processor's imports and first statements).

The input is generated unless --file is given: N chat lines with a 424-character prompt and max_tokens
64 (580 bytes a line, 29 MB for 50,000). With DATABASE_URL / REDIS_URL set it measures against
those (a fresh Redis namespace; batches, rows and jobs are deleted afterwards); otherwise against SQLite
and an embedded Redis in a temporary directory. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from sqlalchemy import Engine, delete, select

from batch_processor.gateway_reach import GatewayReach
from batch_processor.ingest import ROW_COLUMNS
from batch_processor.processor import Processor
from batch_processor.processor_config import ProcessorConfig
from batch_processor.validation import InputValidator
from holdback.broker import connect, stop_embedded_redis
from holdback.contract import CHAT_ENDPOINT
from holdback.db import make_engine, make_sessionmaker, transaction
from holdback.jobs import delete_jobs
from holdback.models import Batch, File, RequestRow, new_id
from holdback.schema import upgrade
from holdback.settings import Settings
from holdback.storage import LocalFileStore
from holdback.tenancy import get_or_create_tenant


WARMUP_LINES = 1000


def _write_input(store: LocalFileStore, lines: int, source: Path | None) -> tuple[str, int]:
    file_id = new_id("file-")
    prompt = "Summarise the following paragraph in one sentence. " * 8
    with store.open_writer(file_id) as writer:
        if source is not None:
            with source.open("rb") as fh:
                for raw in fh:
                    writer.write(raw)
            return file_id, writer.commit()
        for i in range(lines):
            writer.write((json.dumps({
                "custom_id": f"req-{i}", "method": "POST", "url": CHAT_ENDPOINT.path,
                "body": {"model": "sim-model", "max_tokens": 64, "messages": [{"role": "user", "content": prompt}]},
            }) + "\n").encode())
        return file_id, writer.commit()


def _validate(store: LocalFileStore, file_id: str, max_requests: int) -> tuple[list, float]:
    """Every line through the ingest's validator, no database: the requests and the seconds it took."""
    validator = InputValidator(CHAT_ENDPOINT.path, max_requests)
    started = time.perf_counter()
    requests = []
    with store.open_read(file_id) as fh:
        for line_no, raw in enumerate(fh, start=1):
            request = validator.check(line_no, raw)
            if request is not None:
                requests.append(request)
    seconds = time.perf_counter() - started
    if validator.finish():
        raise SystemExit(f"the input file has invalid lines: {validator.errors[:3]}")
    return requests, seconds


def _row_tuples(requests: list, batch_id: str, tenant_id: str) -> list[tuple]:
    """The rows ingest would write for these requests (ROW_COLUMNS order)."""
    now = time.time()
    return [(new_id("batch_req_"), batch_id, tenant_id, r.line, r.custom_id, r.url, r.body, "pending",
             0, 0, 0, 0, 0, 0, 0, 0, now, now) for r in requests]


def _bulk_load(engine: Engine, rows: list[tuple]) -> float:
    """The database's own bulk load of `rows` in one transaction; seconds, commit included."""
    columns = ", ".join(ROW_COLUMNS)
    raw = engine.raw_connection()
    try:
        started = time.perf_counter()
        cursor = raw.cursor()
        if engine.dialect.name == "postgresql":
            with cursor.copy(f"COPY request_rows ({columns}) FROM STDIN") as copy:
                for row in rows:
                    copy.write_row(row)
        else:
            cursor.execute("BEGIN")
            marks = ", ".join("?" for _ in ROW_COLUMNS)
            cursor.executemany(f"INSERT INTO request_rows ({columns}) VALUES ({marks})", rows)
        raw.commit()
        seconds = time.perf_counter() - started
        cursor.close()
    finally:
        raw.close()
    return seconds


def _new_batch(factory, tenant_id: str, file_id: str) -> str:
    with transaction(factory) as s:
        batch = Batch(tenant_id=tenant_id, endpoint=CHAT_ENDPOINT.path, input_file_id=file_id,
                      completion_window="24h", window_seconds=86400)
        s.add(batch)
        s.flush()
        return batch.id


def _drop_batch(factory, redis, queue_key: str, batch_id: str) -> None:
    redis.delete(queue_key)
    with factory() as s:
        ids = list(s.scalars(select(RequestRow.id).where(RequestRow.batch_id == batch_id)))
    delete_jobs(redis, ids)
    with transaction(factory) as s:
        s.execute(delete(RequestRow).where(RequestRow.batch_id == batch_id))
        s.execute(delete(Batch).where(Batch.id == batch_id))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m batch_processor.measure_ingest", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--lines", type=int, default=50_000, help="lines of the generated input (default %(default)s)")
    p.add_argument("--window", type=int, default=256, help="processor window (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; the median ratio is reported (default %(default)s)")
    p.add_argument("--file", type=Path, help="a chat-completions JSONL to ingest instead of the generated one")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.lines < 1:
        p.error("--rounds and --lines must be at least 1")

    tmp = Path(tempfile.mkdtemp(prefix="hb-ingest-"))
    base = Settings()
    # No gateway runs here: the lines' model is not checked against one (that is a request, not ingest), nor is
    # one asked for before a claim.
    settings = base.model_copy(update={"data_dir": tmp, "redis_namespace": f"measure-{uuid.uuid4().hex[:8]}",
                                       "max_batch_requests": max(base.max_batch_requests, args.lines),
                                       "validate_models": False})
    engine = make_engine(settings.sqlalchemy_url)
    upgrade(engine)
    factory = make_sessionmaker(engine)
    store = LocalFileStore(settings.files_dir)
    redis = connect(settings)
    file_id, size = _write_input(store, args.lines, args.file)
    warmup_id, warmup_size = _write_input(store, WARMUP_LINES, None)
    with transaction(factory) as s:
        tenant_id = get_or_create_tenant(s, "measure-ingest").id
        for fid, n in ((file_id, size), (warmup_id, warmup_size)):
            s.add(File(id=fid, tenant_id=tenant_id, filename="measure.jsonl", purpose="batch", bytes=n,
                       storage_key=fid))
    processor = Processor(settings, ProcessorConfig(name="measure", window=args.window), factory=factory,
                          connection=redis, store=store, gateway=GatewayReach(None))

    def ingest(file_id: str = file_id) -> tuple[float, int, int]:
        batch_id = _new_batch(factory, tenant_id, file_id)
        started = time.perf_counter()
        done = processor.tick()
        seconds = time.perf_counter() - started
        if done.expanded != [batch_id]:
            raise SystemExit(f"the processor did not expand the batch: {done}")
        queued = redis.llen(processor.queue.queue.key)
        with factory() as s:
            total = s.get(Batch, batch_id).total
        _drop_batch(factory, redis, processor.queue.queue.key, batch_id)
        return seconds, total, queued

    def bulk() -> tuple[float, float]:
        requests, validate_s = _validate(store, file_id, settings.max_batch_requests)
        batch_id = _new_batch(factory, tenant_id, file_id)
        seconds = _bulk_load(engine, _row_tuples(requests, batch_id, tenant_id))
        _drop_batch(factory, redis, processor.queue.queue.key, batch_id)
        return seconds, validate_s

    # A running processor has made its imports and compiled its statements: one small untimed round first,
    # so that the first timed round does not pay for them (the bulk load has none to pay).
    ingest(warmup_id)
    rounds = []
    for r in range(args.rounds):
        if r % 2:
            bulk_s, validate_s = bulk()
            ingest_s, total, queued = ingest()
        else:
            ingest_s, total, queued = ingest()
            bulk_s, validate_s = bulk()
        rounds.append({"ingest_s": round(ingest_s, 3), "bulk_load_s": round(bulk_s, 3),
                       "validate_s": round(validate_s, 3), "ratio": round(bulk_s / ingest_s, 3)})
    median = lambda key: statistics.median(x[key] for x in rounds)  # noqa: E731
    ingest_s, bulk_s, validate_s = median("ingest_s"), median("bulk_load_s"), median("validate_s")
    print(json.dumps({
        "backend": engine.dialect.name, "file": str(args.file) if args.file else "generated", "lines": args.lines,
        "bytes": size, "rows": total, "jobs_queued": queued, "rounds": rounds,
        "median_ratio_bulk_over_ingest": median("ratio"),
        # Where the ingest's time goes beyond the bulk load (medians): reading + parsing + validating the
        # lines, and the rest (row ids and tuples, the lease and batch updates, queueing the first window).
        "split_s": {"bulk_load": bulk_s, "validate": validate_s,
                    "rest": round(max(0.0, ingest_s - bulk_s - validate_s), 3)},
    }))

    for key in redis.scan_iter(match=f"*{settings.redis_namespace}*"):
        redis.delete(key)
    with transaction(factory) as s:
        s.execute(delete(File).where(File.id.in_([file_id, warmup_id])))
    engine.dispose()
    if settings.redis_url is None:
        stop_embedded_redis(tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
