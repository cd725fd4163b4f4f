"""The embedded Redis: processes of one data dir that start at the same moment share one server.

Each holdback process (api, processor, worker) starts the embedded Redis when none answers. Two that looked at the
same time used to start one each: the second server took over the socket path while the first kept the clients
already connected to it, so a processor could enqueue on one server while the worker polled the other.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import redis

from holdback.broker import embedded_socket, stop_embedded_redis
from tests.support import REPO

# A process that connects and then waits: a client that stays on whichever server it reached first.
_CLIENT = """
import sys, time
from pathlib import Path
import redis
from holdback.broker import ensure_embedded_redis
url = ensure_embedded_redis(Path(sys.argv[1]))
conn = redis.Redis.from_url(url)
sys.stdout.write(str(conn.info("server")["process_id"]) + "\\n")
sys.stdout.flush()
sys.stdin.read()  # stay connected until the test has heard from every client
sys.stdout.write(str(conn.info("server")["process_id"]) + "\\n")
"""


def test_processes_starting_at_once_share_one_embedded_redis():
    data_dir = Path(tempfile.mkdtemp(prefix="hbr-"))
    first: list[str] = []
    clients = [subprocess.Popen([sys.executable, "-c", _CLIENT, str(data_dir)], cwd=REPO, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(6)]
    try:
        first[:] = [c.stdout.readline().strip() for c in clients]
        outs = [c.communicate(input="", timeout=60) for c in clients]
        assert all(c.returncode == 0 for c in clients), [err for _, err in outs]
        later = [out.strip() for out, _ in outs]
        by_path = str(redis.Redis.from_url(f"unix://{embedded_socket(data_dir)}").info("server")["process_id"])
        assert set(first) == set(later) == {by_path}, (first, later, by_path)
    finally:
        for c in clients:
            if c.poll() is None:
                c.kill()
        stop_embedded_redis(data_dir)
        for pid in {p for p in first if p.isdigit()}:  # servers the socket path no longer reaches
            subprocess.run(["kill", pid], check=False, capture_output=True)
        shutil.rmtree(data_dir, ignore_errors=True)
