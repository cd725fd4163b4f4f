"""The fork server starts a test's `holdback` children as a fresh interpreter would run them (bench/lib/forkserver.py):
their own argv, environment, directory, session and streams, fresh random state, the exit status a fresh process
would have, and the reaper's token; a command a fork would run differently starts as a fresh process."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.lib import forkserver
from tests import reaper

PROBE = "tests.bench.test_forkserver"


@pytest.fixture
def probe_forkable(monkeypatch):  # noqa: ANN001, ANN201
    monkeypatch.setattr(forkserver, "MODULES", (*forkserver.MODULES, PROBE))


def _probe(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> forkserver.ForkedProcess:
    proc = forkserver.popen([sys.executable, "-m", PROBE, *args], env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    assert isinstance(proc, forkserver.ForkedProcess)
    return proc


def test_a_forked_child_runs_as_a_fresh_process_would(probe_forkable, tmp_path):  # noqa: ANN001
    env = {**os.environ, "HBTEST_FORK_PROBE": "only-this-child"}
    (tmp_path / "tests").symlink_to(Path(__file__).resolve().parents[1])  # `python -m` finds modules in its cwd
    first, second = _probe("report", "a b", env=env, cwd=tmp_path), _probe("report", "c", env=env, cwd=tmp_path)
    assert first.wait(60) == 0 and second.wait(60) == 0
    one, two = json.loads(first.stdout.read()), json.loads(second.stdout.read())
    assert one["argv"] == ["report", "a b"] and two["argv"] == ["report", "c"]
    assert one["variable"] == "only-this-child" and "HBTEST_FORK_PROBE" not in os.environ
    assert one["cwd"] == str(tmp_path)
    assert one["pid"] == first.pid and one["sid"] == first.pid  # a session of its own, as start_new_session gives
    assert one["random"] != two["random"]  # each fork draws its own numbers (ports, ids)
    token = f"{reaper.VARIABLE}={os.environ[reaper.VARIABLE]}"  # what the reaper finds in /proc/PID/environ
    assert token in one["proc_environ"].split("\0") and one["token"] == os.environ[reaper.VARIABLE]


def test_a_forked_child_ends_with_the_status_a_fresh_one_would(probe_forkable):  # noqa: ANN001
    assert _probe("exit", "3").wait(60) == 3
    waiting = _probe("wait")
    with pytest.raises(subprocess.TimeoutExpired):
        waiting.wait(0.2)
    assert waiting.poll() is None
    os.killpg(waiting.pid, signal.SIGTERM)
    assert waiting.wait(60) == -signal.SIGTERM
    failing = forkserver.popen([sys.executable, "-m", PROBE, "raise"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    assert failing.wait(60) == 1
    assert failing.stdout.read() == "" and "RuntimeError: the probe failed" in failing.stderr.read()


def test_run_captures_each_stream_apart_and_keeps_its_deadline(probe_forkable):  # noqa: ANN001
    done = forkserver.run([sys.executable, "-m", PROBE, "streams"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (4, "to stdout\n", "to stderr\n")
    with pytest.raises(subprocess.TimeoutExpired):
        forkserver.run([sys.executable, "-m", PROBE, "wait"], capture_output=True, timeout=0.5)


def test_a_command_a_fork_would_run_differently_starts_fresh(probe_forkable):  # noqa: ANN001
    env = {**os.environ, "PYTHONPATH": "/nonexistent"}  # read by an interpreter at its start: a fork keeps its own
    proc = forkserver.popen([sys.executable, "-m", PROBE, "exit", "0"], env=env, stdout=subprocess.DEVNULL)
    assert isinstance(proc, subprocess.Popen)
    assert proc.wait(60) == 0
    assert not forkserver.forkable([sys.executable, "-X", "dev", "-m", "holdback.cli", "sim"], None)
    assert not forkserver.forkable(["/usr/bin/python3", "-m", "holdback.cli", "sim"], None)


def test_a_server_whose_test_process_is_gone_exits_and_removes_its_socket():
    server = forkserver.ForkServer.start()
    assert server.alive() and os.path.exists(server.path)
    server.proc.stdin.close()  # as when the test process ends, however it ends
    assert server.proc.wait(60) == 0
    assert not os.path.exists(os.path.dirname(server.path))


def _main(argv: list[str]) -> int:
    what = argv[0]
    if what == "report":
        token = os.environ.get(reaper.VARIABLE, "")
        print(json.dumps({
            "argv": argv, "variable": os.environ.get("HBTEST_FORK_PROBE"), "cwd": os.getcwd(), "pid": os.getpid(),
            "sid": os.getsid(0), "random": random.random(), "token": token,
            "proc_environ": Path(f"/proc/{os.getpid()}/environ").read_bytes().decode(errors="replace"),
        }))
        return 0
    if what == "exit":
        return int(argv[1])
    if what == "streams":
        print("to stdout")
        print("to stderr", file=sys.stderr)
        return 4
    if what == "wait":
        signal.pause()
        return 0
    raise RuntimeError("the probe failed")


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
