"""Which process listens on a port, read from /proc: what `holdback up` asks before trusting a readiness answer."""

from __future__ import annotations

import os
import socket
import sys

import pytest

from holdback.cli import listeners


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")


def test_the_listening_process_is_found_even_when_another_of_its_descriptors_closes_meanwhile(monkeypatch):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert os.getpid() in listeners.listener_pids(port)

        # A descriptor of ours that closes between the listing of /proc/PID/fd and its readlink (a connection
        # ending while the readiness check looks): the process is still the listener.
        real = os.readlink
        mine = f"/proc/{os.getpid()}/fd/"
        gone: list[str] = []

        def closing(path):
            path, link = str(path), real(path)
            if path.startswith(mine) and not link.startswith("socket:") and not gone:
                gone.append(path)
                raise FileNotFoundError(path)
            return link

        monkeypatch.setattr(listeners.os, "readlink", closing)
        assert os.getpid() in listeners.listener_pids(port)
        assert gone, "the test closed none of our descriptors: it showed nothing"


def test_a_port_nobody_listens_on_has_no_listener():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening
        assert listeners.listener_pids(port) == set()
