"""Which processes listen on a TCP port, read from /proc on Linux, so `holdback up` can tell its own
child answering a readiness check from a leftover of an earlier run holding the same port.
Elsewhere (no /proc) the answers are None and callers fall back to trusting the port check.
"""

from __future__ import annotations

import os
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
            for fd in (proc / "fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    pids.add(int(proc.name))
                    break
        except OSError:
            continue  # exited meanwhile, or not ours to read
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
