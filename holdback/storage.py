"""File storage behind a small interface, so an object store can replace local disk later.

Writes stream in chunks and land atomically (temp file, then rename): a failed or oversize upload
leaves nothing behind and never replaces a stored file.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import BinaryIO, Iterator, Protocol

CHUNK = 1024 * 1024


class FileTooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"file exceeds the {limit} byte limit")
        self.limit = limit


class FileStore(Protocol):
    def open_writer(self, key: str) -> "StoredFileWriter": ...
    def open_read(self, key: str) -> BinaryIO: ...
    def iter_chunks(self, key: str, chunk_size: int = CHUNK) -> Iterator[bytes]: ...
    def size(self, key: str) -> int: ...
    def delete(self, key: str) -> None: ...
    def exists(self, key: str) -> bool: ...


class StoredFileWriter:
    """Append chunks, enforce a byte limit, then `commit()` to publish or `abort()` to discard."""

    def __init__(self, final: Path, limit: int | None = None):
        self.final = final
        self.tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex}.part")
        self.limit = limit
        self.bytes = 0
        self._fh = open(self.tmp, "wb")

    def write(self, chunk: bytes) -> None:
        self.bytes += len(chunk)
        if self.limit is not None and self.bytes > self.limit:
            self.abort()
            raise FileTooLarge(self.limit)
        self._fh.write(chunk)

    def commit(self) -> int:
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        os.replace(self.tmp, self.final)
        return self.bytes

    def abort(self) -> None:
        if not self._fh.closed:
            self._fh.close()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> "StoredFileWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:  # noqa: ANN001
        if exc_type is not None or not self._fh.closed:
            self.abort()


class LocalFileStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if "/" in key or key.startswith("."):
            raise ValueError(f"invalid storage key {key!r}")
        return self.root / key

    def open_writer(self, key: str, limit: int | None = None) -> StoredFileWriter:
        return StoredFileWriter(self._path(key), limit)

    def open_read(self, key: str) -> BinaryIO:
        return open(self._path(key), "rb")

    def iter_chunks(self, key: str, chunk_size: int = CHUNK) -> Iterator[bytes]:
        with self.open_read(key) as fh:
            while chunk := fh.read(chunk_size):
                yield chunk

    def size(self, key: str) -> int:
        return self._path(key).stat().st_size

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def exists(self, key: str) -> bool:
        return self._path(key).exists()
