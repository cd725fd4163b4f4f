"""What the stack looks like while the drills run, twice a second: the gateway's KV ledger and bands, every
replica's KV usage and the blocks each tenant holds there, the batch jobs' progress."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx

from bench.drills.timeline import Timeline
from bench.drills.traffic import tenant_of
from bench.lib.stack import Stack


@dataclass(eq=False)
class DrillSampler(threading.Thread):
    """Samples the gateway's KV ledger, every replica's KV usage and the batch jobs' progress."""

    stack: Stack
    timeline: Timeline
    batch_ids: list[str]
    interval: float = 0.5
    samples: list[dict] = field(default_factory=list)
    dead: set[int] = field(default_factory=set)  # replicas killed on purpose: not sampled any more

    def __post_init__(self) -> None:
        threading.Thread.__init__(self, daemon=True)
        self._stop_event = threading.Event()

    def one(self, client: httpx.Client) -> dict:
        sample: dict = {"t": self.timeline.now()}
        try:
            st = client.get(f"{self.stack.gateway_url}/admin/state", headers=self.stack.admin_headers).json()
            sample["kv"] = st.get("kv")
            sample["config_digest"] = (st.get("config") or {}).get("digest")
            sample["bands"] = {str(b.get("priority")): {"queued": b.get("queued"), "in_flight": b.get("in_flight"),
                                                        "dispatched": b.get("dispatched")}
                               for b in st.get("bands", [])}
            sample["evictions"] = int(((st.get("totals") or {}).get("evictions") or {}).get("issued") or 0)
        except (httpx.HTTPError, ValueError) as exc:
            sample["gateway_error"] = repr(exc)[:120]
        replicas = {}
        tenant_blocks: dict[str, int] = {}
        for i, url in enumerate(self.stack.replica_urls):
            if i in self.dead:
                continue
            try:
                s = client.get(f"{url}/admin/state", params={"history_since": time.time()}).json()
                replicas[str(i)] = {"usage": s["kv"]["usage"], "used": s["kv"]["used"],
                                    "num_blocks": s["kv"]["num_blocks"], "running": s["running"],
                                    "waiting": s["waiting"], "kv_oom": s.get("kv_oom"),
                                    "kv_oom_failed_requests": s.get("kv_oom_failed_requests")}
                # Blocks each tenant actually holds on the replica, by the request id the gateway passed on.
                for r in s["running_requests"] + s["waiting_requests"]:
                    tenant = tenant_of(r.get("external_id"))
                    if tenant is not None:
                        tenant_blocks[tenant] = tenant_blocks.get(tenant, 0) + int(r["num_blocks"])
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                replicas[str(i)] = {"error": repr(exc)[:120]}
        sample["replicas"] = replicas
        sample["tenant_blocks"] = tenant_blocks
        headers = {"Authorization": f"Bearer {self.stack.tenant_key}"}
        batches = {}
        for batch_id in self.batch_ids:
            try:
                b = client.get(f"{self.stack.api_url}/v1/batches/{batch_id}", headers=headers).json()
                counts = b.get("request_counts") or {}
                batches[batch_id] = {"completed": counts.get("completed", 0), "failed": counts.get("failed", 0),
                                     "total": counts.get("total", 0), "status": b.get("status")}
            except (httpx.HTTPError, ValueError) as exc:
                batches[batch_id] = {"error": repr(exc)[:120]}
        sample["batches"] = batches
        return sample

    def run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop_event.is_set():
                self.samples.append(self.one(client))
                self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(15)
