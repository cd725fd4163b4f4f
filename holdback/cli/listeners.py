"""Which processes listen on a TCP port, read from /proc on Linux, so `holdback up` can tell its own
child answering a readiness check from a leftover of an earlier run holding the same port.
Elsewhere (no /proc) the answers are None and callers fall back to trusting the port check.
Also free ports to start servers on, for the benchmarks and the tests that start holdback processes.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

PROC = Path("/proc")
LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's state column


def port_free(host: str, port: int) -> bool:
    """Whether we could listen on host:port now (the way our servers bind: SO_REUSEADDR, no SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def listener_pids(port: int) -> set[int] | None:
    """Pids with a socket listening on `port` (any address), or None where /proc cannot tell."""
    inodes = _listening_inodes(port)
    if inodes is None:
        return None
    if not inodes:
        return set()
    pids = set()
    for proc in PROC.iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fds = list((proc / "fd").iterdir())
        except OSError:
            continue  # exited meanwhile, or not ours to read
        for fd in fds:
            try:
                link = os.readlink(fd)
            except OSError:
                continue  # closed since the listing: the process's other descriptors still count
            if link.startswith("socket:[") and link[8:-1] in inodes:
                pids.add(int(proc.name))
                break
    return pids


def descendants(pid: int) -> set[int]:
    """pid and every process below it."""
    children: dict[int, list[int]] = {}
    for proc in PROC.glob("[0-9]*"):
        try:
            # The command name (field 2) may hold spaces and parentheses: the ppid follows the last ')'.
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(proc.name))
    found, todo = {pid}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _listening_inodes(port: int) -> set[str] | None:
    tables = [PROC / "net" / "tcp", PROC / "net" / "tcp6"]
    if not any(t.exists() for t in tables):
        return None
    inodes = set()
    for table in tables:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == LISTEN and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    return inodes

# Ports for our servers come from below the kernel's ephemeral range (32768-60999 on Linux), so the outgoing
# connections of everything else on a busy machine cannot take a port between our check and the child's bind.
_PORT_LOW, _PORT_HIGH = 20000, 32000
_ports = random.SystemRandom()


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(n: int) -> int:
    """First of n consecutive free ports (the simulator takes --port P for replica 0, P+1 for 1, ...)."""
    for _ in range(500):
        base = _ports.randrange(_PORT_LOW, _PORT_HIGH - n)
        if all(_bindable(p) for p in range(base, base + n)):
            return base
    raise RuntimeError(f"no block of {n} free ports in {_PORT_LOW}-{_PORT_HIGH}")


def free_port() -> int:
    return free_port_block(1)
