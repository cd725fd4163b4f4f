"""Receive a multipart file upload as a stream, straight onto disk, in bounded memory.

The body is fed chunk by chunk from `request.stream()` into python_multipart's streaming parser;
the `file` part goes directly into the file store's `open_writer`, which enforces the byte limit and
publishes the file only on commit. A rejected upload therefore leaves nothing behind. After a
rejection the rest of the body is read and discarded (up to the largest legal upload) so the
client sees our answer instead of a reset connection.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request

from batch_api.boundary import reject_nul
from batch_api.errors import ApiError, BadRequest, PayloadTooLarge, RequestTimeout
from batch_api.schemas import EXPIRES_AFTER_MAX, EXPIRES_AFTER_MIN, UPLOAD_PURPOSES
from holdback.models import File
from holdback.retention import default_expiry
from holdback.settings import Settings
from holdback.storage import FileStore, FileTooLarge, StoredFileWriter

# Room for the form fields, part headers and boundaries around the file itself.
FORM_OVERHEAD = 64 * 1024
# Form fields other than the file are small; anything bigger is not a field we know.
FIELD_MAX_BYTES = 16 * 1024
MAX_FIELDS = 32
FILENAME_MAX = 255


@dataclass(frozen=True)
class UploadLimits:
    max_upload_bytes: int
    max_batch_file_bytes: int
    # The least an upload must send in each PACE_WINDOW (see `paced`).
    min_bytes_per_minute: int = 16 * 1024

    @classmethod
    def from_settings(cls, settings: Settings) -> "UploadLimits":
        return cls(settings.max_upload_bytes, settings.max_batch_file_bytes, settings.upload_min_bytes_per_minute)

    def for_purpose(self, purpose: str | None) -> int:
        if purpose == "batch":
            return min(self.max_upload_bytes, self.max_batch_file_bytes)
        return self.max_upload_bytes


@dataclass
class ReceivedUpload:
    file_id: str
    filename: str
    purpose: str
    bytes: int
    expires_after_seconds: int | None


def too_large(limit: int, purpose: str | None) -> PayloadTooLarge:
    scope = "for purpose=batch" if purpose == "batch" else "for an upload"
    return PayloadTooLarge(
        f"The file is larger than the {limit} byte ({limit / (1024 * 1024):.1f} MiB) limit {scope}; "
        "split it into smaller files.",
        param="file",
    )


def check_purpose(purpose: str) -> None:
    if purpose not in UPLOAD_PURPOSES:
        raise BadRequest(
            f"purpose {purpose!r} is not accepted for uploads; use one of: {', '.join(UPLOAD_PURPOSES)}.",
            param="purpose",
        )


def check_filename(filename: str, purpose: str) -> None:
    if purpose == "batch" and not filename.lower().endswith(".jsonl"):
        raise BadRequest(
            f"Files with purpose=batch must be JSONL with a .jsonl name; got {filename!r}. Rename the file to *.jsonl.",
            param="file",
        )


@dataclass
class _Part:
    headers: dict[str, bytes] = field(default_factory=dict)
    name: str | None = None
    filename: str | None = None
    value: bytearray = field(default_factory=bytearray)


class MultipartUpload:
    """Parser callbacks for one upload body; `feed` each chunk, then `finish`."""

    def __init__(self, store: FileStore, file_id: str, limits: UploadLimits, boundary: bytes, declared: int | None):
        self.store = store
        self.file_id = file_id
        self.limits = limits
        self.declared = declared
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.writer: StoredFileWriter | None = None
        self.file_done = False
        self.ended = False
        self._part: _Part | None = None
        self._header_field = bytearray()
        self._header_value = bytearray()
        self.parser = MultipartParser(
            boundary,
            callbacks={
                "on_part_begin": self._on_part_begin,
                "on_header_field": self._on_header_field,
                "on_header_value": self._on_header_value,
                "on_header_end": self._on_header_end,
                "on_headers_finished": self._on_headers_finished,
                "on_part_data": self._on_part_data,
                "on_part_end": self._on_part_end,
                "on_end": self._on_end,
            },
        )

    # -- parser callbacks ------------------------------------------------------------------------

    def _on_part_begin(self) -> None:
        self._part = _Part()

    def _on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_field += data[start:end]

    def _on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _on_header_end(self) -> None:
        assert self._part is not None
        self._part.headers[bytes(self._header_field).decode("latin-1").strip().lower()] = bytes(self._header_value).strip()
        self._header_field.clear()
        self._header_value.clear()

    def _on_headers_finished(self) -> None:
        part = self._part
        assert part is not None
        disposition, options = parse_options_header(part.headers.get("content-disposition"))
        if disposition != b"form-data" or b"name" not in options:
            raise BadRequest(
                "Malformed multipart body: every part needs 'Content-Disposition: form-data; name=\"...\"'.",
            )
        part.name = options[b"name"].decode("utf-8", errors="replace")
        if part.name != "file":
            if len(self.fields) >= MAX_FIELDS:
                raise BadRequest(f"Too many form fields; send at most {MAX_FIELDS} besides the file.")
            return
        if self.writer is not None or self.file_done:
            raise BadRequest("Send exactly one part named 'file'.", param="file")
        raw_name = options.get(b"filename")
        if not raw_name:
            raise BadRequest(
                "The 'file' part needs a filename: Content-Disposition: form-data; name=\"file\"; filename=\"input.jsonl\".",
                param="file",
            )
        # Browsers send full paths from some OSes; keep only the last component.
        filename = raw_name.decode("utf-8", errors="replace").replace("\\", "/").rsplit("/", 1)[-1].strip()
        if not filename or len(filename) > FILENAME_MAX:
            raise BadRequest(f"The filename must have 1 to {FILENAME_MAX} characters.", param="file")
        reject_nul(filename, "file", "filename of the part")
        self.filename = filename
        purpose = self.fields.get("purpose")
        if purpose is not None:
            # The usual order (the SDK's): purpose first, so the wrong upload is refused before any byte is stored.
            check_purpose(purpose)
            check_filename(filename, purpose)
        limit = self.limits.for_purpose(purpose)
        if self.declared is not None and self.declared > limit + FORM_OVERHEAD:
            raise too_large(limit, purpose)
        self.writer = self.store.open_writer(self.file_id, limit)

    def _on_part_data(self, data: bytes, start: int, end: int) -> None:
        part = self._part
        assert part is not None
        if part.name == "file":
            assert self.writer is not None
            try:
                self.writer.write(data[start:end])
            except FileTooLarge as exc:
                raise too_large(exc.limit, self.fields.get("purpose")) from None
            return
        part.value += data[start:end]
        if len(part.value) > FIELD_MAX_BYTES:
            raise BadRequest(f"The form field {part.name!r} is longer than {FIELD_MAX_BYTES} bytes.", param=part.name)

    def _on_part_end(self) -> None:
        part = self._part
        assert part is not None
        if part.name == "file":
            self.file_done = True
        elif part.name is not None:
            try:
                self.fields[part.name] = part.value.decode("utf-8")
            except UnicodeDecodeError:
                raise BadRequest(f"The form field {part.name!r} is not UTF-8 text.", param=part.name) from None
        self._part = None

    def _on_end(self) -> None:
        self.ended = True

    # -- driving ---------------------------------------------------------------------------------

    def feed(self, chunk: bytes) -> None:
        try:
            self.parser.write(chunk)
        except MultipartParseError as exc:
            raise BadRequest(f"Malformed multipart body ({exc}); send a valid multipart/form-data body.") from None

    def finish(self) -> ReceivedUpload:
        """Check the complete form, then publish the stored file."""
        if not self.ended:
            raise BadRequest(
                "Malformed multipart body: it ended before the closing boundary. Send the complete multipart/form-data body."
            )
        if self.writer is None or not self.file_done or self.filename is None:
            raise BadRequest(
                "Missing the 'file' part: send the file as a multipart part named 'file' with a filename.",
                param="file",
            )
        purpose = self.fields.get("purpose")
        if purpose is None:
            raise BadRequest("Missing required parameter: 'purpose'.", param="purpose", code="missing_required_parameter")
        check_purpose(purpose)
        check_filename(self.filename, purpose)
        limit = self.limits.for_purpose(purpose)
        if self.writer.bytes > limit:
            raise too_large(limit, purpose)
        expires = self._expires_after_seconds()
        size = self.writer.commit()
        return ReceivedUpload(self.file_id, self.filename, purpose, size, expires)

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()

    def _expires_after_seconds(self) -> int | None:
        anchor = self.fields.get("expires_after[anchor]")
        seconds = self.fields.get("expires_after[seconds]")
        if anchor is None and seconds is None:
            return None
        if anchor != "created_at":
            raise BadRequest(
                "expires_after[anchor] must be 'created_at' (and expires_after[seconds] must be given with it).",
                param="expires_after.anchor",
            )
        try:
            value = int(seconds) if seconds is not None else None
        except ValueError:
            value = None
        if value is None or not EXPIRES_AFTER_MIN <= value <= EXPIRES_AFTER_MAX:
            raise BadRequest(
                f"expires_after[seconds] must be a whole number from {EXPIRES_AFTER_MIN} (1 hour) "
                f"to {EXPIRES_AFTER_MAX} (30 days); got {seconds!r}.",
                param="expires_after.seconds",
            )
        return value


PACE_WINDOW = 60.0


async def paced(body: AsyncIterator[bytes], min_bytes: int, window: float = PACE_WINDOW) -> AsyncIterator[bytes]:
    """`body`'s chunks, or RequestTimeout once a `window` passes in which fewer than `min_bytes` arrived (nothing
    at all included): an upload that trickles holds a connection and a file in the making. The read that waits
    is never cancelled at a window's end (a cancelled stream would end as if the body were whole); it goes on into
    the next window, and is cancelled only when the upload is dropped."""
    loop = asyncio.get_running_loop()
    chunks = body.__aiter__()
    started, received = loop.time(), 0
    reading: asyncio.Future | None = None
    try:
        while True:
            if reading is None:
                reading = asyncio.ensure_future(chunks.__anext__())
            done, _ = await asyncio.wait({reading}, timeout=max(0.0, started + window - loop.time()))
            chunk = b""
            if done:
                try:
                    chunk = reading.result()
                except StopAsyncIteration:
                    return
                reading = None
            received += len(chunk)
            now = loop.time()
            if now - started >= window:
                if received < min_bytes:
                    raise RequestTimeout(
                        f"The upload sent {received:,} bytes in the last {window:.0f} s, less than the {min_bytes:,} "
                        "it must send each minute; it was dropped. Send the file again over a faster connection.")
                started, received = now, 0
            if chunk:
                yield chunk
    finally:
        if reading is not None and not reading.done():
            reading.cancel()


async def receive_upload(request: Request, store: FileStore, limits: UploadLimits, file_id: str) -> ReceivedUpload:
    content_type, options = parse_options_header(request.headers.get("content-type"))
    boundary = options.get(b"boundary")
    if content_type != b"multipart/form-data" or not boundary:
        raise BadRequest(
            "Upload files as multipart/form-data (with a boundary) carrying the parts 'purpose' and 'file'.",
        )
    declared = _content_length(request)
    if declared is not None and declared > limits.max_upload_bytes + FORM_OVERHEAD:
        # Refused before reading a byte of the body.
        raise too_large(limits.max_upload_bytes, None)
    try:
        upload = MultipartUpload(store, file_id, limits, boundary, declared)
    except ValueError as exc:  # e.g. a boundary longer than the RFC allows
        raise BadRequest(f"Malformed multipart Content-Type ({exc}).") from None
    body = request.stream()
    try:
        async for chunk in paced(body, limits.min_bytes_per_minute):
            await run_in_threadpool(upload.feed, chunk)
        return await run_in_threadpool(upload.finish)
    except RequestTimeout:
        upload.abort()  # the rest is not read: at its pace that would take as long as the upload itself
        raise
    except ApiError:
        upload.abort()
        await _discard(body, limits.max_upload_bytes + FORM_OVERHEAD)
        raise
    except ClientDisconnect:
        upload.abort()
        # Nobody is left to read the answer; it is for the request log and metrics, not a server error.
        raise BadRequest("The client disconnected before the upload finished; send the whole file again.") from None
    except BaseException:
        upload.abort()
        raise


def record_upload(session: Session, store: FileStore, tenant_id: str, upload: ReceivedUpload, created_at: int) -> File:
    """Insert the file's row; if that fails the stored bytes go too, so nothing is half-uploaded."""
    file = File(
        id=upload.file_id,
        tenant_id=tenant_id,
        filename=upload.filename,
        purpose=upload.purpose,
        bytes=upload.bytes,
        created_at=created_at,
        expires_at=(created_at + upload.expires_after_seconds if upload.expires_after_seconds
                    else default_expiry(upload.purpose, created_at)),
        status="processed",
        storage_key=upload.file_id,
    )
    try:
        session.add(file)
        session.commit()
    except BaseException:
        session.rollback()
        store.delete(upload.file_id)
        raise
    return file


def _content_length(request: Request) -> int | None:
    value = request.headers.get("content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        raise BadRequest("The Content-Length header is not a number.") from None


async def _discard(body: AsyncIterator[bytes], budget: int) -> None:
    try:
        async for chunk in body:
            budget -= len(chunk)
            if budget < 0:
                return
    except (ClientDisconnect, RuntimeError):
        return
