"""Victim order of the `cost-ranked` policy: each cost factor alone moves a candidate the right way, lower
priority bands go first, interactive requests only above the hard watermark.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.policies.victim_cost import CostRankedPolicy
from gateway.policies.victims import VictimCandidate, VictimPolicy

NOW = 1000.0
BASE = VictimCandidate(
    request_id="base", fairness_id="t1", priority=-1, objective="batch", replica="r1", started_at=990.0,
    enqueued_at=989.0, deadline=None, prompt_tokens=500, max_new_tokens=512, output_tokens=100,
    streaming_started=True, resumable=False, cached_prefix_tokens=0, tenant_over_soft_quota=0.0,
    reserved_blocks=64,
)


def first(*candidates: VictimCandidate, **kwargs) -> list[str]:
    return [c.request_id for c in CostRankedPolicy().order(list(candidates), NOW, **kwargs)]


def test_it_satisfies_the_victim_policy_protocol():
    policy: VictimPolicy = CostRankedPolicy()
    assert policy.name == "cost-ranked"
    assert policy.order([], NOW) == []


@pytest.mark.parametrize("cheap, dear, why", [
    (dict(resumable=True), dict(resumable=False), "a resumable request loses only prefill"),
    (dict(streaming_started=False, output_tokens=0), dict(), "nothing streamed yet: nothing seen is cut off"),
    (dict(tenant_over_soft_quota=1.0), dict(), "its tenant is over the soft quota"),
    (dict(), dict(deadline=NOW + 5.0), "the other's deadline is close"),
    (dict(), dict(enqueued_at=900.0), "the other already waited long"),
    (dict(), dict(evictions=1), "the other was evicted before"),
    (dict(output_tokens=10), dict(output_tokens=400), "less output would be thrown away"),
    (dict(max_new_tokens=4000), dict(), "more output still to come: its blocks would stay longer"),
    (dict(), dict(cached_prefix_tokens=480), "the other's shared prefix stays: evicting it frees less"),
    (dict(prompt_tokens=50), dict(prompt_tokens=5000), "less prefill to recompute"),
])
def test_each_cost_factor_ranks_the_cheaper_candidate_first(cheap, dear, why):
    a = replace(BASE, request_id="cheap", **cheap)
    b = replace(BASE, request_id="dear", **dear)
    assert first(b, a) == ["cheap", "dear"], why
    assert first(a, b) == ["cheap", "dear"], why


def test_lower_priority_bands_go_first_whatever_their_cost():
    bulk = replace(BASE, request_id="bulk", priority=-2, output_tokens=500, enqueued_at=0.0)
    batch = replace(BASE, request_id="batch", priority=-1, resumable=True, output_tokens=0,
                    streaming_started=False)
    assert first(batch, bulk) == ["bulk", "batch"]


def test_interactive_requests_are_candidates_only_above_the_hard_watermark():
    chat = replace(BASE, request_id="chat", priority=0, objective="realtime", output_tokens=0,
                   streaming_started=False, resumable=True)
    batch = replace(BASE, request_id="batch")
    assert first(chat, batch) == ["batch"]
    assert first(chat, batch, hard_watermark_crossed=True) == ["batch", "chat"], "and then after every batch one"


def test_equal_costs_go_newest_first():
    old = replace(BASE, request_id="old", started_at=980.0, enqueued_at=979.0)
    new = replace(BASE, request_id="new", started_at=995.0, enqueued_at=994.0)
    assert first(old, new) == ["new", "old"]


def test_a_mixed_pool_is_ranked_resumable_quiet_over_quota_work_first():
    """Newest-first would evict the newest streaming request first and throw its decode away; a close deadline
    protects even a cheap request."""
    pool = [
        replace(BASE, request_id="streaming-new", started_at=999.0, enqueued_at=998.0, output_tokens=30),
        replace(BASE, request_id="resumable-old", started_at=960.0, enqueued_at=959.0, output_tokens=100,
                resumable=True),
        replace(BASE, request_id="queued-over-quota", started_at=970.0, enqueued_at=969.0, output_tokens=0,
                streaming_started=False, tenant_over_soft_quota=0.5),
        replace(BASE, request_id="near-deadline", started_at=998.0, enqueued_at=997.0, output_tokens=5,
                deadline=NOW + 2.0, resumable=True),
    ]
    assert first(*pool) == ["queued-over-quota", "resumable-old", "streaming-new", "near-deadline"]
    newest_first = [c.request_id for c in sorted(pool, key=lambda c: (c.priority, -c.started_at))]
    assert newest_first[0] == "streaming-new"


def test_the_cost_breakdown_explains_the_rank():
    policy = CostRankedPolicy(block_tokens=16)
    c = replace(BASE, resumable=True, cached_prefix_tokens=160, tenant_over_soft_quota=0.5)
    cost = policy.cost(c, NOW)
    assert cost.lost_work == 500 + 100 - 160 + 1
    assert cost.quota_relief == pytest.approx(3.0)
    assert cost.gain == pytest.approx((64 - 10) * (1 + 412 / 256))
    with pytest.raises(ValueError, match="block_tokens"):
        CostRankedPolicy(block_tokens=0)
