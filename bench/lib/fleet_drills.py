"""The fleet drills of issue 46, each a strike on a running fleet (bench/lib/fleet.py) under load
(bench/lib/fleet_load.py): kill -9 the leader, SIGSTOP it, kill -9 a relay, stop the lease store, restart every
relay and flow control one at a time. A drill returns what its load saw and what the fleet logged, for
tests/gateway/test_fleet_drills.py to check and bench/fleet.py to report.
"""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from bench.lib.fleet import Fleet
from bench.lib.fleet_load import BatchRows, RealtimeClients, RunningSampler, Stream, replica_successes


@dataclass
class Load:
    clients: int = 12  # realtime callers streaming one request after another
    tokens: int = 30  # each realtime stream's tokens
    rows: int = 500  # batch rows
    senders: int = 16  # worker-like senders of the rows
    strike_after: float = 0.25  # strike once this share of the rows has an answer
    deadline: float = 300.0  # seconds for the batch to end after the strike


@dataclass
class FleetDrillRun:
    realtime: RealtimeClients
    batch: BatchRows
    sampler: RunningSampler
    struck_at: float = 0.0  # monotonic
    struck_wall: float = 0.0  # the same instant, Unix time (the fleet's logs use it)
    seen: dict = field(default_factory=dict)  # what the strike measured
    completions: int = 0  # requests the replicas completed during the drill

    def wall_to_mono(self, wall: float) -> float:
        return self.struck_at + (wall - self.struck_wall)

    def running_at_strike(self) -> list[Stream]:
        return [s for s in self.realtime.streams if s.running_at(self.struck_at)]

    def running_at(self, t: float) -> bool:
        return any(s.running_at(t) for s in self.realtime.streams)

    def answered(self) -> int:
        """Requests the callers were answered in full: realtime streams read to [DONE], batch rows' 200s."""
        return sum(s.done for s in self.realtime.streams) + sum(self.batch.answers.values())


Strike = Callable[[Fleet, FleetDrillRun], Awaitable[None]]


async def drill(fleet: Fleet, load: Load, strike: Strike) -> FleetDrillRun:
    """Run realtime clients and a batch through the fleet, `strike` once a share of the batch is answered, and
    wait for the batch to end."""
    run = FleetDrillRun(RealtimeClients(fleet.url, load.clients, load.tokens),
                   BatchRows(fleet.url, load.rows, load.senders), RunningSampler(fleet.replica_urls, limit=fleet.spec.slots))
    before = await replica_successes(fleet.replica_urls)
    stop = asyncio.Event()
    background = [asyncio.create_task(run.realtime.run(stop)), asyncio.create_task(run.sampler.run(stop))]
    rows = asyncio.create_task(run.batch.run(time.monotonic() + 60 + load.deadline))
    try:
        while run.batch.done < load.rows * load.strike_after or not run.running_at(time.monotonic()):
            if rows.done():
                raise RuntimeError(f"the batch ended before the strike: {run.batch.done} of {load.rows} rows")
            await asyncio.sleep(0.02)
        run.struck_at, run.struck_wall = time.monotonic(), time.time()
        await strike(fleet, run)
        await rows
    finally:
        stop.set()
        await asyncio.gather(*background, rows, return_exceptions=True)
    run.completions = await replica_successes(fleet.replica_urls) - before
    return run


async def _until(predicate, timeout: float, what: str, every: float = 0.05):  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while True:
        value = await asyncio.to_thread(predicate)
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(every)


def _event(fleet: Fleet, name: str, event: str, after: float, **fields):  # noqa: ANN003
    """The first `event` logged by `name` at or after Unix time `after` with `fields`, or None."""
    for e in fleet.events(name, event):
        if e.get("ts", 0) >= after and all(e.get(k) == v for k, v in fields.items()):
            return e
    return None


async def _new_leader(fleet: Fleet, run: FleetDrillRun, old_token: int, timeout: float = 120) -> None:
    """Wait for a leader with a token above `old_token`; note when it took the lease and ended its takeover."""
    name, token = await _until(lambda: (lead := fleet.leader()) and lead[1] > old_token and lead, timeout,
                               "a new leader")
    taken = await _until(lambda: _event(fleet, name, "leadership_taken", run.struck_wall, token=token), 30,
                         f"{name} to log leadership_taken")
    done = await _until(lambda: _event(fleet, name, "takeover_done", run.struck_wall, token=token), 120,
                        f"{name} to log takeover_done")
    run.seen.update(new_leader=name, new_token=token, led_after=taken["ts"] - run.struck_wall,
                    takeover_done_after=done["ts"] - run.struck_wall)


async def kill_leader(fleet: Fleet, run: FleetDrillRun) -> None:
    name, token = fleet.leader() or ("", 0)
    run.seen.update(old_leader=name, old_token=token)
    fleet.signal(name, signal.SIGKILL)
    await _new_leader(fleet, run, token)


def pause_leader(seconds: float) -> Strike:
    async def strike(fleet: Fleet, run: FleetDrillRun) -> None:
        name, token = fleet.leader() or ("", 0)
        run.seen.update(old_leader=name, old_token=token)
        fleet.signal(name, signal.SIGSTOP)
        try:
            await asyncio.sleep(seconds)
            # What the relays heard of each term before the old leader runs again, read through the new leader once
            # every relay holds a channel with it: a relay still on its way there (it notices the silence after
            # three heartbeats, then may wait out a handshake with the paused one) would be missing from the sum.
            # The pause lasts until then.
            await _new_leader(fleet, run, token)
            await _until(lambda: fleet.relays_on(run.seen["new_token"]) == len(fleet.relay_urls), 120,
                         "every relay to hold a channel with the new leader", 0.2)
            joined = await _until(lambda: all(found := [_event(fleet, relay, "flow_control_connected", run.struck_wall)
                                                        for relay in fleet.relay_urls]) and found, 30,
                                  "every relay to log its channel to the new leader")
            run.seen["relays_joined_after"] = max(e["ts"] for e in joined) - run.struck_wall
            run.seen["decisions_at_resume"] = await _until(lambda: _settled_term(fleet, token), 60,
                                                           "the old term's decisions, read twice alike", 0.2)
        finally:
            fleet.signal(name, signal.SIGCONT)
        run.seen["resumed_after"] = time.time() - run.struck_wall
        lost = await _until(lambda: _event(fleet, name, "leadership_lost", run.struck_wall), 60,
                            f"{name} to step down")
        run.seen["old_leader_lost_after"] = lost["ts"] - run.struck_wall
    return strike


def _settled_term(fleet: Fleet, token: int) -> dict[str, float] | None:
    """The relays' decision counters when two reads in a row agree on term `token`'s (a relay whose counters the
    leader has not collected yet would change them), else None."""
    first = fleet.decisions()
    term = f'token="{token}"'
    if not first or {k: v for k, v in first.items() if term in k} != {
            k: v for k, v in fleet.decisions().items() if term in k}:
        return None
    return first


def kill_relay(name: str) -> Strike:
    async def strike(fleet: Fleet, run: FleetDrillRun) -> None:
        run.seen["relay"] = name
        fleet.signal(name, signal.SIGKILL)
    return strike


def stop_lease_store(seconds: float) -> Strike:
    async def strike(fleet: Fleet, run: FleetDrillRun) -> None:
        name, token = fleet.leader() or ("", 0)
        run.seen.update(old_leader=name, old_token=token)
        await asyncio.to_thread(fleet.stop_lease_store)
        try:
            await asyncio.sleep(seconds)
        finally:
            await asyncio.to_thread(fleet.start_lease_store)
        run.seen["restarted_after"] = time.time() - run.struck_wall
        lost = _event(fleet, name, "leadership_lost", run.struck_wall)
        run.seen["old_leader_lost_after"] = lost["ts"] - run.struck_wall if lost else None
        await _new_leader(fleet, run, token)
    return strike


def rolling_restart(names: list[str], timeout: float = 120) -> Strike:
    """Restart `names` one at a time as a Deployment rollout does: SIGTERM, wait for the exit, start it again,
    wait until it is ready (a relay: up at HAProxy; a flow control: standing by or leading, and after a leader's
    hand-over the new leader's takeover done) before the next. seen["steps"]: each one's timings and exit code;
    seen["rolled_after"]: the last one ready, after the strike."""
    async def strike(fleet: Fleet, run: FleetDrillRun) -> None:
        steps = run.seen["steps"] = []
        for name in names:
            began, lead = time.time(), fleet.leader()
            fleet.signal(name, signal.SIGTERM)
            code = await asyncio.to_thread(fleet.procs[name].wait, timeout)
            step = {"name": name, "exit": code, "was_leader": bool(lead and lead[0] == name),
                    "stopped_after": time.time() - began}
            fleet.restart(name)
            if name in fleet.relay_urls:
                await _until(lambda: fleet.up_relays() == len(fleet.relay_urls), timeout, f"{name} up at HAProxy")
            else:
                await _until(lambda: _event(fleet, name, "lease_watched", began)
                             or _event(fleet, name, "leadership_taken", began), timeout, f"{name} to stand by")
            if step["was_leader"]:
                token = lead[1]
                heir, new = await _until(lambda: (now := fleet.leader()) and now[1] > token and now, timeout,
                                         "the heir to lead")
                done = await _until(lambda: _event(fleet, heir, "takeover_done", began, token=new), timeout,
                                    f"{heir} to end its takeover")
                step.update(heir=heir, takeover_done_after=done["ts"] - began)
            step["ready_after"] = time.time() - began
            steps.append(step)
        run.seen["rolled_after"] = time.time() - run.struck_wall
    return strike


def terms(fleet: Fleet, names: list[str], since: float) -> list[tuple[float, float, str, int]]:
    """Every term led since `since` (Unix time): (taken, lost or +inf, process, token), from the logs."""
    out = []
    for name in names:
        lost = [e for e in fleet.events(name, "leadership_lost") if e["ts"] >= since]
        for taken in (e for e in fleet.events(name, "leadership_taken") if e["ts"] >= since):
            ended = next((e["ts"] for e in lost if e["token"] == taken["token"] and e["ts"] >= taken["ts"]),
                         float("inf"))
            out.append((taken["ts"], ended, name, taken["token"]))
    return sorted(out)
