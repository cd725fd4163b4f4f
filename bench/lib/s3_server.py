"""A real S3-compatible server for tests, benchmarks and the drill: moto's server mode as a subprocess.

`S3Server.start()` runs `python -m moto.server` on a free loopback port; `bucket()` creates a bucket
with boto3 and `env()` is the HOLDBACK_* settings that point holdback's file store at it.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from dataclasses import dataclass, field

import boto3
from botocore.config import Config

from bench.lib.processes import stop_processes
from bench.lib.readiness import free_port, wait_http

ACCESS_KEY = "holdback-test"
SECRET_KEY = "holdback-test-secret"


@dataclass
class S3Server:
    host: str = "127.0.0.1"
    port: int = 0
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @classmethod
    def start(cls, host: str = "127.0.0.1") -> "S3Server":
        server = cls(host=host, port=free_port())
        server.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", host, "-p", str(server.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            wait_http(f"{server.endpoint}/moto-api/", server.process, timeout=60, what="moto S3 server")
        except BaseException:
            server.stop()
            raise
        return server

    def stop(self) -> None:
        if self.process is not None:
            stop_processes([self.process], 10)

    def client(self):  # noqa: ANN201 - a boto3 S3 client
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                            config=Config(s3={"addressing_style": "path"}))

    def bucket(self) -> str:
        name = f"hb-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def env(self, bucket: str, prefix: str = "files") -> dict[str, str]:
        return {
            "HOLDBACK_FILES_URL": f"s3://{bucket}/{prefix}",
            "HOLDBACK_S3_ENDPOINT_URL": self.endpoint,
            "HOLDBACK_S3_ACCESS_KEY_ID": ACCESS_KEY,
            "HOLDBACK_S3_SECRET_ACCESS_KEY": SECRET_KEY,
        }
