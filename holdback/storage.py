"""File storage behind one small interface: local disk (the default) or an S3-compatible object store.

Writes stream in chunks and publish atomically (local: temp file then rename; S3: the object exists
only once its upload completes): a failed or oversize upload leaves nothing behind and never replaces
a stored file. `open_file_store(settings)` picks the backend from `HOLDBACK_FILES_URL`.
"""

from __future__ import annotations

import errno
import os
import uuid
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Iterator, Protocol
from urllib.parse import urlparse

if TYPE_CHECKING:
    from holdback.settings import Settings

CHUNK = 1024 * 1024


class FileTooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"file exceeds the {limit} byte limit")
        self.limit = limit


class StorageFull(Exception):
    """The store has no room (a full disk, a quota, an object store out of space): nothing was published.
    Retrying at once would fail the same way; the operator frees space or raises the quota."""

    def __init__(self, where: str, detail: str):
        super().__init__(f"the file store ({where}) is full or over its quota: {detail}")
        self.where = where
        self.detail = detail


# A local write that fails with these means no room, not a fault: the disk is full or the user over quota.
_NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT})


class StoredFileWriter(ABC):
    """Append chunks, enforce a byte limit, then `commit()` to publish or `abort()` to discard."""

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self.bytes = 0
        self.closed = False

    def write(self, chunk: bytes) -> None:
        self.bytes += len(chunk)
        if self.limit is not None and self.bytes > self.limit:
            self.abort()
            raise FileTooLarge(self.limit)
        self._guarded(self._write, chunk)

    def commit(self) -> int:
        """Publish the file; returns its size in bytes."""
        self._guarded(self._publish)
        self.closed = True
        return self.bytes

    def _guarded(self, step, *args: object) -> None:  # noqa: ANN001
        """Run a write step; no room becomes `StorageFull`, with the partial file discarded."""
        try:
            step(*args)
        except Exception as exc:
            full = self._no_room(exc)
            if full is None:
                raise
            self.abort()
            raise StorageFull(*full) from exc

    def _no_room(self, exc: Exception) -> tuple[str, str] | None:
        """(where, detail) when `exc` says the store has no room; None for any other failure."""
        if isinstance(exc, OSError) and exc.errno in _NO_ROOM:
            return "local disk", os.strerror(exc.errno)
        return None

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self._discard()

    @abstractmethod
    def _write(self, chunk: bytes) -> None: ...

    @abstractmethod
    def _publish(self) -> None: ...

    @abstractmethod
    def _discard(self) -> None: ...

    def __enter__(self) -> "StoredFileWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:  # noqa: ANN001
        if exc_type is not None or not self.closed:
            self.abort()


class FileStore(Protocol):
    """Keys are file ids; which tenant may read a key is decided in the database before the store is asked."""

    def open_writer(self, key: str, limit: int | None = None) -> StoredFileWriter: ...
    def open_read(self, key: str) -> BinaryIO: ...  # FileNotFoundError when the key has no bytes
    def iter_chunks(self, key: str, chunk_size: int = CHUNK) -> Iterator[bytes]: ...
    def size(self, key: str) -> int: ...
    def delete(self, key: str) -> None: ...  # a missing key is not an error
    def exists(self, key: str) -> bool: ...


def iter_chunks(store: FileStore, key: str, chunk_size: int = CHUNK) -> Iterator[bytes]:
    with store.open_read(key) as fh:
        while chunk := fh.read(chunk_size):
            yield chunk


class LocalFileWriter(StoredFileWriter):
    def __init__(self, final: Path, limit: int | None = None):
        super().__init__(limit)
        self.final = final
        self.tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex}.part")
        self._fh = open(self.tmp, "wb")

    def _write(self, chunk: bytes) -> None:
        self._fh.write(chunk)

    def _publish(self) -> None:
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        os.replace(self.tmp, self.final)

    def _discard(self) -> None:
        try:
            self._fh.close()
        except OSError:
            pass  # a full disk fails the close's flush too: the temp file goes all the same
        self.tmp.unlink(missing_ok=True)


class LocalFileStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if "/" in key or key.startswith("."):
            raise ValueError(f"invalid storage key {key!r}")
        return self.root / key

    def open_writer(self, key: str, limit: int | None = None) -> StoredFileWriter:
        return LocalFileWriter(self._path(key), limit)

    def open_read(self, key: str) -> BinaryIO:
        return open(self._path(key), "rb")

    def iter_chunks(self, key: str, chunk_size: int = CHUNK) -> Iterator[bytes]:
        return iter_chunks(self, key, chunk_size)

    def size(self, key: str) -> int:
        return self._path(key).stat().st_size

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def exists(self, key: str) -> bool:
        return self._path(key).exists()


def open_file_store(settings: "Settings") -> FileStore:
    """The store `HOLDBACK_FILES_URL` names: unset = `<data dir>/files`, `file:///dir`, or `s3://bucket/prefix`."""
    url = settings.files_url
    if not url:
        return LocalFileStore(settings.files_dir)
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return LocalFileStore(Path(parsed.path))
    from holdback.object_store import S3FileStore  # boto3 is imported only by deployments that use it

    # Settings accepted only file:// and s3:// URLs.
    return S3FileStore.from_settings(settings, bucket=parsed.netloc, prefix=parsed.path.strip("/"))
