"""Which flow-control process leads, fenced by a token: a lease in Redis (`holdback gateway --lease-redis URL`).

A contender takes the lease with `SET <key> <value> NX PX <ttl>` and, in the same script, `INCR`s the gateway's
token key: every acquisition gets a fencing token higher than any before it, and every decision the leader sends
carries it (relays refuse an older one). The leader renews by a script that extends the lease only while it holds
the value it set. It leads only while its last successful renewal, timed by the monotonic clock from when that
renewal was sent, is younger than the ttl less a margin: a leader that cannot renew, or that was paused past that
(SIGSTOP, a GC pause, a partition) and then resumed, steps down before it decides anything, never after Redis may
have handed the lease to another. A renewal that fails (Redis stopped, slow or cut off) is retried while the lease
is still valid by that measure: the leader keeps leading through a store's pause shorter than its lease.

Each renewal also writes the leader's relay roster (`<lease key>:relays`: its term's token and the relays it serves,
as each names itself in `Hello`) in the same script, so only while the lease is still its own. The roster outlives
the lease (`ROSTER_LEASES` of them): the successor reads it as it takes the lease and ends its takeover hold-back
as soon as every relay on it has re-registered (gateway/relays/takeover.py).

A leader asked to stop hands the lease over: it stops deciding, deletes the lease only while it still holds its own
value and, in the same script, publishes a notice on `<lease key>:released`; a standby subscribed there tries the
lease at once instead of at its next attempt, which stays the bound when a notice is lost. A standby turned away
reads how long the lease has left (its `PTTL`, in the same script) and tries again as it lapses, or after a third of
a lease if that comes first: a leader that dies is followed within its lease's remainder, never a third of a lease
later.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import socket
import time
from typing import TYPE_CHECKING, Callable

from gateway.log import log_event

if TYPE_CHECKING:  # redis is imported by whoever makes the client: a gateway without a lease never loads it
    from redis import asyncio as aioredis

logger = logging.getLogger("gateway.leadership")

PREFIX = "holdback:gateway:"
# The margin of a lease a leader does not count on: the time a renewal may take to reach Redis, and a clock's
# drift between two renewals.
MARGIN_SHARE = 0.2
# A failed renewal is tried again after this share of a lease (never past the lease's validity).
RETRY_SHARE = 0.1
# The roster lasts this many leases from the renewal that wrote it: long enough for a successor to read it after
# the lease lapsed (a standby tries the lease at the latest every third of one).
ROSTER_LEASES = 3
# A standby tries the lease this long after it should have lapsed: Redis expires a key on its own clock, and a
# try a moment early would wait again.
LAPSE_SLACK = 0.005

# KEYS: the lease, the fencing-token key, the roster. ARGV: the holder, the ttl in ms, the newest token the
# contender has seen. A taken lease answers {0, its value, the ms it has left}; a lease taken here {token, value,
# the roster the last leader wrote or ''}. The token never falls below one seen: a Redis restarted without its data
# (no persistence, a failover to a replica behind) would count from 1 again, and relays refuse an older token.
_ACQUIRE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return {0, redis.call('GET', KEYS[1]), redis.call('PTTL', KEYS[1])} end
if (tonumber(redis.call('GET', KEYS[2])) or 0) < tonumber(ARGV[3]) then redis.call('SET', KEYS[2], ARGV[3]) end
local token = redis.call('INCR', KEYS[2])
local value = ARGV[1] .. '#' .. token
redis.call('SET', KEYS[1], value, 'NX', 'PX', ARGV[2])
return {token, value, redis.call('GET', KEYS[3]) or ''}
"""
# KEYS: the lease, the roster. ARGV: the value this holder set, the ttl in ms, the roster ('' leaves it), its ttl in
# ms. 1 when extended (and the roster written), 0 when the lease is not ours (nothing written).
_RENEW = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if ARGV[3] ~= '' then redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[4]) end
return 1
"""
# KEYS: the lease. ARGV: the value this holder set, the notice, the channel standbys listen on. 1 when given back.
_RESIGN = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[3], ARGV[2])
return 1
"""


class Leadership:
    """This process's claim on the lease of gateway `name`: `leads()` before every decision, `token` on it."""

    def __init__(self, redis: aioredis.Redis, name: str, ttl: float = 6.0, holder: str | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.redis = redis
        self.key = f"{PREFIX}{name}:leader"
        self.token_key = f"{PREFIX}{name}:fencing-token"
        self.released = f"{self.key}:released"
        self.roster_key = f"{self.key}:relays"
        self.ttl = ttl
        self.margin = ttl * MARGIN_SHARE
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.clock = clock
        # This term's fencing token; 0 while not leading.
        self.token = 0
        # When the last acquisition or renewal that succeeded was sent (monotonic).
        self.renewed_at = -float("inf")
        # When this term began (wall clock, for /admin/state), and the lease's value as last read.
        self.since: float | None = None
        self.leader: str | None = None
        # The newest fencing token this process has seen (its own, the lease's holders'): its next is above it.
        self.newest_token = 0
        # Told True when this process comes to lead, False when it steps down (soon after, never inside a decision).
        self.on_change: list[Callable[[bool], None]] = []
        self._value = ""
        # True from a clean stop's first step until the lease is given back.
        self.handing_over = False
        # The notice of the hand-over that let this process take the lease (None: the lease lapsed, or first term).
        self.handover: dict | None = None
        self._notice: dict | None = None
        self._watch = None  # the standby's subscription to `released`
        # When the lease this standby was turned away by lapses (monotonic, from its PTTL); None: not known.
        self.lapses_at: float | None = None
        # The relays this process serves while it leads (written at each renewal); None writes no roster.
        self.roster: Callable[[], list[str]] | None = None
        # The roster the last leader wrote, read when this process took the lease: {"token", "relays"}; None when
        # there was none (a first term, or a lease that lapsed longer ago than the roster lasts).
        self.roster_seen: dict | None = None
        # Why the last renewal failed while the lease was still valid (None once one succeeds).
        self._failure: str | None = None
        self._acquire = redis.register_script(_ACQUIRE)
        self._renew = redis.register_script(_RENEW)
        self._resign = redis.register_script(_RESIGN)

    def leads(self) -> bool:
        """Whether this process may decide now: it holds a lease renewed less than the ttl less the margin ago."""
        if not self.token:
            return False
        age = self.clock() - self.renewed_at
        if age < self.ttl - self.margin:
            return True
        failure = f"; its renewals failed: {self._failure}" if self._failure else ""
        self.step_down(f"its lease was last renewed {age:.1f}s ago (a lease lasts {self.ttl:g}s, counted on for "
                       f"{self.ttl - self.margin:g}s): paused, starved or cut off from Redis{failure}")
        return False

    async def acquire(self) -> bool:
        """Take the lease if nobody holds it; True when this process now leads."""
        sent = self.clock()
        token, value, *rest = await self._acquire(keys=[self.key, self.token_key, self.roster_key],
                                                  args=[self.holder, self._ms(), self.newest_token])
        self.leader = value.decode() if isinstance(value, bytes) else value
        if self.leader and self.leader.rpartition("#")[2].isdigit():
            self.newest_token = max(self.newest_token, int(self.leader.rpartition("#")[2]))
        if not int(token):
            self._notice = None  # another took the lease the notice was about
            # Counted from the answer, not the call: the lease lapses no sooner than that.
            left = int(rest[0]) if rest else -1
            self.lapses_at = self.clock() + left / 1000 if left >= 0 else None
            return False
        roster, self.lapses_at = rest, None
        self.token, self._value, self.renewed_at, self.since = int(token), self.leader or "", sent, time.time()
        self.roster_seen, self._failure = _roster(roster[0] if roster else b""), None
        self.handover, self._notice = self._notice, None
        after = self.handover or {}
        log_event(logger, "leadership_taken", holder=self.holder, token=self.token, lease_seconds=self.ttl,
                  handed_over_by=after.get("holder"), after_seconds=round(time.time() - after["at"], 3)
                  if "at" in after else None)
        self._tell(True)
        return True

    async def renew(self) -> bool:
        """Extend the lease while it is still ours; step down (and False) when it is not."""
        sent = self.clock()
        token = self.token
        roster = json.dumps({"token": token, "relays": self.roster()}) if self.roster is not None else ""
        extended = await self._renew(keys=[self.key, self.roster_key],
                                     args=[self._value, self._ms(), roster, self._ms() * ROSTER_LEASES])
        if not self.token:
            return False  # stepped down while the renewal was on its way: a new term needs a new token
        if not int(extended):
            self.step_down("the lease is no longer ours (it expired and another process may hold it)")
            return False
        self.renewed_at, self._failure = sent, None
        return True

    async def write_roster(self) -> None:
        """Renew now, writing the roster with it: a relay joined, and a successor should wait for it too. A failure
        is left to the renewal loop."""
        from redis.exceptions import RedisError

        if not self.token:
            return
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            async with asyncio.timeout(max(0.01, self.renewed_at + self.ttl - self.margin - self.clock())):
                await self.renew()

    def step_down(self, reason: str) -> None:
        """Stop leading at once; the lease is given back if it is still ours (another may take it sooner)."""
        if not self.token:
            return
        log_event(logger, "leadership_lost", level=logging.ERROR, holder=self.holder, token=self.token,
                  reason=reason)
        self.token, self.since, value = 0, None, self._value
        self._tell(False)
        try:
            asyncio.get_running_loop().create_task(self._give_back(value, self._handover_notice(value, reason)))
        except RuntimeError:  # no loop (a unit test's clock): the lease expires on its own
            pass

    def _handover_notice(self, value: str, reason: str) -> str:
        token = int(value.rsplit("#", 1)[1]) if "#" in value else 0
        return json.dumps({"holder": self.holder, "token": token, "at": time.time(), "reason": reason})

    async def _give_back(self, value: str, notice: str) -> bool:
        from redis.exceptions import RedisError

        try:
            return bool(await self._resign(keys=[self.key], args=[value, notice, self.released]))
        except (RedisError, OSError):
            return False  # it expires on its own

    async def run(self) -> None:
        """Contend for the lease, and renew it while leading, three times a ttl, until cancelled."""
        from redis.exceptions import RedisError

        failing = False
        while True:
            try:
                if self.token:
                    # A renewal that has not answered when the lease may be gone is as good as a refusal.
                    async with asyncio.timeout(max(0.01, self.renewed_at + self.ttl - self.margin - self.clock())):
                        await self.renew()
                else:
                    await self.acquire()
                failing = False
            except (RedisError, OSError, TimeoutError) as exc:
                if self.token:
                    # Still ours in Redis until its ttl from the last renewal: try again while it is valid here
                    # (`leads` steps down when it is not).
                    self._failure = f"{type(exc).__name__}: {exc}"
                    log_event(logger, "lease_renewal_failed", level=logging.WARNING, holder=self.holder,
                              token=self.token, error=self._failure,
                              valid_seconds=round(self.renewed_at + self.ttl - self.margin - self.clock(), 3))
                    self.leads()
                elif not failing:
                    log_event(logger, "lease_unreachable", level=logging.ERROR, key=self.key,
                              error=f"{type(exc).__name__}: {exc}", hint="check --lease-redis")
                failing = True
            await self._pause(retry=failing)

    def standby_wait(self) -> float:
        """How long a standby waits before it tries the lease again: until the lease it was turned away by lapses,
        at most a third of a lease (the leader may renew meanwhile, and a lease of unknown length is tried then)."""
        if self.lapses_at is None:
            return self.ttl / 3
        return min(self.ttl / 3, max(0.0, self.lapses_at + LAPSE_SLACK - self.clock()))

    async def _pause(self, retry: bool = False) -> None:
        """A third of a lease between a leader's renewals (a tenth after one failed, never past the lease's
        validity); a standby's `standby_wait`, ended as soon as a leader announces it gave the lease back (a lost
        notice, or a subscription Redis refused, leaves the wait)."""
        from redis.exceptions import RedisError

        if self.token:
            valid = self.renewed_at + self.ttl - self.margin - self.clock()
            await asyncio.sleep(max(0.0, min(self.ttl * RETRY_SHARE, valid)) if retry else self.ttl / 3)
            return
        started, wait = self.clock(), self.standby_wait()
        try:
            if self._watch is None:
                self._watch = self.redis.pubsub()
                await self._watch.subscribe(self.released)
                log_event(logger, "lease_watched", holder=self.holder, channel=self.released, leader=self.leader)
            async with asyncio.timeout(wait + 1):
                message = await self._watch.get_message(ignore_subscribe_messages=True,
                                                        timeout=max(0.0, started + wait - self.clock()))
        except (RedisError, OSError, TimeoutError):
            await self.unwatch()
            await asyncio.sleep(max(0.0, started + wait - self.clock()))
            return
        if message is not None and message.get("type") == "message":
            try:
                self._notice = json.loads(message["data"])
            except (TypeError, ValueError):
                self._notice = None
            log_event(logger, "lease_released_notice", holder=self.holder, notice=self._notice)

    async def unwatch(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            try:
                await watch.aclose()
            except Exception:  # noqa: BLE001 - a subscription that is already broken: nothing left to close
                return

    async def resign(self, reason: str = "asked to stop") -> bool:
        """Hand the lease over at a clean stop: stop deciding at once, then give the lease back only if it is still
        ours (compare-and-delete) with a notice that wakes a standby, which takes over at once. True when given
        back; the listeners hear that this process no longer leads only then, so its relays are sent on to the
        standby after it can lead."""
        was_leading, value = bool(self.token), self._value if self.token else ""
        self.token, self.since, self.handing_over = 0, None, bool(value)
        given = bool(value) and await self._give_back(value, self._handover_notice(value, reason))
        log_event(logger, "leadership_handed_over" if given else "leadership_resigned", holder=self.holder,
                  lease_key=self.key, given_back=given)
        self.handing_over = False
        if was_leading:
            self._tell(False)
        await self.unwatch()
        return given

    def state(self) -> dict:
        """For /admin/state: who this process is, whether it leads, since when, with which token."""
        return {"holder": self.holder, "leading": self.leads(), "token": self.token, "since": self.since,
                "lease_key": self.key, "lease_seconds": self.ttl, "leader_seen": self.leader,
                "handing_over": self.handing_over, "handover": self.handover}

    def _ms(self) -> int:
        return max(1, int(self.ttl * 1000))

    def _tell(self, leading: bool) -> None:
        for listener in self.on_change:
            try:
                asyncio.get_running_loop().call_soon(listener, leading)
            except RuntimeError:
                listener(leading)


def _roster(raw: bytes | str) -> dict | None:
    """The roster as the last leader wrote it; None when there is none (or it cannot be read: then the takeover
    waits its whole window)."""
    try:
        roster = json.loads(raw) if raw else None
    except ValueError:
        return None
    if not isinstance(roster, dict) or not isinstance(roster.get("relays"), list):
        return None
    return {"token": roster.get("token"), "relays": [str(name) for name in roster["relays"]]}
