"""Every lookup a tenant can make: its own live files and its own batches, nothing else.

Another tenant's id and an id that never existed answer the same 404, so ids leak nothing;
that includes the `after` cursor of the list routes.
A file is live until it is deleted or its `expires_at` passes.
"""

from __future__ import annotations

from sqlalchemy import Select, and_, or_, select
from sqlalchemy.orm import Session

from batch_api.errors import NotFound
from holdback.models import Batch, File, now


def file_not_found(file_id: str, param: str | None = None) -> NotFound:
    return NotFound(
        f"No file with id '{file_id}'. Check the id: it must be a file this API key's tenant uploaded and has not deleted.",
        param=param,
    )


def batch_not_found(batch_id: str, param: str | None = None) -> NotFound:
    return NotFound(
        f"No batch with id '{batch_id}'. Check the id: it must be a batch this API key's tenant created.",
        param=param,
    )


def live_files(tenant_id: str) -> Select[tuple[File]]:
    current = now()
    return select(File).where(
        File.tenant_id == tenant_id,
        File.deleted_at.is_(None),
        or_(File.expires_at.is_(None), File.expires_at > current),
    )


def get_file(session: Session, tenant_id: str, file_id: str, *, param: str | None = None) -> File:
    file = session.scalar(live_files(tenant_id).where(File.id == file_id))
    if file is None:
        raise file_not_found(file_id, param)
    return file


def list_files(
    session: Session, tenant_id: str, *, purpose: str | None, limit: int, descending: bool, after: str | None
) -> tuple[list[File], bool]:
    query = live_files(tenant_id)
    if purpose is not None:
        query = query.where(File.purpose == purpose)
    if after is not None:
        # The cursor may have been deleted since the previous page; its position still counts.
        cursor = session.scalar(select(File).where(File.tenant_id == tenant_id, File.id == after))
        if cursor is None:
            raise file_not_found(after, "after")
        query = query.where(_beyond((File.created_at, File.seq, File.id), (cursor.created_at, cursor.seq, cursor.id), descending))
    order = (File.created_at, File.seq, File.id)
    query = query.order_by(*(c.desc() if descending else c.asc() for c in order)).limit(limit + 1)
    rows = list(session.scalars(query))
    return rows[:limit], len(rows) > limit


def get_batch(session: Session, tenant_id: str, batch_id: str) -> Batch:
    batch = session.scalar(select(Batch).where(Batch.tenant_id == tenant_id, Batch.id == batch_id))
    if batch is None:
        raise batch_not_found(batch_id)
    return batch


def list_batches(
    session: Session, tenant_id: str | None, *, limit: int, after: str | None, status: str | None = None
) -> tuple[list[Batch], bool]:
    """Newest first. `tenant_id=None` lists every tenant's batches (operator routes only)."""
    query = select(Batch)
    if tenant_id is not None:
        query = query.where(Batch.tenant_id == tenant_id)
    if status is not None:
        query = query.where(Batch.status == status)
    if after is not None:
        cursor_query = select(Batch).where(Batch.id == after)
        if tenant_id is not None:
            cursor_query = cursor_query.where(Batch.tenant_id == tenant_id)
        cursor = session.scalar(cursor_query)
        if cursor is None:
            raise batch_not_found(after, "after")
        query = query.where(_beyond((Batch.seq, Batch.id), (cursor.seq, cursor.id), descending=True))
    query = query.order_by(Batch.seq.desc(), Batch.id.desc()).limit(limit + 1)
    rows = list(session.scalars(query))
    return rows[:limit], len(rows) > limit


def _beyond(columns: tuple, values: tuple, descending: bool):  # noqa: ANN202
    """Rows strictly after `values` in the (lexicographic) order of `columns`, written out so
    every database plans it with the tenant index."""
    clauses = []
    for i, column in enumerate(columns):
        equal_prefix = [columns[j] == values[j] for j in range(i)]
        step = column < values[i] if descending else column > values[i]
        clauses.append(and_(*equal_prefix, step))
    return or_(*clauses)
