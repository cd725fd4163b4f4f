"""The fork server's own process (bench/lib/forkserver.py is the test process's end): it imports the platform's
modules once, with no thread running, and forks each child it is asked for; the fork becomes `python -m MODULE ARGV`
started with the request's session, streams, directory and environment, and the server, its parent, reports how it
ended.

Run as `python -m bench.lib.zygote SOCKET`: it serves until its standard input ends (its test process is gone).
"""

from __future__ import annotations

import atexit
import importlib
import io
import json
import os
import runpy
import selectors
import shutil
import signal
import socket
import struct
import sys
import threading
import traceback
from pathlib import Path

PRELOAD = ("holdback.cli.main", "holdback.cli.up", "holdback.cli.db", "holdback.cli.keys", "holdback.cli.data",
           "holdback.cli.files", "holdback.cli.submit", "holdback.tracing", "batch_api.cli", "batch_api.app",
           "batch_processor.cli", "batch_processor.processor", "async_processor.cli", "async_processor.worker",
           "gateway.cli", "gateway.app", "model_sim.cli", "model_sim.server")
HEADER = struct.Struct("!I")  # a request's length, before its JSON; its three descriptors ride on the first bytes


def main(path: str) -> int:
    """Serve at `path` (a Unix socket in a directory of its own), and remove that directory when done."""
    try:
        return serve(path)
    finally:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def serve(path: str) -> int:
    for name in PRELOAD:
        importlib.import_module(name)
    if threading.active_count() != 1:  # a fork would copy another thread's locks, held, with no thread to free them
        print(f"fork server: {threading.active_count()} threads after the imports; refusing to fork",
              file=sys.stderr)
        return 1
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wake-up fd is written to; the handler has nothing to do
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "parent")
    selector.register(wake_read, selectors.EVENT_READ, "child")
    children: dict[int, socket.socket | None] = {}
    Path(path + ".ready").touch()
    while True:
        for key, _ in selector.select():
            if key.data == "parent":
                if not os.read(sys.stdin.fileno(), 4096):
                    return 0  # the test process is gone; the reaper stops what it started
            elif key.data == "child":
                os.read(wake_read, 4096)  # a child ended: reaped below, with any that ended meanwhile
            else:
                conn, _ = listener.accept()
                try:
                    request, fds = _receive(conn)
                except (OSError, ValueError) as e:
                    conn.close()
                    print(f"fork server: a bad request ({e})", file=sys.stderr)
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _run(request, fds)  # never returns
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                try:
                    conn.sendall(b"P %d\n" % pid)
                except OSError:
                    children[pid] = None
                    conn.close()
        _reap(children)


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
    if len(fds) != 3 or len(data) < HEADER.size:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"expected a header and 3 descriptors, got {len(data)} bytes and {len(fds)} descriptors")
    (size,) = HEADER.unpack_from(data)
    body = bytearray(data[HEADER.size:])
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ValueError("the request ended early")
        body += chunk
    return json.loads(body), fds


def _reap(children: dict[int, socket.socket | None]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(b"X %d\n" % os.waitstatus_to_exitcode(status))
            except OSError:
                pass
            conn.close()


def _run(request: dict, fds: list[int]) -> None:
    """In the fork: become `python -m MODULE ARGV...` started with the request's session, streams, directory and
    environment, run it, and exit as that process would."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if request["session"]:
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(open(0, "rb", closefd=False), encoding=sys.stdin.encoding)
        sys.stdout = sys.__stdout__ = _text(1, unbuffered, "strict")
        sys.stderr = sys.__stderr__ = _text(2, unbuffered, "backslashreplace", line_buffering=True)
        sys.path[0] = os.getcwd()
        sys.argv = ["-m", *request["argv"]]
        code = _exit_code(request["module"])
    except BaseException:  # noqa: BLE001 - a fork must never return into the server's loop
        traceback.print_exc()
    finally:
        try:
            threading._shutdown()  # as the interpreter does at its exit: wait for the non-daemon threads, then atexit
            atexit._run_exitfuncs()
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _exit_code(module: str) -> int:
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a fresh interpreter ends by SIGINT itself
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        return 1
    return 0


def _text(fd: int, unbuffered: bool, errors: str, line_buffering: bool = False) -> io.TextIOWrapper:
    raw = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)
    return io.TextIOWrapper(raw, encoding=sys.stdout.encoding, errors=errors, write_through=unbuffered,
                            line_buffering=line_buffering or os.isatty(fd))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
