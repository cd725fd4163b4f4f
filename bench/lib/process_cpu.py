"""CPU by component during one benchmark phase: which process is the limit, and how idle the machine was.

A thread samples the CPU seconds of every process the benchmark started (found as descendants of the
benchmark, so worker processes a supervisor starts are seen too), of outside processes named by the caller
(a redis-server, a database's backends), and of the machine, every `interval` seconds. A process's share is
what it used since the phase began (or since it was born), read from its last sample: a process that exits
between two samples loses at most one interval, which the short-lived ones (burst workers) report as
slightly low. Processes are grouped into roles by a caller's function of their command line.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import psutil

Role = Callable[[psutil.Process], "str | None"]


@dataclass
class CpuShares:
    """CPU used during one phase, in cores (CPU seconds ÷ wall seconds): per role, the machine's busy total,
    the part of it no sampled process explains (other users of the machine), and its idle cores."""

    seconds: float
    cores: int
    by_role: dict[str, float] = field(default_factory=dict)
    processes: dict[str, int] = field(default_factory=dict)  # how many processes each role had
    busy: float = 0.0
    idle: float = 0.0

    @property
    def others(self) -> float:
        return max(0.0, self.busy - sum(self.by_role.values()))

    def top(self) -> tuple[str, float]:
        return max(self.by_role.items(), key=lambda kv: kv[1]) if self.by_role else ("-", 0.0)

    def line(self) -> str:
        parts = [f"{role} {cores:.2f}" + (f" ({n} procs)" if (n := self.processes.get(role, 1)) > 1 else "")
                 for role, cores in sorted(self.by_role.items(), key=lambda kv: -kv[1]) if cores >= 0.005]
        return (f"cores used of {self.cores}: " + ", ".join(parts) + f" | other users {self.others:.2f}"
                f" | idle {self.idle:.2f}")

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "cores": self.cores, "by_role": self.by_role, "processes": self.processes,
                "busy": self.busy, "idle": self.idle, "others": self.others}


class CpuSampler:
    """Use as a context manager around a phase; `shares` holds the result after it exits."""

    def __init__(self, role: Role, outside: Callable[[], Iterable[psutil.Process]] = lambda: (),
                 interval: float = 0.1, root: int | None = None):
        self.role = role
        self.outside = outside
        self.interval = interval
        self.root = psutil.Process(root or os.getpid())
        self.start_cpu: dict[int, float] = {}  # CPU seconds at the phase's start, for processes alive then
        self.last_cpu: dict[int, float] = {}
        self.roles: dict[int, str] = {}
        self.shares: CpuShares | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> "CpuSampler":
        self.t0 = time.monotonic()
        self.machine0 = psutil.cpu_times()
        self._sample(initial=True)
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        seconds = time.monotonic() - self.t0
        machine = psutil.cpu_times()
        total = sum(machine) - sum(self.machine0)
        idle = (machine.idle + getattr(machine, "iowait", 0.0)) - (self.machine0.idle + getattr(self.machine0, "iowait", 0.0))
        cores = psutil.cpu_count() or 1
        shares = CpuShares(seconds, cores, busy=cores * (total - idle) / total if total else 0.0,
                           idle=cores * idle / total if total else 0.0)
        for pid, cpu in self.last_cpu.items():
            role = self.roles[pid]
            shares.by_role[role] = shares.by_role.get(role, 0.0) + (cpu - self.start_cpu.get(pid, 0.0)) / seconds
            shares.processes[role] = shares.processes.get(role, 0) + 1
        self.shares = shares

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _processes(self) -> list[psutil.Process]:
        try:
            tree = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        return tree + list(self.outside())

    def _sample(self, initial: bool = False) -> None:
        for proc in self._processes():
            pid = proc.pid
            try:
                if pid not in self.roles:
                    role = self.role(proc)
                    if role is None:
                        continue
                    self.roles[pid] = role
                times = proc.cpu_times()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            cpu = times.user + times.system
            if initial:
                self.start_cpu[pid] = cpu
            self.last_cpu[pid] = cpu
