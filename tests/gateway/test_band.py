"""Priority bands: ordering policies (FCFS, EDF) and fairness policies (global strict, round robin)."""

import math

import pytest

from gateway.flow.band import PriorityBand
from gateway.flow.request import Ask, FlowRequest, Status
from gateway.policies.fairness import fairness_policy
from gateway.policies.ordering import EarliestDeadline, ordering_policy


def make(seq, fid="t", deadline=math.inf, expires=math.inf):
    r = FlowRequest(Ask(request_id=f"r{seq}", objective="batch", priority=-10, fairness_id=fid, tenant=fid,
                        arrived=float(seq), expires_at=expires, deadline=deadline))
    r.seq = seq
    r.status = Status.QUEUED
    return r


def drain(band):
    out = []
    while True:
        r = band.peek()
        if r is None:
            return out
        band.pop(r)
        r.status = Status.DISPATCHED
        out.append(r.request_id)


def band(fairness="global-strict", ordering="fcfs"):
    return PriorityBand(-10, max_requests=100, ttl=60, fairness=fairness, ordering=ordering)


def test_fcfs_global_strict_is_arrival_order_across_flows():
    b = band()
    for seq, fid in [(1, "a"), (2, "b"), (3, "a"), (4, "c"), (5, "b")]:
        b.push(make(seq, fid))
    assert drain(b) == ["r1", "r2", "r3", "r4", "r5"]
    assert b.queued == 0 and b.flows == {}


def test_round_robin_gives_each_flow_a_turn():
    b = band("round-robin")
    for seq, fid in [(1, "a"), (2, "a"), (3, "a"), (4, "b"), (5, "c"), (6, "c")]:
        b.push(make(seq, fid))
    assert drain(b) == ["r1", "r4", "r5", "r2", "r6", "r3"]


def test_round_robin_cursor_survives_new_flows():
    b = band("round-robin")
    b.push(make(1, "b"))
    b.push(make(2, "b"))
    first = b.peek()
    b.pop(first)
    first.status = Status.DISPATCHED
    b.push(make(3, "a"))  # the cursor sits on "b", so the turn wraps around to "a"
    assert drain(b) == ["r3", "r2"]


def test_edf_orders_by_deadline_then_expiry_with_none_last():
    b = band(ordering="edf")
    b.push(make(1))                      # no deadline, no expiry: last
    b.push(make(2, deadline=50.0))
    b.push(make(3, expires=20.0))        # queue expiry counts as its deadline
    b.push(make(4, deadline=50.0))       # tie with r2: FCFS
    assert drain(b) == ["r3", "r2", "r4", "r1"]


def test_withdrawn_request_is_skipped_and_counts_drop_at_once():
    b = band()
    reqs = [make(i, "a" if i % 2 else "b") for i in range(1, 5)]
    for r in reqs:
        b.push(r)
    reqs[0].status = Status.WITHDRAWN
    b.forget(reqs[0])
    assert b.queued == 3 and b.queue_sizes() == {"a": 1, "b": 2}
    assert drain(b) == ["r2", "r3", "r4"]


def test_changing_ordering_on_reload_requeues_everything():
    b = band()
    b.push(make(1, deadline=90.0))
    b.push(make(2, deadline=10.0))
    b.configure(max_requests=10, ttl=5, fairness="global-strict", ordering="edf", ceiling_override=None)
    assert b.queued == 2
    assert drain(b) == ["r2", "r1"]


def test_unknown_policies_are_refused_by_name():
    with pytest.raises(ValueError, match="fcfs"):
        ordering_policy("lifo")
    with pytest.raises(ValueError, match="round-robin"):
        fairness_policy("lottery")
    assert isinstance(ordering_policy("edf"), EarliestDeadline)
