"""The relay processes of `holdback gateway --workers N` and the listening socket they share.

The flow-control process binds the socket once and hands it to N relay processes that inherit it, so every relay
accepts from the same queue: a relay that dies leaves no accepted-but-unserved connections behind (with
SO_REUSEPORT each relay would have its own queue, and a killed relay's queued connections would be reset), and its
replacement serves on the same socket without binding again. A relay that exits is replaced; at a stop every relay
drains (gateway/relays/drain.py) while flow control goes on deciding for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import time

from gateway.log import log_event
from gateway.relays.drain import CUT_SECONDS, Drain
from gateway.relays.handshake import SECRET_ENV

# A relay that dies sooner than this after its start is restarted after a growing pause, not at once.
_QUICK_EXIT = 5.0


def listening_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """The one listening socket every relay of this process accepts from (several relays run alone on one host
    share a port with `reuse_port`: SO_REUSEPORT, each its own socket)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=1024, reuse_port=reuse_port)
    sock.set_inheritable(True)
    return sock


class LocalRelays:
    """Keeps `workers` relay processes running on `sock`, each reaching flow control at `channel_path`."""

    def __init__(self, workers: int, sock: socket.socket | None, channel_path: str, secret: bytes, log_level: str,
                 drain: Drain, logger):  # noqa: ANN001 - the flow-control process's logger
        self.workers = workers
        self.sock = sock
        self.channel_path = channel_path
        self.secret = secret
        self.log_level = log_level
        self.drain = drain
        self.logger = logger
        self.restarts = 0
        self.stopping = False
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._keepers: list[asyncio.Task] = []

    def start(self) -> None:
        self._keepers = [asyncio.create_task(self._keep(i), name=f"relay-{i}") for i in range(self.workers)]

    async def _keep(self, index: int) -> None:
        """Run relay `index`; when it exits (killed, crashed), start another in its place."""
        pause = 0.1
        assert self.sock is not None, "local relays share the listening socket"
        while not self.stopping:
            started = time.monotonic()
            proc = await asyncio.create_subprocess_exec(  # -P: a folder holding a gateway/ directory shadows nothing
                sys.executable, "-P", "-m", "gateway.relays.relay", "--fd", str(self.sock.fileno()), "--channel",
                self.channel_path, "--index", str(index), "--log-level", self.log_level,
                "--drain-grace", str(self.drain.grace), "--drain-seconds", str(self.drain.seconds),
                pass_fds=(self.sock.fileno(),), env={**os.environ, SECRET_ENV: self.secret.decode()})
            self._procs[index] = proc
            log_event(self.logger, "relay_started", relay=index, pid=proc.pid)
            code = await proc.wait()
            if self.stopping:
                return
            self.restarts += 1
            log_event(self.logger, "relay_exited", level=logging.ERROR, relay=index, pid=proc.pid, returncode=code,
                      hint="a new relay takes its place")
            if time.monotonic() - started < _QUICK_EXIT:
                await asyncio.sleep(pause)
                pause = min(pause * 2, 5.0)
            else:
                pause = 0.1

    async def stop(self) -> None:
        """Ask every relay to stop (each drains), wait for them up to the drain's deadline and a margin, then kill
        what is left. This process's copy of the listening socket closes first: the socket listens on while a
        relay holds it, and stops when the last one has stopped accepting."""
        self.stopping = True
        if not self.workers:
            return
        self.drain.begin()
        if self.sock is not None:
            self.sock.close()
        for proc in self._procs.values():
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*self._keepers, return_exceptions=True),
                                   self.drain.grace + self.drain.seconds + CUT_SECONDS + 5)
        for proc in self._procs.values():
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
