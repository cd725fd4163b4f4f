"""What each holdback process costs before it serves: CPU-seconds and wall time to ready, this tree against another.

Every end-to-end test starts five to eight processes (a simulator, a gateway, an API, a processor, workers), so
what one spends on imports and start-up is paid many times over in CI, where the tests get about one core. This
starts each service as the tests do (`python -m holdback.cli ...`, in a session of its own, logging to a file),
polls its probe, and at the first 2xx SIGKILLs it and takes its user+sys CPU from `os.wait4` (plus any process
it started, from /proc). Both trees run their own code (cwd and PYTHONPATH; checked before the rounds) on this
interpreter and its packages, with bytecode caching on as in `make test`. Rounds alternate which tree starts
first; the figure is the median over rounds of baseline ÷ this (above 1: this tree is cheaper), with a bootstrap
interval, so a machine busy in one round moves both sides of its ratio.

    git worktree add --detach /tmp/base <commit before the change>
    .venv/bin/python -m bench.startup --baseline /tmp/base --rounds 7
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.lib.processes import stop_processes
from bench.lib.readiness import free_port, free_port_block
from bench.stats import bootstrap_median

REPO = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")
SERVICES = ("sim", "gateway", "api", "processor", "worker")
# What a service needs around it: a data dir (SQLite, embedded Redis) and a gateway in front of a simulator.
NEEDS_DATA = {"api", "processor", "worker"}
NEEDS_GATEWAY = {"gateway", "processor", "worker"}


@dataclass
class Tree:
    """One source tree and what its services run against: its own data dir (its own migrations, its own
    embedded Redis), and the shared simulator and gateway."""

    label: str
    path: Path
    tmp: Path
    env: dict[str, str] = field(default_factory=dict)

    def run(self, args: list[str]) -> str:
        done = subprocess.run(args, cwd=self.path, env=self.env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{self.label} tree ({self.path}): {' '.join(args[1:])} exited with "
                               f"{done.returncode}: {done.stderr.strip()[-2000:]}")
        return done.stdout


def holdback(*args: str) -> list[str]:
    return [sys.executable, "-m", "holdback.cli", *args]


def child_env(tree: Path, data_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "REDIS_URL", "PYTHONDONTWRITEBYTECODE") and not k.startswith("HOLDBACK_")}
    # As `make test` runs them: bytecode cached (the Makefile unexports PYTHONDONTWRITEBYTECODE).
    return {**env, "PYTHONPATH": str(tree), "HOLDBACK_DATA_DIR": str(data_dir), "HOLDBACK_ADMIN_KEY":
            "hb-admin-startup-bench", "HOLDBACK_REDIS_NAMESPACE": "startup-bench", "PYTHONUNBUFFERED": "1"}


def check_tree(path: Path, label: str) -> Path:
    """A tree this can run: holdback's command in it. Refused with what to do otherwise."""
    path = path.resolve()
    if not (path / "holdback" / "cli" / "__main__.py").is_file():
        raise SystemExit(f"--{label} {path}: no holdback source tree there (holdback/cli/__main__.py is missing); "
                         "make one with `git worktree add --detach /tmp/base <commit>`")
    return path


def verify_imports(tree: Tree) -> str:
    """Where the tree's children import holdback from; refused unless it is the tree itself (an installed
    holdback shadowing it would compare a tree with itself)."""
    origin = tree.run([sys.executable, "-c", "import holdback; print(holdback.__file__)"]).strip()
    if Path(origin).resolve() != tree.path / "holdback" / "__init__.py":
        raise SystemExit(f"the {tree.label} tree's processes import holdback from {origin}, not from {tree.path}: "
                         "remove what puts another holdback ahead of the working directory on sys.path")
    return origin


# -- measuring one start --------------------------------------------------------------------------------------

def answers(port: int, path: str) -> bool:
    """A 2xx for GET path on 127.0.0.1:port (http.client: a poll costs this process little CPU)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
    try:
        conn.request("GET", path)
        return 200 <= conn.getresponse().status < 300
    except OSError:
        return False
    finally:
        conn.close()


def session_cpu(leader: int) -> float:
    """CPU-seconds of the live processes in `leader`'s session other than the leader (what it started)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        pid, session = int(stat.parent.name), int(fields[3])
        if session == leader and pid != leader:
            total += int(fields[11]) + int(fields[12])
    return total / TICK


def measure(tree: Tree, name: str, args: list[str], probes: list[tuple[int, str]], timeout: float) -> dict:
    """Start `holdback ARGS` from `tree`, wait until every (port, path) answers 2xx, kill it; its CPU and wall
    time to ready."""
    log = tree.tmp / f"{name}.log"
    start = time.monotonic()
    with open(log, "ab") as out:
        proc = subprocess.Popen(holdback(*args), cwd=tree.path, env=tree.env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        waiting = list(probes)
        while waiting:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} from the {tree.label} tree exited with {proc.returncode} before it was "
                                   f"ready; its log {log} ends:\n{log.read_text(errors='replace')[-2000:]}")
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"{name} from the {tree.label} tree not ready after {timeout:.0f} s; see {log}")
            if answers(*waiting[0]):
                waiting.pop(0)
            else:
                time.sleep(0.01)
        wall = time.monotonic() - start
        started = session_cpu(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        _, _, usage = os.wait4(proc.pid, 0)
        proc.returncode = -signal.SIGKILL
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return {"cpu_s": round(usage.ru_utime + usage.ru_stime + started, 4), "wall_s": round(wall, 4)}


# -- the services -----------------------------------------------------------------------------------------------

def service(name: str, sim_url: str) -> tuple[list[str], list[tuple[int, str]]]:
    """The command line of `name` as the end-to-end tests start it, and the probes that say it serves."""
    if name == "sim":
        port = free_port_block(2)
        return ["sim", "--port", str(port), "--replicas", "2"], [(port, "/health"), (port + 1, "/health")]
    port = free_port()
    if name == "gateway":
        return ["gateway", "--port", str(port), "--replicas", sim_url], [(port, "/health")]
    if name == "api":
        return ["api", "--port", str(port)], [(port, "/readyz")]
    if name == "processor":  # ready: database, Redis and the gateway answer
        return ["processor", "--poll-interval", "0.1", "--metrics-port", str(port)], [(port, "/readyz")]
    if name == "worker":  # ready: registered in Redis
        return ["worker", "-n", "64", "--metrics-port", str(port)], [(port, "/readyz")]
    raise ValueError(f"unknown service {name!r}; choose from {', '.join(SERVICES)}")


class Surroundings:
    """The data dirs (one per tree: its migrations applied, its embedded Redis running) and one simulator with a
    gateway in front (from this tree) that the measured services talk to; started only when a service needs them."""

    def __init__(self, trees: list[Tree], services: list[str], tmp: Path):
        self.trees, self.services, self.tmp = trees, services, tmp
        self.procs: list[subprocess.Popen] = []
        self.sim_url = self.gateway_url = ""

    def __enter__(self) -> "Surroundings":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if NEEDS_DATA & set(self.services):
            for tree in self.trees:
                tree.run(holdback("db", "upgrade"))
                tree.run([sys.executable, "-c", "import os; from pathlib import Path; from holdback.broker import "
                          "ensure_embedded_redis; ensure_embedded_redis(Path(os.environ['HOLDBACK_DATA_DIR']))"])
        if NEEDS_GATEWAY & set(self.services):
            here = self.trees[0]
            sim_port, gateway_port = free_port(), free_port()
            self.sim_url, self.gateway_url = f"http://127.0.0.1:{sim_port}", f"http://127.0.0.1:{gateway_port}"
            self._serve(here, ["sim", "--port", str(sim_port), "--replicas", "1"], sim_port, "/health")
            self._serve(here, ["gateway", "--port", str(gateway_port), "--replicas", self.sim_url], gateway_port,
                        "/health")
            for tree in self.trees:
                tree.env["HOLDBACK_GATEWAY_URL"] = self.gateway_url

    def _serve(self, tree: Tree, args: list[str], port: int, path: str) -> None:
        with open(self.tmp / f"surroundings-{args[0]}.log", "ab") as out:
            proc = subprocess.Popen(holdback(*args), cwd=tree.path, env=tree.env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        deadline = time.monotonic() + 60
        while not answers(port, path):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the bench's own {args[0]} did not start; see {self.tmp}/surroundings-*.log")
            time.sleep(0.02)

    def stop(self) -> None:
        stop_processes(reversed(self.procs), 10)
        for tree in self.trees:
            if (Path(tree.env["HOLDBACK_DATA_DIR"]) / "redis").exists():
                subprocess.run([sys.executable, "-c", "import os; from pathlib import Path; from holdback.broker "
                                "import stop_embedded_redis; stop_embedded_redis(Path(os.environ['HOLDBACK_DATA_DIR']))"],
                               cwd=tree.path, env=tree.env, check=False)


# -- rounds and the report --------------------------------------------------------------------------------------

def run(baseline: Path, services: list[str], rounds: int, warmup: int, timeout: float,
        progress: Callable[[str], None] = lambda line: None) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="hb-startup-"))
    try:
        trees = []
        for label, path in (("this", REPO), ("baseline", baseline)):
            (tmp / label).mkdir()
            trees.append(Tree(label, path, tmp / label, child_env(path, tmp / label / "data")))
        origins = {tree.label: verify_imports(tree) for tree in trees}
        samples: dict[str, dict[str, list[dict]]] = {s: {t.label: [] for t in trees} for s in services}
        with Surroundings(trees, services, tmp) as around:
            for i in range(warmup):  # bytecode written, files in the page cache: every round starts warm
                for name in services:
                    for tree in trees:
                        measure(tree, name, *service(name, around.sim_url), timeout)
            for r in range(rounds):
                order = trees if r % 2 == 0 else trees[::-1]
                for name in services:
                    for tree in order:
                        samples[name][tree.label].append(measure(tree, name, *service(name, around.sim_url),
                                                                 timeout))
                progress(f"round {r + 1}/{rounds}: " + ", ".join(
                    f"{name} {samples[name]['baseline'][-1]['cpu_s'] / samples[name]['this'][-1]['cpu_s']:.2f}"
                    for name in services) + " (CPU, baseline ÷ this)")
        return report(samples, {"this": str(REPO), "baseline": str(baseline)}, origins, rounds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _figure(this: list[float], base: list[float]) -> dict:
    ratios = [b / t for t, b in zip(this, base)]
    estimate = bootstrap_median(ratios)
    return {"this": this, "baseline": base, "ratios": [round(x, 4) for x in ratios],
            "ratio": estimate.as_dict()}


def report(samples: dict[str, dict[str, list[dict]]], trees: dict[str, str], origins: dict[str, str],
           rounds: int) -> dict:
    """Per service and for all of them together (one platform's start-up), CPU and wall: each tree's figures
    per round, their per-round ratios baseline ÷ this and the median ratio with its interval."""
    out: dict = {"trees": trees, "imports_from": origins, "rounds": rounds, "services": {}}
    for name, by_tree in samples.items():
        out["services"][name] = {
            what: _figure([s[what] for s in by_tree["this"]], [s[what] for s in by_tree["baseline"]])
            for what in ("cpu_s", "wall_s")}
    out["all"] = {what: _figure([round(sum(by_tree["this"][r][what] for by_tree in samples.values()), 4)
                                 for r in range(rounds)],
                                [round(sum(by_tree["baseline"][r][what] for by_tree in samples.values()), 4)
                                 for r in range(rounds)])
                  for what in ("cpu_s", "wall_s")}
    return out


def _median(values: list[float]) -> float:
    return bootstrap_median(values).value


def render(result: dict) -> str:
    def row(name: str, figures: dict) -> str:
        cells = []
        for what in ("cpu_s", "wall_s"):
            f = figures[what]
            r = f["ratio"]
            interval = "" if r["lo"] is None else f" [{r['lo']:.2f}, {r['hi']:.2f}]"
            cells.append(f"{_median(f['this']):.3f} | {_median(f['baseline']):.3f} | {r['value']:.2f}{interval}")
        return f"| {name} | " + " | ".join(cells) + " |"

    lines = [f"{result['rounds']} round(s); this tree {result['trees']['this']}, baseline {result['trees']['baseline']}",
             "medians; ratio = baseline ÷ this per round, median [95% bootstrap interval]: above 1, this is cheaper",
             "", "| service | CPU s this | CPU s baseline | CPU ratio | wall s this | wall s baseline | wall ratio |",
             "|---|---|---|---|---|---|---|"]
    lines += [row(name, figures) for name, figures in result["services"].items()]
    lines.append(row("all together", result["all"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", type=Path, required=True,
                   help="the tree to compare with, e.g. a `git worktree add --detach /tmp/base <commit>`")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds, each tree once a round (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured starts of each service per tree first (default 1)")
    p.add_argument("--services", default=",".join(SERVICES), help=f"comma-separated, of {', '.join(SERVICES)}")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a service may take to be ready (default 60)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    services = [s.strip() for s in args.services.split(",") if s.strip()]
    unknown = [s for s in services if s not in SERVICES]
    if unknown or not services:
        p.error(f"--services {args.services!r}: choose from {', '.join(SERVICES)}")
    if args.rounds < 1 or args.warmup < 0:
        p.error("--rounds must be at least 1 and --warmup at least 0")
    baseline = check_tree(args.baseline, "baseline")
    if baseline == REPO:
        p.error(f"--baseline {baseline} is this tree; give the tree to compare with")
    result = run(baseline, services, args.rounds, args.warmup, args.timeout,
                 progress=lambda line: print(line, file=sys.stderr, flush=True))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
