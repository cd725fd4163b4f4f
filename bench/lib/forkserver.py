"""A fork server for the `python -m holdback.cli ...` children a test starts: the same command, started in a few
milliseconds of CPU instead of the 0.3-1.3 s its imports cost (FastAPI, SQLAlchemy, pydantic, aiohttp, RQ).

The suite starts about 500 such children a pass, and the embedded pass spent more of its CPU importing them than
running them (docs/ci.md, "The fork server"). A server process per test process imports the platform's modules
once, with no thread running, and forks each child from that state; the child then runs the command as `python -m`
would: its own session, argv, environment, working directory and standard streams, the command's module run as
`__main__`, the exit status of a fresh process (`-N` when a signal ended it). What a fresh process reads at start
but a fork keeps from the server (`PYTHON*` variables other than PYTHONUNBUFFERED, interpreter flags, another source
tree) is not forked: such a command is started with `subprocess.Popen` as before, as is everything when the server
cannot start.

Only tests use it (`enable()` in tests/conftest.py); benchmarks start every child as a fresh process, so that each
one's CPU is what a user's would be. The reaper (tests/reaper.py) still finds every forked child: the kernel shows a
fork the environment its server was started with, and the server carries its test process's token.

The server's own process is bench/lib/zygote.py.
"""

from __future__ import annotations

import io
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.lib.zygote import HEADER

REPO = Path(__file__).resolve().parents[2]
MODULES = ("holdback.cli",)  # what may be forked: `python -m holdback.cli ...`
START_SECONDS = 120.0  # the server's imports, on a machine as loaded as CI's
_ENABLED = False
_server: ForkServer | None = None
_lock = threading.Lock()


def enable() -> None:
    """Start this process's `holdback` children through a fork server (started at the first one)."""
    global _ENABLED
    _ENABLED = True


def popen(args: list[str], *, cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None,
          stdin=None, stdout=None, stderr=None, text: bool = False,
          start_new_session: bool = False):  # noqa: ANN001, ANN201
    """`subprocess.Popen(args, ...)` with these arguments: forked by the fork server when enabled and the command
    allows it (a `ForkedProcess`, which answers as a Popen does), else a `subprocess.Popen`."""
    if _ENABLED and stdin != subprocess.PIPE and forkable(args, env):
        server = _get_server()
        if server is not None:
            return server.spawn(args, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr, text=text,
                                start_new_session=start_new_session)
    return subprocess.Popen(args, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr, text=text,
                            start_new_session=start_new_session)


def run(args: list[str], *, capture_output: bool = False, text: bool = False, timeout: float | None = None,
        cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`subprocess.run(args, ...)` with these arguments, the child started as `popen` starts it."""
    pipe = subprocess.PIPE if capture_output else None
    with popen(args, cwd=cwd, env=env, stdout=pipe, stderr=pipe, text=text) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def forkable(args: list[str], env: dict[str, str] | None) -> bool:
    """A command a fork of this interpreter runs as a fresh one would: `python -m MODULE ...` in this interpreter,
    with no variable that changes how the interpreter starts."""
    if len(args) < 3 or args[0] != sys.executable or args[1] != "-m" or args[2] not in MODULES:
        return False
    env = os.environ if env is None else env
    start_up = {k for k in (*env, *os.environ) if k.startswith("PYTHON") and k != "PYTHONUNBUFFERED"}
    return all(env.get(k) == os.environ.get(k) for k in start_up)


def _get_server() -> ForkServer | None:
    global _server
    with _lock:
        if _server is None or not _server.alive():
            try:
                _server = ForkServer.start()
            except OSError as e:
                print(f"fork server: not started ({e}); children start as fresh processes", file=sys.stderr)
                _server = None
        return _server


class ForkServer:
    """The test process's end: one server, one connection per child."""

    def __init__(self, proc: subprocess.Popen, path: str) -> None:
        self.proc = proc
        self.path = path

    @classmethod
    def start(cls) -> ForkServer:
        path = os.path.join(tempfile.mkdtemp(prefix="hbfork-"), "socket")
        proc = subprocess.Popen([sys.executable, "-m", "bench.lib.zygote", path], cwd=REPO, stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, start_new_session=True)
        server = cls(proc, path)
        deadline = time.monotonic() + START_SECONDS
        while not os.path.exists(path + ".ready"):
            if proc.poll() is not None:
                raise OSError(f"the fork server exited with {proc.returncode} before it listened")
            if time.monotonic() > deadline:
                proc.kill()
                raise OSError(f"the fork server did not listen within {START_SECONDS:.0f} s")
            time.sleep(0.02)
        return server

    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(self, args: list[str], *, cwd, env, stdin, stdout, stderr, text,  # noqa: ANN001
              start_new_session) -> ForkedProcess:
        request = json.dumps({
            "module": args[2], "argv": args[3:], "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
            "env": dict(os.environ if env is None else env), "session": bool(start_new_session),
        }).encode()
        opened: list[int] = []  # fds this end opened for the child: closed here once it holds them
        child_in = _child_fd(stdin, 0, opened, "r")
        pipes: list[int] = []  # the read ends of PIPE streams, this end's
        child_out = _child_fd(stdout, 1, opened, "w", pipes)
        child_err = child_out if stderr == subprocess.STDOUT else _child_fd(stderr, 2, opened, "w", pipes)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            socket.send_fds(conn, [HEADER.pack(len(request)) + request], [child_in, child_out, child_err])
            lines = _Lines(conn)
            line = lines.next(None)
        except (OSError, EOFError) as e:
            conn.close()
            for fd in pipes:
                os.close(fd)
            raise OSError(f"the fork server did not start {args[2:]!r}: {e}") from e
        finally:
            for fd in opened:
                os.close(fd)
        pid = int(line.split()[1])

        def reader(spec) -> io.IOBase | None:  # noqa: ANN001
            if spec != subprocess.PIPE:
                return None
            stream = os.fdopen(pipes.pop(0), "rb")
            return io.TextIOWrapper(stream) if text else stream
        out = reader(stdout)
        return ForkedProcess(args, pid, lines, out, None if stderr == subprocess.STDOUT else reader(stderr))


class _Lines:
    """The lines the server sends on one child's connection, read with a deadline (a socket file object cannot be
    read again once a read timed out)."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.buffer = b""
        self.poller = select.poll()
        self.poller.register(conn, select.POLLIN)

    def next(self, timeout: float | None) -> bytes | None:
        """The next line; None if none came within `timeout` seconds (None: wait as long as it takes); EOFError if
        the server closed the connection first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self.poller.poll(None if left is None else left * 1000):
                return None
            chunk = self.conn.recv(256)
            if not chunk:
                raise EOFError("the fork server closed the connection")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line

    def close(self) -> None:
        self.conn.close()


def _child_fd(spec, default: int, opened: list[int], mode: str, pipes: list[int] | None = None) -> int:  # noqa: ANN001
    if spec is None:
        return default
    if spec == subprocess.PIPE and pipes is not None:
        read_end, write_end = os.pipe()
        pipes.append(read_end)
        opened.append(write_end)
        return write_end
    if spec == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_RDONLY if mode == "r" else os.O_WRONLY)
        opened.append(fd)
        return fd
    if isinstance(spec, int):
        return spec
    return spec.fileno()


class ForkedProcess:
    """A forked child as a `subprocess.Popen` shows it: pid, args, returncode, stdout (a PIPE's read end), poll(),
    wait(timeout), send_signal(), terminate(), kill(). Its exit status comes from the server, its parent."""

    def __init__(self, args: list[str], pid: int, lines: _Lines, stdout, stderr) -> None:  # noqa: ANN001
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self.stdin = None
        self.stdout = stdout
        self.stderr = stderr
        self._lines = lines
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        return self._status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def _status(self, timeout: float | None) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    line = self._lines.next(timeout)
                except (OSError, EOFError) as e:  # the server is gone, and the reaper stopped its children
                    raise OSError(f"the fork server ended before pid {self.pid} did ({e})") from e
                if line is None:
                    return None
                self.returncode = int(line.split()[1])
                self._lines.close()
            return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple:
        """What the PIPE streams carried to their end, then the child's end, as `Popen.communicate` (no input)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        streams = [stream for stream in (self.stdout, self.stderr) if stream is not None]
        chunks: dict[int, list[bytes]] = {stream.fileno(): [] for stream in streams}
        with selectors.DefaultSelector() as selector:
            for stream in streams:
                selector.register(stream.fileno(), selectors.EVENT_READ)
            while selector.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                for key, _ in selector.select(left):
                    data = os.read(key.fd, 1 << 16)
                    if data:
                        chunks[key.fd].append(data)
                    else:
                        selector.unregister(key.fd)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        results = []
        for stream in (self.stdout, self.stderr):
            if stream is None:
                results.append(None)
                continue
            data = b"".join(chunks[stream.fileno()])
            if isinstance(stream, io.TextIOWrapper):  # as subprocess gives text: universal newlines
                data = data.decode(stream.encoding).replace("\r\n", "\n").replace("\r", "\n")
            results.append(data)
            stream.close()
        return tuple(results)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> ForkedProcess:
        return self

    def __exit__(self, *exc) -> None:
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()
