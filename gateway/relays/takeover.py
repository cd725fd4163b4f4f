"""A flow control's leadership as its relays see it: whether it may decide now (and the fencing token on what it
decides), what a leader that steps down lets go of, and how a new leader takes over what relays hold.

Right after `Hello` a relay reports everything it holds (`Holding`). Each running request is adopted as it stands:
counted on its replica, its band and the pool, and reserved in the KV ledger with the tokens relayed so far,
without a new dispatch. A leader whose term follows another's (its fencing token is above 1) holds new submissions
back until every relay on the roster the last leader left in Redis (gateway/relays/leadership.py) has reported
what it holds, or for `window` seconds after taking the lease at most (the time a relay may take to notice the old
leader is gone and to find this one: the bound for a relay that died with the old leader, and the whole hold-back
without a roster), so that what relays report is counted before anything new is dispatched; then it submits them
in the order they came (each still bounded by its deadline). Relays that were not on the roster are counted when
they come.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily

from gateway.flow.request import Ask
from gateway.log import log_event
from gateway.metrics import PREFIX
from gateway.relays import messages as m
from gateway.relays.leadership import Leadership

if TYPE_CHECKING:
    from gateway.relays.flow_process import FlowServer, RelayLink

logger = logging.getLogger("gateway.flow")


def relay_name(hello: m.Hello) -> str:
    """A relay as it names itself in `Hello` (its host and pid): how a leader's roster lists it."""
    return f"{hello.host}/{hello.pid}"


class Takeover:
    def __init__(self, server: "FlowServer", leadership: Leadership | None, window: float):
        self.server = server
        self.leadership = leadership
        self.window = window
        # New submissions wait until then (monotonic), by (link id, relay's id), in the order they came.
        self.until = 0.0
        self.waiting: dict[tuple[int, int], tuple["RelayLink", Ask]] = {}
        self.adopted = 0
        # The takeover under way or the last one done (/admin/state, /metrics): when it began (this process took
        # the lease, wall clock) and ended (new requests dispatched again), what relays re-registered meanwhile.
        self.last: dict | None = None
        self._began = 0.0
        self._adopted_before = 0
        self._relays: set[int] = set()
        # Relays on the last leader's roster that have not re-registered yet (None: no roster, the window decides).
        self.awaited: set[str] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._writing: asyncio.Task | None = None  # the roster written because a relay joined
        self._rewrite = False
        if leadership is not None:
            leadership.on_change.append(self._changed)
            leadership.roster = self.roster
            server.gateway.metrics.registry.register(_LeadershipCollector(self))

    def decides(self) -> bool:
        """Whether this process may decide now: always without a lease, else only while it holds it."""
        return self.leadership is None or self.leadership.leads()

    @property
    def token(self) -> int:
        """The fencing token every decision carries (0 without a lease)."""
        return self.leadership.token if self.leadership is not None else 0

    def holds_back(self) -> bool:
        return bool(self.waiting) or time.monotonic() < self.until

    def roster(self) -> list[str]:
        """The relays this leader serves, for its successor: those run alone (a relay of `--workers N` stops with
        its flow control), and those of the last leader's roster still awaited (they may come yet)."""
        names = {relay_name(link.hello) for link in self.server.links.values() if link.index is None}
        return sorted(names | (self.awaited or set()))

    def _changed(self, leading: bool) -> None:
        if not leading:
            # A leader that stepped down holds nothing: its relays find the new leader and re-register there.
            for link in list(self.server.links.values()):
                link.channel.close()
            return
        if self.token > 1:  # another led before: what its relays hold comes first
            assert self.leadership is not None
            roster = self.leadership.roster_seen
            self.awaited = set(roster["relays"]) if roster is not None else None
            self.until = time.monotonic() + self.window
            self._schedule(self.window)
            self.last = {"token": self.token, "began_at": time.time(), "ended_at": None, "seconds": None,
                         "adopted": 0, "relays": 0, "submitted": 0,
                         "awaited": len(self.awaited) if self.awaited is not None else None, "ended_by": None}
            self._began, self._adopted_before, self._relays = time.monotonic(), self.adopted, set()
            log_event(logger, "takeover_started", token=self.token, holding_new_requests_seconds=self.window,
                      roster=sorted(self.awaited) if self.awaited is not None else None,
                      roster_token=roster["token"] if roster is not None else None)
            self._all_back()  # an empty roster: the last leader served no relay

    def joined(self, link: "RelayLink") -> None:
        """A relay joined: on the roster at once (not at the next renewal), so a successor counts on it even if this
        leader dies within a third of a lease."""
        if self.leadership is None or link.index is not None:
            return
        self._rewrite = True  # a write under way may have read the roster before this relay was on it
        if self._writing is None:
            self._writing = asyncio.get_running_loop().create_task(self._write_roster())

    async def _write_roster(self) -> None:
        assert self.leadership is not None
        try:
            while self._rewrite:
                self._rewrite = False
                await self.leadership.write_roster()
        finally:
            self._writing = None

    def _schedule(self, delay: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(delay, self._release)

    def _all_back(self) -> None:
        """Every relay on the roster has re-registered: new requests go on at once, the window's rest unneeded."""
        if self.awaited or self.awaited is None or time.monotonic() >= self.until:
            return
        self.until = 0.0
        if self.last is not None and self.last["ended_at"] is None:
            self.last["ended_by"] = "relays"
        self._release()

    def defer(self, link: "RelayLink", rid: int, ask: Ask) -> None:
        self.waiting[(link.link_id, rid)] = (link, ask)

    def forget(self, link: "RelayLink", rid: int) -> None:
        self.waiting.pop((link.link_id, rid), None)

    def _release(self) -> None:
        left = self.until - time.monotonic()
        if left > 0:  # a later term's window, or a timer that fired a hair early (uvloop counts milliseconds)
            self._schedule(left)
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.last is not None and self.last["ended_at"] is None and self.last.get("ended_by") is None:
            self.last["ended_by"] = "window"
        self.awaited = None
        waiting, self.waiting = self.waiting, {}
        if self.decides():
            self._done(len(waiting))
            log_event(logger, "takeover_done", token=self.token, adopted=self.adopted, submitting=len(waiting),
                      seconds=self.last["seconds"] if self.last else None,
                      ended_by=self.last.get("ended_by") if self.last else None)
        for (_, rid), (link, ask) in waiting.items():
            if not link.channel.closed and self.decides():
                link.submit(rid, ask)

    def _done(self, submitting: int) -> None:
        last = self.last
        if last is None or last["token"] != self.token or last["ended_at"] is not None:
            return
        last.update(ended_at=time.time(), seconds=round(time.monotonic() - self._began, 3),
                    adopted=self.adopted - self._adopted_before, relays=len(self._relays), submitted=submitting)

    def state(self) -> dict | None:
        """/admin/state's `leadership`: the lease as this process holds or sees it, its relays and the requests
        they hold, and the last takeover; None without a lease."""
        if self.leadership is None:
            return None
        links = self.server.links.values()
        last = dict(self.last) if self.last else None  # a copy: the takeover under way goes on filling its own
        return {**self.leadership.state(), "adopted": self.adopted, "relays": len(links),
                "relay_requests": sum(len(link.requests) for link in links), "last_takeover": last}

    # -- what a relay reports -------------------------------------------------------------------------------
    def adopt(self, link: "RelayLink", holding: m.Holding) -> None:
        """Count what the relay holds before this leader dispatches anything new; ask again what waited."""
        now, running, skipped = time.monotonic(), 0, []
        for held in holding.requests:
            if held.url is None:
                link.submit(held.rid, held.ask)
                continue
            replica = next((r for r in self.server.gateway.pool.replicas if r.url == held.url), None)
            if replica is None or held.ask.pool not in link.pools.pools:
                skipped.append(held.url)  # a replica or pool this config no longer has: nothing to count it on
                continue
            controller = link.pools.flow(held.ask.pool)
            req = link.track(held.rid, held.ask, controller)
            controller.adopt(req, replica, now, held.traffic_class, held.output_tokens, held.streaming)
            running += 1
        self.adopted += running
        if self.last is not None and self.last["ended_at"] is None:
            self._relays.add(link.link_id)
        if self.awaited is not None:
            self.awaited.discard(relay_name(link.hello))
        log_event(logger, "relay_reregistered", relay=link.index, peer=link.channel.peer, token=self.token,
                  running=running, waiting=len(holding.requests) - running - len(skipped), skipped=len(skipped),
                  awaited=len(self.awaited) if self.awaited is not None else None)
        self._all_back()


class _LeadershipCollector:
    """/metrics: whether this flow control leads, its fencing token, since when, its relays and what they hold, and
    how long its last takeover took."""

    def __init__(self, takeover: Takeover):
        self.takeover = takeover

    def collect(self):
        takeover, lease = self.takeover, self.takeover.leadership
        assert lease is not None
        leading = GaugeMetricFamily(f"{PREFIX}_flow_control_leader", "1 while this flow control holds the lease.")
        leading.add_metric([], float(takeover.decides()))
        token = GaugeMetricFamily(f"{PREFIX}_flow_control_fencing_token", "The fencing token of this process's "
                                  "term as leader (0 while it stands by).")
        token.add_metric([], float(lease.token))
        since = GaugeMetricFamily(f"{PREFIX}_flow_control_leader_since_seconds", "Unix time this process's term "
                                  "as leader began (0 while it stands by).")
        since.add_metric([], float(lease.since or 0))
        relays = GaugeMetricFamily(f"{PREFIX}_flow_control_relays", "Relays connected to this flow control.")
        relays.add_metric([], float(len(takeover.server.links)))
        adopted = GaugeMetricFamily(f"{PREFIX}_flow_control_adopted_requests", "Running requests relays "
                                    "re-registered with this process when it took over.")
        adopted.add_metric([], float(takeover.adopted))
        held = GaugeMetricFamily(f"{PREFIX}_flow_control_relay_requests", "Requests each connected relay holds "
                                 "(waiting for a decision or running).", labels=["relay"])
        for link in takeover.server.links.values():
            held.add_metric([f"{link.hello.host}/{link.hello.pid}"], float(len(link.requests)))
        last = takeover.last or {}
        took = GaugeMetricFamily(f"{PREFIX}_flow_control_last_takeover_seconds", "The last takeover by this "
                                 "process: lease taken -> new requests dispatched again (0 before its first).")
        took.add_metric([], float(last.get("seconds") or 0))
        return [leading, token, since, relays, adopted, held, took]
