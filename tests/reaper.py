"""Every process a test starts dies with the pytest process that started it, however that one ends.

Each pytest process (the controller and each xdist worker) puts a token of its own in its environment, which every
process it starts inherits, and their children after them (a child started with `env={**os.environ, ...}` keeps
it; vLLM's engine processes and `holdback up`'s children too). It also starts this watcher, holding the write end
of a pipe whose read end is the watcher's stdin. When the pytest process is gone — finished, SIGKILLed, crashed
with an INTERNALERROR — the kernel closes the pipe, and the watcher SIGKILLs every process whose environment
carries the token. A process group the fixture kills would miss a child that started its own session (every
`holdback` child does), and a parent-death signal fires when the thread that forked exits, not the process.

Run as `python -m tests.reaper TOKEN [REPORT]`: REPORT, when given, receives a line per process it had to kill.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

VARIABLE = "HBTEST_OWNER"


def tagged(token: str) -> list[int]:
    """The processes whose environment (as they were started) carries `token`, except this one."""
    needle = f"{VARIABLE}={token}\0".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or a kernel thread
            continue
    return found


def describe(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def sweep(token: str, report: Path | None = None) -> None:
    """SIGKILL every process carrying `token` until none is left (a dying parent may still fork)."""
    killed: set[int] = set()
    deadline = time.monotonic() + 30
    while (pids := [p for p in tagged(token) if p not in killed or alive(p)]) and time.monotonic() < deadline:
        for pid in pids:
            if pid not in killed and report is not None:
                with report.open("a") as out:
                    out.write(f"{pid} {describe(pid)}\n")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            killed.add(pid)
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """Still running (a zombie waiting for its parent is not: it holds nothing and needs no signal)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def watch(report_dir: Path | None = None) -> None:
    """Tag this process's future children and start their watcher."""
    token = f"{os.getpid()}-{os.urandom(4).hex()}"
    read, write = os.pipe()  # both ends close-on-exec: no child but the watcher inherits the pipe
    env = {k: v for k, v in os.environ.items() if k != VARIABLE}
    args = [sys.executable, "-m", "tests.reaper", token]
    if report_dir is not None:
        args.append(str(report_dir / f"leftovers-{token}.txt"))
    subprocess.Popen(args, stdin=read, env=env, cwd=Path(__file__).resolve().parent.parent,
                     start_new_session=True, stdout=subprocess.DEVNULL)
    os.close(read)
    os.environ[VARIABLE] = token
    _keep.append(write)  # open as long as this process lives


_keep: list[int] = []


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the terminal's group must not stop the watcher
    token, report = argv[0], (Path(argv[1]) if len(argv) > 1 else None)
    while sys.stdin.buffer.read(65536):
        pass
    grace = time.monotonic() + 2  # what was already stopping (a test's teardown, SIGTERMed children) may finish
    while tagged(token) and time.monotonic() < grace:
        time.sleep(0.1)
    sweep(token, report)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
