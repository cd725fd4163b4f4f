"""Finalization: write a batch's output and error files from its terminal rows, then close it.

Output file: one line per succeeded row. Error file: one line per failed, expired or cancelled row.
Rows are read in chunks in line order and streamed to disk, so memory stays bounded however big the
batch. The file ids are derived from the batch id, and the File rows, the batch's file ids and its
terminal status are written in one transaction after the files landed on disk: a crash anywhere
before that commit leaves the batch in its previous status, and the re-run rewrites the same files
under the same ids. Nothing is ever produced twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Callable

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from batch_processor.lease import held_by
from holdback.logs import log_event
from holdback import lifecycle
from holdback.db import transaction
from holdback.models import Batch, BatchStatus, File, RequestRow, RequestStatus
from holdback.results import any_unfinished, output_line
from holdback.retention import DEFAULT_FILE_TTL
from holdback.storage import FileStore, StoredFileWriter

log = logging.getLogger("batch_processor.finalize")

READ_CHUNK = 2000
DEFAULT_OUTPUT_TTL = DEFAULT_FILE_TTL  # OpenAI keeps batch output files 30 days unless asked otherwise
ERROR_STATUSES = (RequestStatus.failed, RequestStatus.expired, RequestStatus.cancelled)

_LINE_COLUMNS = (RequestRow.id, RequestRow.line, RequestRow.custom_id, RequestRow.response_status,
                 RequestRow.response_body, RequestRow.error_code, RequestRow.error_message)


def result_file_id(batch_id: str, kind: str) -> str:
    """The id of a batch's `output` or `error` file: the same on every re-run of finalization."""
    digest = hashlib.sha256(f"{batch_id}/{kind}".encode()).hexdigest()[:24]
    return f"file-{digest}"


@dataclass
class FinalizeResult:
    batch_id: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    output_lines: int
    error_lines: int
    seconds: float


class _Superseded(Exception):
    """The batch moved on (or its lease went elsewhere) while the files were written: roll back."""


class NotFinished(Exception):
    """Finalization was asked for a batch that still has unfinished rows."""


def begin_finalizing(factory: sessionmaker[Session], batch_id: str, owner: str | None) -> bool:
    """in_progress -> finalizing (every row is final); False if the batch moved on or is not ours."""
    with transaction(factory) as session:
        if any_unfinished(session, batch_id):
            return False
        return lifecycle.begin_finalizing(session, batch_id, int(time.time()), held_by(owner))


def finalize_batch(
    factory: sessionmaker[Session],
    store: FileStore,
    batch_id: str,
    *,
    to_status: BatchStatus,
    from_statuses: tuple[BatchStatus, ...],
    owner: str | None,
    keepalive: Callable[[], None] | None = None,
    chunk: int = READ_CHUNK,
) -> FinalizeResult | None:
    """Write both files and move the batch from one of `from_statuses` to `to_status`.

    Returns None when the batch is not (or no longer) in a `from_statuses` status held by `owner`.
    Raises NotFinished if a row is still unfinished: the caller closes rows first.
    """
    started = time.perf_counter()
    allowed = lifecycle.batch_sources(from_statuses, to_status)  # an undeclared move fails here, before any work
    with factory() as session:
        batch = session.get(Batch, batch_id)
        if batch is None or batch.status not in allowed:
            return None
        if any_unfinished(session, batch_id):
            raise NotFinished(f"batch {batch_id} still has unfinished rows")
        tenant_id, ttl = batch.tenant_id, batch.output_expires_after or DEFAULT_OUTPUT_TTL

    output_id, error_id = result_file_id(batch_id, "output"), result_file_id(batch_id, "error")
    output = _write_file(factory, store, batch_id, output_id, (RequestStatus.succeeded,), keepalive, chunk)
    errors = _write_file(factory, store, batch_id, error_id, ERROR_STATUSES, keepalive, chunk)

    now = int(time.time())
    files = [(output_id, "output", output), (error_id, "error", errors)]
    try:
        with transaction(factory) as session:
            for file_id, kind, (lines, size) in files:
                if lines and session.get(File, file_id) is None:
                    session.add(File(
                        id=file_id, tenant_id=tenant_id, filename=f"{batch_id}_{kind}.jsonl", purpose="batch_output",
                        bytes=size, created_at=now, expires_at=now + ttl, status="processed", storage_key=file_id,
                    ))
            session.flush()
            moved = lifecycle.close_batch(session, to_status, from_statuses, batch_id, now, held_by(owner),
                                          output_file_id=output_id if output[0] else None,
                                          error_file_id=error_id if errors[0] else None,
                                          claimed_by=None, lease_until=None)
            if not moved:
                raise _Superseded()
    except _Superseded:
        return None
    result = FinalizeResult(batch_id, to_status.value, output_id if output[0] else None,
                            error_id if errors[0] else None, output[0], errors[0], time.perf_counter() - started)
    log_event(log, "batch_finalized", batch_id=batch_id, status=result.status, output_lines=result.output_lines,
              error_lines=result.error_lines, output_file_id=result.output_file_id,
              error_file_id=result.error_file_id, seconds=round(result.seconds, 3))
    return result


# Characters a JSON string may hold raw that some line splitters take for a line end (Python's str.splitlines,
# JavaScript before ES2019): the model's text can hold any of them, and a reader that splits the file there
# gets half a line. json.dumps already escapes the C0 controls among them (\x0b, \x0c, \x1c-\x1e).
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def jsonl_line(doc: dict) -> str:
    """One JSONL line, UTF-8 kept, with nothing inside it any common reader would split it at."""
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).translate(_LINE_BREAKS) + "\n"


def _write_file(factory: sessionmaker[Session], store: FileStore, batch_id: str, file_id: str,
                statuses: tuple[RequestStatus, ...], keepalive: Callable[[], None] | None,
                chunk: int) -> tuple[int, int]:
    """Stream the rows with these statuses to the file; (lines, bytes). Nothing is kept if no lines."""
    lines = 0
    writer: StoredFileWriter = store.open_writer(file_id)
    try:
        for status in statuses:
            after = 0
            while True:
                with factory() as session:
                    rows = session.execute(
                        select(*_LINE_COLUMNS)
                        .where(RequestRow.batch_id == batch_id, RequestRow.status == status.value,
                               RequestRow.line > after)
                        .order_by(RequestRow.line)
                        .limit(chunk)
                    ).all()
                if not rows:
                    break
                writer.write("".join(jsonl_line(output_line(row)) for row in rows).encode())
                lines += len(rows)
                after = rows[-1].line
                if keepalive is not None:
                    keepalive()
        if not lines:
            writer.abort()
            return 0, 0
        return lines, writer.commit()
    except BaseException:
        writer.abort()
        raise
