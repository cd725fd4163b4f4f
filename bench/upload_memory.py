"""Upload memory benchmark: does `holdback api` stream a large batch file to its store in bounded memory?

Starts `holdback api` as a subprocess on its own temporary data dir (SQLite, embedded Redis) with
the file store --store names (local disk, or an S3-compatible server: moto's server mode as its
own subprocess, so the objects it holds in memory are not counted against the API),
writes a JSONL file of --size-mb MiB on disk, uploads it as multipart with httpx streaming the
file from disk, and samples the server's RSS (psutil) throughout. Reports the peak RSS growth
over the pre-upload baseline, absolute and as a fraction of the file size, and the same for
downloading the file back. Exit status 1 when the upload or download growth exceeds --goal-mb.

Uses only public interfaces: the `holdback` CLI and HTTP.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from bench.lib.processes import stop_processes
from bench.lib.readiness import free_port, wait_http
from bench.lib.s3_server import S3Server

MiB = 1024 * 1024


class RssSampler:
    """Sample one process's resident set size in a background thread."""

    def __init__(self, pid: int, interval: float = 0.005):
        self.process = psutil.Process(pid)
        self.interval = interval
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        return self.process.memory_info().rss

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            self.samples += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> "RssSampler":
        self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())


def write_jsonl(path: Path, size: int) -> tuple[int, str]:
    """A valid batch input file of at most `size` bytes (whole lines); returns (bytes, sha256)."""
    digest = hashlib.sha256()
    written = 0
    i = 0
    pad = "lorem ipsum " * 40
    with open(path, "wb") as fh:
        while True:
            line = (
                json.dumps(
                    {
                        "custom_id": f"req-{i}",
                        "method": "POST",
                        "url": "/v1/chat/completions",
                        "body": {"model": "sim", "messages": [{"role": "user", "content": f"{i} {pad}"}], "max_tokens": 16},
                    }
                )
                + "\n"
            ).encode()
            if written + len(line) > size:
                break
            fh.write(line)
            digest.update(line)
            written += len(line)
            i += 1
    return written, digest.hexdigest()


def settle(sampler: RssSampler, seconds: float = 1.0) -> int:
    """Baseline RSS: the largest of a few samples over a quiet second."""
    end = time.monotonic() + seconds
    value = 0
    while time.monotonic() < end:
        value = max(value, sampler.rss())
        time.sleep(0.05)
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python bench/upload_memory.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--size-mb", type=int, default=200, help="size of the JSONL file in MiB (default 200)")
    parser.add_argument("--goal-mb", type=float, default=64, help="allowed peak RSS growth in MiB (default 64)")
    parser.add_argument("--port", type=int, default=0, help="port for holdback api (default: a free one)")
    parser.add_argument("--store", choices=("local", "s3"), default="local",
                        help="file store: local disk (default) or s3 (a moto S3 server started for the run)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary data dir and the server log")
    args = parser.parse_args(argv)

    # A short path: the embedded Redis listens on a unix socket under the data dir.
    work = Path(tempfile.mkdtemp(prefix="hbbench-"))
    data_dir = work / "data"
    port = args.port or free_port()
    base = f"http://127.0.0.1:{port}"
    admin_key = "hb-bench-" + secrets.token_hex(8)
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update(
        HOLDBACK_DATA_DIR=str(data_dir),
        HOLDBACK_ADMIN_KEY=admin_key,
        HOLDBACK_MAX_BATCH_FILE_BYTES=str(max(args.size_mb * MiB, 200 * MiB)),
        HOLDBACK_MAX_UPLOAD_BYTES=str(max(args.size_mb * MiB, 512 * MiB)),
    )
    log_path = work / "api.log"
    source = work / "input.jsonl"
    print(f"writing a {args.size_mb} MiB JSONL file to {source} ...", flush=True)
    size, sha = write_jsonl(source, args.size_mb * MiB)
    s3 = S3Server.start() if args.store == "s3" else None
    if s3 is not None:
        env.update(s3.env(s3.bucket()))

    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "holdback.cli", "api", "--port", str(port), "--log-level", "warning"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        wait_http(f"{base}/readyz", proc, 60, what="holdback api")
        key = httpx.post(f"{base}/admin/keys", json={"tenant": "bench"},
                         headers={"authorization": f"Bearer {admin_key}"}).raise_for_status().json()["key"]
        auth = {"authorization": f"Bearer {key}"}
        with httpx.Client(base_url=base, headers=auth, timeout=600) as http:
            # Warm-up: load every code path the big upload uses, so the baseline includes it.
            http.post("/v1/files", data={"purpose": "batch"},
                      files={"file": ("warm.jsonl", b'{"custom_id": "w"}\n', "application/jsonl")}).raise_for_status()
            sampler = RssSampler(proc.pid)
            baseline = settle(sampler)
            with sampler:
                started = time.monotonic()
                with open(source, "rb") as fh:
                    # httpx reads the file object in chunks as it sends: the client streams too.
                    r = http.post("/v1/files", data={"purpose": "batch"},
                                  files={"file": ("input.jsonl", fh, "application/jsonl")})
                upload_seconds = time.monotonic() - started
            r.raise_for_status()
            uploaded = r.json()
            upload_peak = sampler.peak
            upload_samples = sampler.samples

            down_baseline = settle(sampler, 0.5)
            down_digest = hashlib.sha256()
            with RssSampler(proc.pid) as down_sampler:
                with http.stream("GET", f"/v1/files/{uploaded['id']}/content", headers={"accept": "application/binary"}) as resp:
                    resp.raise_for_status()
                    for chunk in resp.iter_bytes():
                        down_digest.update(chunk)
            download_peak = down_sampler.peak
    finally:
        stop_processes([proc], 30)
        _stop_embedded_redis(data_dir)
        if s3 is not None:
            s3.stop()

    upload_growth = upload_peak - baseline
    download_growth = download_peak - down_baseline
    ok = uploaded["bytes"] == size and down_digest.hexdigest() == sha
    report = {
        "store": args.store,
        "file_bytes": size,
        "stored_bytes": uploaded["bytes"],
        "round_trip_sha256_matches": down_digest.hexdigest() == sha,
        "upload_seconds": round(upload_seconds, 2),
        "upload_mib_per_s": round(size / MiB / upload_seconds, 1),
        "rss_baseline_mib": round(baseline / MiB, 1),
        "rss_peak_upload_mib": round(upload_peak / MiB, 1),
        "upload_rss_growth_mib": round(upload_growth / MiB, 1),
        "upload_growth_over_file_size": round(upload_growth / size, 4),
        "download_rss_growth_mib": round(download_growth / MiB, 1),
        "download_growth_over_file_size": round(download_growth / size, 4),
        "rss_samples": upload_samples,
        "goal_mib": args.goal_mb,
    }
    print(json.dumps(report, indent=2))
    verdict = ok and max(upload_growth, download_growth) <= args.goal_mb * MiB
    print(
        f"{args.store} store: upload of {size / MiB:.0f} MiB grew the server's RSS by {upload_growth / MiB:.1f} MiB "
        f"({100 * upload_growth / size:.2f}% of the file), download by {download_growth / MiB:.1f} MiB; "
        f"goal <= {args.goal_mb:g} MiB each: {'met' if verdict else 'NOT met'}"
    )
    if args.keep:
        print(f"kept {work} (server log: {log_path})")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if verdict else 1


def _stop_embedded_redis(data_dir: Path, timeout: float = 30) -> None:
    """The API started the embedded Redis daemon under its data dir and left a pidfile there.

    Wait for it to exit before the dir goes: Redis refuses to exit while it cannot write its final save."""
    pidfile = data_dir / "redis" / "redis.pid"
    try:
        redis = psutil.Process(int(pidfile.read_text().strip()))
        redis.terminate()
        redis.wait(timeout)
    except (FileNotFoundError, ValueError, psutil.NoSuchProcess):
        return
    except psutil.TimeoutExpired:
        redis.kill()


if __name__ == "__main__":
    sys.exit(main())
