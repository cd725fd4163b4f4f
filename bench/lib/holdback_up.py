"""`holdback up --replicas ENGINE` as an operator starts it in front of one engine or two (a fresh data dir, the
built-in gateway config or overrides of it), and what a bench asks of it through the Batch API: a file of completions
uploaded, a batch created over it and waited for, a warm-up batch that lets the gateway learn the engine's slots."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import yaml

from bench.lib.engines import NICE, RELAY_CPU, favour, pinned
from bench.lib.processes import holdback, stop_processes
from bench.lib.readiness import free_port_block, wait_http

BUILT_IN_CONFIG = Path(__file__).resolve().parents[2] / "gateway" / "default.yaml"
TERMINAL = ("completed", "failed", "expired", "cancelled")


class HoldbackUp:
    """`holdback up --replicas ENGINE` with a fresh data dir, as an operator starts it; the keys it made."""

    def __init__(self, engine: str, tmp: Path, group: int | str, pin: bool, overrides: dict | None = None,
                 keep: Path | None = None, env: dict[str, str] | None = None, ahead: bool = False):
        """`overrides`: merged key by key over the built-in gateway config; `keep`: where its components' logs are
        copied when it stops; `env`: more of its environment (its components' settings, e.g.
        `HOLDBACK_PROCESSOR_PREFIX_PLAN`); `ahead`: run ahead of other work (engines sharing its cores). Use as
        `with HoldbackUp(...) as up:`."""
        self.data = tmp / f"holdback-{group}"
        self.keep = keep
        config: list[str] = []
        if overrides:
            path = tmp / f"gateway-{group}.yaml"
            path.write_text(yaml.safe_dump(merged(yaml.safe_load(BUILT_IN_CONFIG.read_text()), overrides)))
            config = ["--gateway-config", str(path)]
        api = free_port_block(4)
        gateway, m1, m2 = api + 1, api + 2, api + 3
        self.api, self.gateway = f"http://127.0.0.1:{api}", f"http://127.0.0.1:{gateway}"
        env = {**{k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "HOLDBACK_ADMIN_KEY")},
               **(env or {}), "HOLDBACK_DATA_DIR": str(self.data)}
        self.log = tmp / f"holdback-{group}.log"
        self.proc = subprocess.Popen(
            [*pinned(RELAY_CPU, pin), *holdback("up", "--replicas", engine, "--api-port", str(api), "--gateway-port",
                                                str(gateway), "--processor-metrics-port", str(m1),
                                                "--worker-metrics-port", str(m2), *config)],
            env=env, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
        if ahead:
            favour(self.proc.pid, NICE)  # its session: every component it starts
        wait_http(self.api + "/readyz", self.proc, 120, what=f"holdback up's API (log {self.log})")
        keys = json.loads((self.data / "local-keys.json").read_text())
        self.tenant = {"Authorization": f"Bearer {keys['tenant']}"}
        self.admin = {"Authorization": f"Bearer {keys['admin']}"}
        self.realtime = {"Authorization": f"Bearer {keys['realtime']}"}
        wait_http(self.gateway + "/v1/models", self.proc, 120, what=f"holdback up's gateway (log {self.log})",
                  headers=self.realtime)
        wait_http(f"http://127.0.0.1:{m2}/readyz", self.proc, 120, what=f"holdback up's workers (log {self.log})")

    def __enter__(self) -> "HoldbackUp":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop it, its components' logs copied to `keep` first when given."""
        keep = self.keep
        stop_processes([self.proc], 60)
        if keep is not None and (self.data / "logs").is_dir():
            shutil.copytree(self.data / "logs", keep, dirs_exist_ok=True)
            shutil.copy(self.log, keep / "up.log")
        shutil.rmtree(self.data, ignore_errors=True)


def merged(base: dict, over: dict) -> dict:
    """`over` merged into a copy of `base`, mapping by mapping."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


async def upload(api: httpx.AsyncClient, lines: list[dict]) -> str:
    jsonl = "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions", "body": body})
                    + "\n" for i, body in enumerate(lines))
    file = (await api.post("/v1/files", data={"purpose": "batch"},
                           files={"file": ("makespan.jsonl", jsonl.encode())})).raise_for_status().json()
    return file["id"]


async def create_batch(api: httpx.AsyncClient, file_id: str, window: str = "24h") -> dict:
    """`POST /v1/batches` over an uploaded file of completions."""
    return (await api.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                                "completion_window": window})).raise_for_status().json()


async def finished(api: httpx.AsyncClient, batch: dict, start: float, args: argparse.Namespace, log: Path) -> dict:
    while batch["status"] not in TERMINAL:
        if time.monotonic() - start > args.timeout:
            raise SystemExit(f"the batch did not finish within {args.timeout} s (log {log})")
        await asyncio.sleep(0.1)
        batch = (await api.get(f"/v1/batches/{batch['id']}")).raise_for_status().json()
    return batch


async def warm_up(up: HoldbackUp, lines: list[dict], args: argparse.Namespace) -> int | None:
    """A first batch with no realtime beside it, as a stack already in service has run: the gateway learns the
    engine's slots in its first seconds with more requests than slots. Returns the slots it knows then."""
    async with httpx.AsyncClient(base_url=up.api, headers=up.tenant, timeout=60) as api:
        file_id = await upload(api, [{**body, "max_tokens": 128} for body in lines[:8 * args.slots]])
        batch = await create_batch(api, file_id)
        await finished(api, batch, time.monotonic(), args, up.log)
    state = httpx.get(up.gateway + "/admin/state", headers=up.admin, timeout=30).json()
    replicas = state.get("replicas") or [r for pool in state.get("pools", {}).values() for r in pool["replicas"]]
    return replicas[0]["max_num_seqs"] if replicas else None
