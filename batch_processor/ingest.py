"""Ingestion: validate a `validating` batch's input file and expand it into request rows.

The file is streamed line by line and rows are inserted (one COPY on PostgreSQL, chunks on SQLite)
inside ONE transaction that also moves the batch to `in_progress`. On SQLite, whose one write lock every
other tenant's workers need too, the lines are validated first into a spool on disk and the transaction
only inserts them: the lock is held for the insert, not for reading and checking the file. A crash
anywhere leaves either no rows (the batch is still `validating` and is redone from scratch by whoever
holds the lease next) or all rows with their final ids. Row ids are therefore stable from the moment
anyone can see them. Invalid input rolls the transaction back and fails the batch with `errors`; the
input file is only read, never changed.

Each line's model is checked against the gateway's list (`settings.validate_models`, batch_processor.served_models):
a line naming a model the gateway does not serve gets its row all the same, made `failed` (model_not_found) in the
same transaction, so it is in the error file while the other lines run; a batch whose every line is refused fails.
While the gateway gives no list the batch is left `validating` ("waiting") and tried again next round.
"""

from __future__ import annotations

import logging
import pickle
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from sqlalchemy import delete, update
from sqlalchemy.orm import Session, sessionmaker

from batch_processor.lease import held_by
from batch_processor.served_models import KnownModels, ModelsUnavailable, ServedModels
from holdback.logs import log_event
from batch_processor.validation import MAX_ERRORS, InputValidator, LineError
from holdback import lifecycle, tenant_limits
from holdback.db import transaction
from holdback.models import Batch, BatchStatus, File, RequestRow, RequestStatus, new_ids
from holdback.settings import Settings
from holdback.storage import FileStore

log = logging.getLogger("batch_processor.ingest")

INSERT_CHUNK = 5000
BETWEEN_LINES = 500  # how often expansion calls its `between` (a few ms of validating)


@dataclass
class IngestResult:
    batch_id: str
    # in_progress | failed | skipped (not validating, or the lease is not ours) | waiting (no model list yet)
    status: str
    total: int = 0
    model: str | None = None
    errors: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    refused: int = 0  # of total, the lines made failed at once (their model is not served)
    waiting_for: str | None = None  # why the batch is waiting: what the gateway answered for its model list


class _InvalidInput(Exception):
    """Raised inside the expansion transaction to roll back every row inserted so far."""


def expand_batch(
    factory: sessionmaker[Session],
    store: FileStore,
    batch_id: str,
    *,
    max_requests: int,
    owner: str | None = None,
    max_errors: int = MAX_ERRORS,
    chunk_rows: int = INSERT_CHUNK,
    settings: Settings | None = None,
    models: ServedModels | None = None,
    between: Callable[[], None] | None = None,
) -> IngestResult:
    """Validate the batch's input and create its rows (status pending); the batch goes in_progress.

    `owner`: the processor holding the batch's lease; the transitions only happen while it still
    does. None skips that check (one-off tools and benchmarks). `settings`: the tenant's limits on
    enqueued requests and tokens (holdback.tenant_limits) apply; a batch that would pass one fails; and
    with `validate_models` each line's model is checked against `models` (default: this process's list of
    the settings' gateway). Without `settings` or `models` every model name is taken as served.
    `between` is called every `BETWEEN_LINES` lines while they are validated (the processor refills other
    batches' windows); on PostgreSQL that is inside the expansion's transaction, which holds this batch's row
    lock, so it must not write this batch.
    """
    started = time.perf_counter()
    with factory() as session:
        batch = session.get(Batch, batch_id)
        if batch is None or batch.status != BatchStatus.validating.value:
            return IngestResult(batch_id, "skipped")
        endpoint, tenant_id = batch.endpoint, batch.tenant_id
        expires_at = batch.expires_at or (batch.created_at + batch.window_seconds)
        input_file = session.get(File, batch.input_file_id)
        storage_key = input_file.storage_key if input_file is not None else None
        input_bytes = input_file.bytes if input_file is not None else 0
        file_usable = (input_file is not None and input_file.deleted_at is None
                       and input_file.tenant_id == tenant_id and store.exists(input_file.storage_key))
    if not file_usable:
        error = LineError("file_not_found", f"The input file {batch.input_file_id} no longer exists; upload the "
                          "file again and create a new batch.", None, "input_file_id")
        return fail_batch(factory, batch_id, owner, [error], started)
    if settings is not None:
        # Already at a limit: refused before a line is read.
        with factory() as session:
            refused = _over_limit(session, settings, batch_id, tenant_id, 1, input_bytes)
        if refused is not None:
            return fail_batch(factory, batch_id, owner, [refused], started)
    if models is None and settings is not None and settings.validate_models:
        models = ServedModels.shared(settings.gateway_url, settings.gateway_key, settings.models_refresh_seconds)
    try:
        known = KnownModels(models) if models is not None else None
    except ModelsUnavailable as exc:
        return IngestResult(batch_id, "waiting", waiting_for=exc.reason)

    validator = InputValidator(endpoint, max_requests, max_errors, known)
    refused, refusals, spool = None, [], None
    try:
        rows = _validated_rows(store, storage_key, validator, batch_id, tenant_id, refusals, BETWEEN_LINES,
                               between)
        if factory.kw["bind"].dialect.name == "sqlite":
            rows = spool = _Spool(rows, chunk_rows)  # validated here, before the write lock is taken
            if validator.finish():
                raise _InvalidInput()
        with transaction(factory) as session:
            # Take the batch's row lock (PostgreSQL) / the write lock (SQLite) first, so a second
            # expansion of the same batch waits for this one and then finds it no longer validating.
            locked = session.execute(
                update(Batch)
                .where(Batch.id == batch_id, Batch.status == BatchStatus.validating.value, held_by(owner))
                .values(lease_until=Batch.lease_until)
                .execution_options(synchronize_session=False)
            ).rowcount
            if locked != 1:
                return IngestResult(batch_id, "skipped")
            # Nothing can be here (expansion commits all or nothing); this keeps a retry exact even so.
            session.execute(delete(RequestRow).where(RequestRow.batch_id == batch_id))
            with _row_writer(session, chunk_rows) as write:
                for row in rows:
                    write(row)
            if validator.ok and validator.runnable > 0:
                _refuse_rows(session, refusals)
            errors = validator.finish()
            if errors:
                raise _InvalidInput()
            if settings is not None:
                refused = _over_limit(session, settings, batch_id, tenant_id, validator.runnable, input_bytes)
                if refused is not None:
                    raise _InvalidInput()
            now = time.time()
            if not lifecycle.start_batch(session, batch_id, int(now), held_by(owner), total=validator.count,
                                         failed=len(validator.refused), model=validator.model,
                                         expires_at=expires_at):
                raise _LostRace()
    except _InvalidInput:
        return fail_batch(factory, batch_id, owner, [refused] if refused else validator.errors, started)
    except _LostRace:
        return IngestResult(batch_id, "skipped")
    except ModelsUnavailable as exc:  # a second look at the model list found no gateway: rolled back, wait
        return IngestResult(batch_id, "waiting", waiting_for=exc.reason)
    finally:
        if spool is not None:
            spool.close()
    result = IngestResult(batch_id, BatchStatus.in_progress.value, validator.count, validator.model,
                          seconds=time.perf_counter() - started, refused=len(validator.refused))
    log_event(log, "batch_expanded", batch_id=batch_id, tenant_id=tenant_id, total=result.total,
              refused=result.refused, model=result.model, seconds=round(result.seconds, 3))
    return result


def _over_limit(session: Session, settings: Settings, batch_id: str, tenant_id: str, requests: int,
                input_bytes: int) -> LineError | None:
    name = tenant_limits.tenant_name(session, tenant_id)
    refused = tenant_limits.refuse_expansion(tenant_limits.limits_for(settings, name),
                                             tenant_limits.usage(session, tenant_id, excluding=batch_id), name,
                                             requests, input_bytes)
    return LineError(refused.code, refused.message) if refused is not None else None


class _LostRace(Exception):
    """The batch stopped being ours (or validating) before the expansion committed."""


ROW_COLUMNS = (
    "id", "batch_id", "tenant_id", "line", "custom_id", "url", "body", "status", "attempts", "evictions",
    "transient_failures", "input_tokens", "cached_tokens", "output_tokens", "reasoning_tokens", "duplicates",
    "created_at", "updated_at",
)


def _validated_rows(store: FileStore, storage_key: str, validator: InputValidator, batch_id: str,
                    tenant_id: str, refused: list[tuple[str, LineError]], every: int,
                    between: Callable[[], None] | None) -> Iterator[tuple]:
    """The input's rows (`ROW_COLUMNS` order) as its lines are checked, `between` called every `every`
    lines; the lines refused for their model are added to `refused` as (row id, error)."""
    pending = lifecycle.INITIAL.value
    ids = new_ids("batch_req_")
    with store.open_read(storage_key) as fh:
        for line_no, raw in enumerate(fh, start=1):
            if between is not None and line_no % every == 0:
                between()
            request = validator.check(line_no, raw)
            if validator.stopped:
                break
            if request is None or not validator.ok:
                continue  # once any line is bad the batch fails: keep validating, stop inserting
            now = time.time()
            row_id = next(ids)
            yield (row_id, batch_id, tenant_id, request.line, request.custom_id, request.url,
                   request.body, pending, 0, 0, 0, 0, 0, 0, 0, 0, now, now)
            if request.refusal is not None:
                refused.append((row_id, request.refusal))


class _Spool:
    """Rows drained from `rows` at once into a temporary file, a pickled chunk at a time (memory stays one
    chunk whatever the file's size), and read back in order, once."""

    def __init__(self, rows: Iterator[tuple], chunk_rows: int):
        self._file = tempfile.TemporaryFile(prefix="holdback-expand-")
        try:
            chunk: list[tuple] = []
            for row in rows:
                chunk.append(row)
                if len(chunk) >= chunk_rows:
                    pickle.dump(chunk, self._file, protocol=pickle.HIGHEST_PROTOCOL)
                    chunk = []
            if chunk:
                pickle.dump(chunk, self._file, protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException:
            self._file.close()
            raise

    def __iter__(self) -> Iterator[tuple]:
        self._file.seek(0)
        while True:
            try:
                yield from pickle.load(self._file)
            except EOFError:
                return

    def close(self) -> None:
        self._file.close()


def _refuse_rows(session: Session, refused: list[tuple[str, LineError]]) -> None:
    """The refused lines' rows, just written pending, made failed with their error: the error file's
    `{"response": null, "error": {"code", "message"}}` lines. After the writer is done (a COPY holds the
    connection until it ends)."""
    conn, now = session.connection(), time.time()
    for row_id, error in refused:
        lifecycle.finish(conn, row_id, RequestStatus.failed, now, response_status=None, response_body=None,
                         error_code=error.code, error_message=error.message, input_tokens=0, output_tokens=0,
                         cached_tokens=0, reasoning_tokens=0)


@contextmanager
def _row_writer(session: Session, chunk_rows: int) -> Iterator[Callable[[tuple], None]]:
    """A function that writes one row tuple (in `ROW_COLUMNS` order) in the session's transaction.

    PostgreSQL gets one COPY for the whole file, each row sent as it comes, several times faster than batched
    INSERTs for 50,000 rows; the server inserts what it has received while the next lines are validated.
    SQLite gets the driver's executemany INSERT per `chunk_rows` rows (quick in one transaction). Running
    those on a second thread while the next chunk is validated measured no better (sqlite3 lets go of the
    GIL for each row's insert but needs it back for the next row's parameters, held by the validating
    thread), so they run in line."""
    connection = session.connection()
    if connection.dialect.name == "postgresql":
        copy_sql = f"COPY request_rows ({', '.join(ROW_COLUMNS)}) FROM STDIN"
        with connection.connection.dbapi_connection.cursor() as cursor, cursor.copy(copy_sql) as copy:
            yield copy.write_row
        return
    # The driver's own executemany with the tuples as they are: SQLAlchemy's would build a dict per row and
    # compile parameters for each (a third of the write's time on SQLite).
    insert_sql = (f"INSERT INTO request_rows ({', '.join(ROW_COLUMNS)}) "
                  f"VALUES ({', '.join('?' for _ in ROW_COLUMNS)})")
    chunk: list[tuple] = []

    def write(row: tuple) -> None:
        chunk.append(row)
        if len(chunk) >= chunk_rows:
            connection.exec_driver_sql(insert_sql, chunk)
            chunk.clear()

    yield write
    if chunk:
        connection.exec_driver_sql(insert_sql, chunk)


def fail_batch(factory: sessionmaker[Session], batch_id: str, owner: str | None, errors: list[LineError],
               started: float | None = None) -> IngestResult:
    """A `validating` batch → `failed` with `errors` (still ours and still validating, else skipped)."""
    started = time.perf_counter() if started is None else started
    entries = [e.as_dict() for e in errors]
    with transaction(factory) as session:
        moved = lifecycle.fail_batch(session, batch_id, int(time.time()), held_by(owner), errors=entries,
                                     claimed_by=None, lease_until=None)
    if not moved:
        return IngestResult(batch_id, "skipped")
    log_event(log, "batch_failed_validation", level=logging.WARNING, batch_id=batch_id, errors=len(entries),
              first_code=entries[0]["code"], first_line=entries[0]["line"])
    return IngestResult(batch_id, BatchStatus.failed.value, errors=entries, seconds=time.perf_counter() - started)
