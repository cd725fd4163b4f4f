"""Hosts for multi-host runs on one machine: each a Linux network namespace on a private bridge, or loopback.

With namespaces (root and `ip` needed) every process gets its own network stack and address and reaches
the others only over the bridge, as separate machines would; the machine's PostgreSQL and Redis, which
listen on loopback only, are reached through TCP forwarders on the bridge address. Without them every
"host" is 127.0.0.1 and `HostNetwork.reason` says why.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import subprocess
import threading
from dataclasses import dataclass, field


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


class PortForward:
    """Accept on (listen_host, a free port) and splice each connection to (target_host, target_port)."""

    def __init__(self, listen_host: str, target_host: str, target_port: int):
        self.target = (target_host, target_port)
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.port = 0

        async def serve() -> None:
            self.server = await asyncio.start_server(self._connection, listen_host, 0)
            self.port = self.server.sockets[0].getsockname()[1]
            started.set()

        self.thread = threading.Thread(target=self.loop.run_forever, name=f"forward-{target_port}", daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(serve(), self.loop).result(10)
        started.wait(10)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    def close(self) -> None:
        async def stop() -> None:
            self.server.close()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


@dataclass
class HostNetwork:
    kind: str  # "netns" or "loopback"
    reason: str = ""
    infra_address: str = "127.0.0.1"  # where the machine's services are reached from any host
    addresses: dict[str, str] = field(default_factory=dict)
    namespaces: dict[str, str] = field(default_factory=dict)
    bridge: str | None = None
    forwards: list[PortForward] = field(default_factory=list)

    @classmethod
    def create(cls, hosts: list[str], *, want_netns: bool = True) -> "HostNetwork":
        if not want_netns:
            return cls.loopback(hosts, "one host requested")
        why_not = netns_unavailable()
        if why_not:
            return cls.loopback(hosts, why_not)
        network = cls(kind="netns")
        try:
            network._build(hosts)
        except (subprocess.CalledProcessError, OSError) as exc:
            network.close()
            detail = exc.stderr.strip() if isinstance(exc, subprocess.CalledProcessError) else str(exc)
            return cls.loopback(hosts, f"creating network namespaces failed: {detail}")
        return network

    @classmethod
    def loopback(cls, hosts: list[str], reason: str) -> "HostNetwork":
        return cls(kind="loopback", reason=reason, addresses=dict.fromkeys(hosts, "127.0.0.1"))

    def _build(self, hosts: list[str]) -> None:
        tag = f"{os.getpid() % 10000:04d}{random.randrange(256):02x}"
        subnet = f"10.{random.randrange(64, 250)}.{random.randrange(1, 250)}"
        self.bridge = f"hbd{tag}"
        self.infra_address = f"{subnet}.1"
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.infra_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, host in enumerate(hosts):
            ns, veth = f"hbd{tag}-{i}", f"hbd{tag}v{i}"
            address = f"{subnet}.{i + 2}"
            _ip("netns", "add", ns)
            self.namespaces[host] = ns
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.addresses[host] = address

    def forward(self, host: str, port: int) -> tuple[str, int]:
        """How the hosts reach a service the machine runs on host:port (loopback-only services included)."""
        if self.kind == "loopback":
            return host, port
        forward = PortForward(self.infra_address, host, port)
        self.forwards.append(forward)
        return self.infra_address, forward.port

    def command(self, host: str, argv: list[str]) -> list[str]:
        ns = self.namespaces.get(host)
        return ["ip", "netns", "exec", ns, *argv] if ns else argv

    def bind_address(self, host: str) -> str:
        return "0.0.0.0" if self.kind == "netns" else "127.0.0.1"

    def close(self) -> None:
        for forward in self.forwards:
            forward.close()
        for ns in self.namespaces.values():
            _ip("netns", "del", ns, check=False)
        if self.bridge:
            _ip("link", "del", self.bridge, check=False)
        self.namespaces.clear()
        self.forwards.clear()

    def describe(self) -> str:
        if self.kind == "netns":
            return f"{len(self.namespaces)} network namespaces on bridge {self.bridge}"
        return f"loopback ({self.reason})"


def netns_unavailable() -> str:
    """Why this machine cannot give each process its own network namespace, or '' when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"hbprobe{os.getpid()}"
    result = _ip("netns", "add", probe, check=False)
    if result.returncode != 0:
        return f"`ip netns add` failed: {result.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return ""
