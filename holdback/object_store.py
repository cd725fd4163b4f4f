"""The S3-compatible file store: objects under `s3://bucket/prefix/<file id>`, streamed both ways.

Uploads go out as multipart parts of `part_size` bytes, so memory stays at about one part however
large the file; an object appears only when its upload completes. Downloads stream the response body.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any, BinaryIO, Iterator

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from holdback.storage import CHUNK, StoredFileWriter, iter_chunks

if TYPE_CHECKING:
    from holdback.settings import Settings

MiB = 1024 * 1024
MIN_PART = 5 * MiB  # S3's smallest part except the last
_MISSING = {"404", "NoSuchKey", "NotFound"}


# What S3-compatible servers answer when they have no room: MinIO's 507 `XMinioStorageFull`, the
# `InsufficientStorage` and `QuotaExceeded` of servers with bucket or user quotas (Ceph RGW, SeaweedFS).
_NO_ROOM_CODES = frozenset({"XMinioStorageFull", "InsufficientStorage", "QuotaExceeded", "StorageFull"})


class S3FileWriter(StoredFileWriter):
    def __init__(self, client: Any, bucket: str, key: str, part_size: int, limit: int | None = None):
        super().__init__(limit)
        self.client, self.bucket, self.key, self.part_size = client, bucket, key, part_size
        self.buffer = bytearray()
        self.upload_id: str | None = None
        self.parts: list[dict] = []

    def _write(self, chunk: bytes) -> None:
        self.buffer += chunk
        if len(self.buffer) >= self.part_size:
            self._send_part()

    def _send_part(self) -> None:
        if self.upload_id is None:
            self.upload_id = self.client.create_multipart_upload(Bucket=self.bucket, Key=self.key)["UploadId"]
        number = len(self.parts) + 1
        body = bytes(self.buffer)
        self.buffer.clear()
        answer = self.client.upload_part(Bucket=self.bucket, Key=self.key, UploadId=self.upload_id,
                                         PartNumber=number, Body=body)
        self.parts.append({"ETag": answer["ETag"], "PartNumber": number})

    def _publish(self) -> None:
        if self.upload_id is None:  # smaller than one part: a single PUT
            self.client.put_object(Bucket=self.bucket, Key=self.key, Body=bytes(self.buffer))
            self.buffer.clear()
            return
        if self.buffer:
            self._send_part()
        self.client.complete_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self.upload_id,
                                              MultipartUpload={"Parts": self.parts})

    def _no_room(self, exc: Exception) -> tuple[str, str] | None:
        if isinstance(exc, ClientError):
            error = exc.response.get("Error", {})
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if error.get("Code") in _NO_ROOM_CODES or status == 507:
                return f"s3://{self.bucket}", f"{error.get('Code')}: {error.get('Message') or 'no room'}"
        return super()._no_room(exc)

    def _discard(self) -> None:
        self.buffer.clear()
        if self.upload_id is not None:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self.upload_id)
            except ClientError:
                pass  # the bucket's lifecycle rule for incomplete uploads cleans up what this could not


class _ResponseBody(io.RawIOBase):
    """A GET response body as a raw stream, so io.BufferedReader gives it read(n), readline and iteration."""

    def __init__(self, body: Any):
        self.body = body

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self.body.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self.body.close()
        super().close()


class S3FileStore:
    def __init__(self, client: Any, bucket: str, prefix: str = "", part_size: int = 8 * MiB):
        if part_size < MIN_PART:
            raise ValueError(f"S3 part size must be at least {MIN_PART} bytes (S3's minimum); got {part_size}")
        self.client, self.bucket, self.prefix, self.part_size = client, bucket, prefix.strip("/"), part_size

    @classmethod
    def from_settings(cls, settings: "Settings", *, bucket: str, prefix: str) -> "S3FileStore":
        config = Config(
            region_name=settings.s3_region,
            # Path-style URLs and checksums only when required: what MinIO, Ceph and other S3-compatible servers accept.
            s3={"addressing_style": "path" if settings.s3_endpoint_url else "auto"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            retries={"max_attempts": 5, "mode": "standard"},
        )
        # Unset keys fall through to boto3's own chain (AWS_* variables, a pod's or instance's role).
        client = boto3.session.Session().client(
            "s3", endpoint_url=settings.s3_endpoint_url, config=config,
            aws_access_key_id=settings.s3_access_key_id, aws_secret_access_key=settings.s3_secret_access_key,
        )
        return cls(client, bucket, prefix, settings.s3_part_size_mb * MiB)

    def _key(self, key: str) -> str:
        if "/" in key or key.startswith("."):
            raise ValueError(f"invalid storage key {key!r}")
        return f"{self.prefix}/{key}" if self.prefix else key

    def open_writer(self, key: str, limit: int | None = None) -> StoredFileWriter:
        return S3FileWriter(self.client, self.bucket, self._key(key), self.part_size, limit)

    def open_read(self, key: str) -> BinaryIO:
        try:
            answer = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as exc:
            raise _not_found(exc, key) from None
        return io.BufferedReader(_ResponseBody(answer["Body"]), buffer_size=CHUNK)  # type: ignore[return-value]

    def iter_chunks(self, key: str, chunk_size: int = CHUNK) -> Iterator[bytes]:
        return iter_chunks(self, key, chunk_size)

    def size(self, key: str) -> int:
        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"])
        except ClientError as exc:
            raise _not_found(exc, key) from None

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except FileNotFoundError:
            return False
        return True


def _not_found(exc: ClientError, key: str) -> Exception:
    if str(exc.response.get("Error", {}).get("Code")) in _MISSING:
        return FileNotFoundError(f"no stored object for {key!r}")
    return exc
