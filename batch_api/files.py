"""The Files API under /v1: upload, list, retrieve, download and delete a tenant's files."""

from __future__ import annotations

import logging
from typing import Annotated, Iterator, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from batch_api.auth import ContextDep, SessionDep, TenantDep, TenantRoute
from batch_api.errors import BadRequest, ServerError
from holdback.logs import log_event
from batch_api.openapi import TENANT_ERRORS, UPLOAD_BODY, UPLOAD_ERRORS
from batch_api.schemas import FileDeleted, FileList, FileObject, file_to_api, list_page
from batch_api.tenant_scope import get_file, list_files
from batch_api.uploads import UploadLimits, receive_upload, record_upload
from holdback.models import File, new_id, now
from holdback.retention import FileInUse, check_deletable
from holdback.storage import CHUNK

router = APIRouter(tags=["files"], route_class=TenantRoute, responses=TENANT_ERRORS)
log = logging.getLogger("batch_api.files")


@router.post(
    "/v1/files", response_model=FileObject, summary="Upload a file (multipart: purpose, file)",
    responses=UPLOAD_ERRORS, openapi_extra=UPLOAD_BODY,
)
async def upload_file(request: Request, tenant: TenantDep, context: ContextDep, session: SessionDep) -> dict:
    file_id = new_id("file-")
    upload = await receive_upload(request, context.store, UploadLimits.from_settings(context.settings), file_id)
    file = await run_in_threadpool(record_upload, session, context.store, tenant.id, upload, now())
    log_event(log, "file.uploaded", file_id=file.id, tenant_id=tenant.id, purpose=file.purpose, bytes=file.bytes)
    return file_to_api(file)


@router.get("/v1/files", response_model=FileList, summary="List files, newest first by default")
def list_tenant_files(
    tenant: TenantDep,
    session: SessionDep,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> dict:
    files, has_more = list_files(
        session, tenant.id, purpose=purpose, limit=limit, descending=order == "desc", after=after
    )
    return list_page([file_to_api(f) for f in files], has_more)


@router.get("/v1/files/{file_id}", response_model=FileObject, summary="Retrieve a file")
def retrieve_file(file_id: str, tenant: TenantDep, session: SessionDep) -> dict:
    return file_to_api(get_file(session, tenant.id, file_id))


@router.get(
    "/v1/files/{file_id}/content",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}}},
    summary="Download a file's bytes",
)
def download_file(file_id: str, tenant: TenantDep, context: ContextDep, session: SessionDep) -> StreamingResponse:
    file = get_file(session, tenant.id, file_id)
    try:
        # Opened now: a delete racing the download cannot cut the stream short.
        handle = context.store.open_read(file.storage_key)
    except FileNotFoundError:
        raise _missing_bytes(file) from None
    media_type = "application/jsonl" if file.filename.lower().endswith(".jsonl") else "application/octet-stream"
    return StreamingResponse(
        _stream(handle),
        media_type=media_type,
        headers={
            "content-length": str(file.bytes),
            "content-disposition": f'attachment; filename="{_header_safe(file.filename)}"',
        },
    )


@router.delete("/v1/files/{file_id}", response_model=FileDeleted, summary="Delete a file")
def delete_file(file_id: str, tenant: TenantDep, context: ContextDep, session: SessionDep) -> dict:
    file = get_file(session, tenant.id, file_id)
    try:
        check_deletable(session, file.id)
    except FileInUse as exc:
        # 400, not 409: the SDK retries 409 at once, and the batch may hold the file for hours.
        raise BadRequest(str(exc), param="file_id", code="file_in_use") from None
    file.deleted_at = now()
    session.commit()
    # The row is gone for the API first; the bytes follow (a leftover is harmless, a dangling row is not).
    context.store.delete(file.storage_key)
    log_event(log, "file.deleted", file_id=file.id, tenant_id=tenant.id)
    return {"id": file.id, "object": "file", "deleted": True}


def _stream(handle) -> Iterator[bytes]:  # noqa: ANN001
    with handle:
        while chunk := handle.read(CHUNK):
            yield chunk


def _header_safe(filename: str) -> str:
    return "".join(c if 32 <= ord(c) < 127 and c not in '"\\' else "_" for c in filename)


def _missing_bytes(file: File) -> ServerError:
    return ServerError(
        f"The stored content of file '{file.id}' is missing on the server; upload the file again.",
        param="file_id",
        code="file_content_missing",
    )
