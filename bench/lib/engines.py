"""The engine a bench sends its load to, started, pinned and stopped here: the real-engine tier's vLLM (on a core of
its own with `taskset` and its OpenMP threads, ahead of other work with nice) or `holdback sim`; and the pinning that
keeps the load (and the relay) off the engine's core."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.lib.processes import Children, holdback
from bench.lib.readiness import free_port, wait_http

ENGINE_CPU, RELAY_CPU = 0, 1
# The engine and the load run ahead of whatever else shares the machine (when allowed: see `favour`).
NICE = -15
SLOTS = 8
# The CPU backend's KV block (tokens) unless --block-size says otherwise: only whole blocks are prefix-cached.
CPU_BLOCK_TOKENS = 128
# The KV-bound replica (issue #47): its pool cut to 40 blocks (5,120 tokens of 128-token blocks, as its
# vllm:cache_config_info says) under a 2,048-token context, so KV runs out before its 8 slots do: eight
# sequences of 1,000 prompt and 600 output tokens need 104 blocks. vLLM alone then preempts (and recomputes).
KV_BOUND_BLOCKS = 40
KV_BOUND_CONTEXT = 2048
CONTEXT = 512  # the slot-bound replica's (1 GiB of KV: about two million tokens)


def kv_bound_args(blocks: int = KV_BOUND_BLOCKS, context: int = KV_BOUND_CONTEXT) -> list[str]:
    """vLLM's flags for a replica whose KV pool, not its slots, runs out first (the CPU build honours the
    override: its 1 GiB allocation is then used for `blocks` blocks only)."""
    return ["--num-gpu-blocks-override", str(blocks), "--max-model-len", str(context)]


def favour(pid: int, nice: int) -> bool:
    """Run `pid`'s session ahead of other work on its core: with the kernel's autogroups a process's nice counts
    only within its session, so the session's own nice is set too. Needs the right to lower nice (root)."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, nice)
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
        return True
    except (OSError, PermissionError):
        return False


def pin_load(p: argparse.ArgumentParser, pin: bool = True) -> bool:
    """Check the machine can keep the engine and the load apart (two CPUs, `taskset`), put this process (the load)
    on RELAY_CPU when `pin`, and favour it; True when it could be favoured."""
    if len(os.sched_getaffinity(0)) < 2 or shutil.which("taskset") is None:
        p.error("needs two CPUs and `taskset` (util-linux): the engine and the load are pinned to one core each")
    if pin:
        os.sched_setaffinity(0, {RELAY_CPU})
    return favour(os.getpid(), NICE)


def pinned(cpu: int, pin: bool) -> list[str]:
    """The prefix that runs a command on `cpu` alone (none when unpinned)."""
    return ["taskset", "-c", str(cpu)] if pin else []


def engine_paths(p: argparse.ArgumentParser) -> tuple[str, str]:
    """The real engine's interpreter and model, from the environment (the parser's error when unset)."""
    python, model = os.environ.get("HOLDBACK_VLLM_PYTHON"), os.environ.get("HOLDBACK_VLLM_MODEL")
    if not (python and model):
        p.error("set HOLDBACK_VLLM_PYTHON and HOLDBACK_VLLM_MODEL: `python -m tests.real_vllm.engine_env ensure` "
                "builds the real engine and prints both")
    return python, model


def start_vllm(children: Children, tmp: Path, python: str, model: str, slots: int, pin: bool = True,
               block_size: int | None = None, cpu: int = ENGINE_CPU, kv_blocks: int | None = None,
               flags: Sequence[str] = (), favoured: bool = True) -> str:
    """vLLM on `cpu` alone (`pin`), or where the kernel and vLLM's own thread binding put it; `block_size` its KV
    blocks' tokens (None: the CPU backend's 128); `kv_blocks` the KV-bound replica's pool (None: 1 GiB); `flags`
    more of vLLM's own (a study's step token budget); `favoured`: ahead of other work on its core (not when the
    stack shares that core and must run ahead of it)."""
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if pin:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)
    cmd = [*pinned(cpu, pin), python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
           "--dtype", "float32", "--max-num-seqs", str(slots), "--scheduling-policy", "priority"]
    cmd += kv_bound_args(kv_blocks) if kv_blocks else ["--max-model-len", str(CONTEXT)]
    cmd += ["--block-size", str(block_size)] if block_size else []
    cmd += list(flags)
    log = tmp / f"vllm-{cpu}.log"
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    children.procs.append(proc)
    if favoured:
        favour(proc.pid, NICE)  # before its engine process starts: that one inherits both
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc, timeout=600, what=f"vLLM (log: {log})")
    return url


def start_sim(children: Children, tmp: Path, flags: list[str], log: str = "sim.log", cpu: int = ENGINE_CPU,
              pin: bool = False, favoured: bool = False) -> str:
    """`holdback sim` with `flags`, on `cpu` alone when `pin`, ahead of other work when `favoured`; its URL once it
    answers /health."""
    port = free_port()
    proc = children.start([*pinned(cpu, pin), *holdback("sim", "--port", str(port), *flags)], tmp / log)
    if favoured:
        favour(proc.pid, NICE)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc, timeout=60, what=f"holdback sim (log {tmp / log})")
    return url


@dataclass(frozen=True)
class StartedEngine:
    url: str  # with several replicas, their URLs joined by commas (as `holdback up --replicas` takes them)
    model: str  # the model it serves
    tmp: Path  # the run's scratch directory
    pin: bool  # pinned to its CPU (the stack and the load on the other)


@contextlib.contextmanager
def one_engine(p: argparse.ArgumentParser, args: argparse.Namespace, prefix: str, kv_blocks: int | None = None,
               vllm_flags: Sequence[str] = (), replicas: int = 1) -> Iterator[StartedEngine]:
    """The run's one engine (`--engine`: vllm, or the simulator with `--sim-arg`s), stopped with its scratch
    directory at the end; pinned, this process moves to the other CPU. `kv_blocks`, `vllm_flags`: vLLM's, as
    `start_vllm` takes them. `replicas` 2: two of it; pinned, each vLLM on a CPU of its own and not favoured (the
    stack, unpinned, is to run ahead of them: bench/lib/holdback_up.py `ahead`; this process is)."""
    pin = args.engine == "vllm" and not args.unpinned
    if pin and replicas == 1:
        os.sched_setaffinity(0, {RELAY_CPU})
    elif pin:
        favour(os.getpid(), NICE)
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    children = Children()
    try:
        urls = []
        python, model_path = engine_paths(p) if args.engine == "vllm" else ("", "")
        for i, cpu in enumerate((ENGINE_CPU, RELAY_CPU)[:replicas]):
            if args.engine == "vllm":
                urls.append(start_vllm(children, tmp, python, model_path, args.slots, pin, cpu=cpu,
                                       kv_blocks=kv_blocks, flags=vllm_flags, favoured=replicas == 1))
            else:
                # Prefix caching on, as vLLM (V1) has it by default: a resumed request finds its kept prefix cached.
                urls.append(start_sim(children, tmp, ["--replicas", "1", "--scheduling-policy", "priority",
                                                      "--enable-prefix-caching", "--max-num-seqs", str(args.slots),
                                                      *args.sim_arg], log=f"sim-{i}.log"))
        model = httpx.get(urls[0] + "/v1/models", timeout=30).json()["data"][0]["id"]
        yield StartedEngine(",".join(urls), model, tmp, pin and replicas == 1)
    finally:
        children.close()
        shutil.rmtree(tmp, ignore_errors=True)


def wait_idle(engine: str, timeout: float = 300.0) -> None:
    """Until the engine (each of several, comma-separated) runs and holds nothing (an arm's aborted streams may still
    be leaving it)."""
    deadline = time.monotonic() + timeout
    for url in engine.split(","):
        while True:
            text = httpx.get(url + "/metrics", timeout=10).text
            busy = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")))
            if busy == 0:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"the engine {url} still had requests after {timeout} s")
            time.sleep(0.5)
