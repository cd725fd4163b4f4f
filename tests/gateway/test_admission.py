"""KV admission policy and ledger as units: sizing, the watermark ladder, quotas, the growth-room check."""

import pytest

from gateway.admission import Demand, KvAdmission, Outcome
from gateway.config import Admission, ConfigError, Quota, parse_config
from gateway.kv_ledger import KvLedger
from gateway.replicas import Replica
from gateway.request import DropReason


def setup(**kw):
    cfg = Admission(kvPoolBlocks=1000, tenantMaxShare=1.0, tenantSoftShare=1.0, longRequestTokens=1600, **kw)
    ledger = KvLedger(block_tokens=16, safety_factor=cfg.safetyFactor, window=60)
    return KvAdmission(cfg, ledger), ledger


def rep(url="http://r", kv=None):
    return Replica(url, healthy=True, kv_usage=kv)


def hold(ledger, replica, blocks, cls="interactive", fid="other", prio=100):
    return ledger.reserve(request_id="h", fairness_id=fid, traffic_class=cls, priority=prio, replica=replica.url,
                          prompt_tokens=blocks * 16, max_new_tokens=0, now=0.0)


def d(prompt, new, prio=0, cls="interactive", fid="t"):
    return Demand(prompt, new, prio, cls, fid)


def test_reservation_is_prompt_plus_max_new_in_blocks_times_the_safety_factor():
    ledger = KvLedger(block_tokens=16, safety_factor=1.5, window=60)
    assert ledger.blocks_for(100, 60) == 15  # ceil(160/16) = 10, x 1.5
    res = ledger.reserve(request_id="a", fairness_id="t", traffic_class="batch", priority=-10, replica="r",
                         prompt_tokens=100, max_new_tokens=60, now=0.0)
    assert (ledger.reserved_on("r"), ledger.by_replica["r"].used_blocks) == (15, 7)


def test_revise_follows_output_and_release_frees_everything():
    ledger = KvLedger(block_tokens=16, safety_factor=1.0, window=60)
    res = ledger.reserve(request_id="a", fairness_id="t", traffic_class="interactive", priority=0, replica="r",
                         prompt_tokens=32, max_new_tokens=64, now=0.0)
    assert ledger.reserved_on("r") == 6
    ledger.revise(res, 16, 1.0)
    assert ledger.by_replica["r"].used_blocks == 3 and ledger.reserved_on("r") == 6  # worst case still held
    ledger.revise(res, 20, 2.0, done=True)  # generation ended early: only what is used stays reserved
    assert ledger.reserved_on("r") == 4
    assert ledger.token_seconds(fairness_id="t", now=2.0) == pytest.approx(32 * 1 + 48 * 1)
    assert ledger.release(res, 3.0) and not ledger.release(res, 3.0)
    assert ledger.reserved_on("r") == 0 and ledger.tenant("t").active == 0


@pytest.mark.parametrize("prompt, max_new", [(32, 64), (5, 40), (17, 3), (0, 33)])
def test_revising_only_when_due_keeps_the_same_blocks_as_revising_every_token(prompt, max_new):
    every, due_only = (KvLedger(block_tokens=16, safety_factor=1.0, window=60) for _ in range(2))
    a, b = (ledger.reserve(request_id="a", fairness_id="t", traffic_class="interactive", priority=0,
                           replica="r", prompt_tokens=prompt, max_new_tokens=max_new, now=0.0)
            for ledger in (every, due_only))
    due = due_only.revision_due(b)
    revisions = 0
    for out in range(1, max_new + 1):
        every.revise(a, out, float(out))
        if out >= due:
            due_only.revise(b, out, float(out))
            due = due_only.revision_due(b)
            revisions += 1
        assert (b.blocks, b.used_blocks, due_only.reserved_on("r")) == (a.blocks, a.used_blocks,
                                                                         every.reserved_on("r")), out
    # The ledger is touched once per block crossed (and at the output limit), not once per token.
    assert revisions <= max_new // 16 + 2


def test_the_watermark_ladder():
    adm, ledger = setup()
    r = rep()
    hold(ledger, r, 790)
    # short standard fits to the hard watermark, long standard stops at 0.82
    assert adm.decide(d(16 * 20, 0), [r], 0).outcome is Outcome.RUN                 # 810 <= 920
    assert adm.decide(d(16 * 100, 0), [r], 0).outcome is Outcome.QUEUE             # long: 890 > 820
    assert adm.decide(d(16 * 100, 0, prio=100), [r], 0).outcome is Outcome.RUN     # realtime: 890 <= 920
    # batch pauses at 0.88
    assert adm.decide(d(16 * 80, 0, -10, "batch"), [r], 0).outcome is Outcome.RUN   # 870 <= 880
    assert adm.decide(d(16 * 95, 0, -10, "batch"), [r], 0).outcome is Outcome.QUEUE  # 885 > 880
    # nothing above the hard watermark
    assert adm.decide(d(16 * 140, 0, prio=100), [r], 0).outcome is Outcome.QUEUE   # 930 > 920
    assert adm.level(r) == "normal"
    hold(ledger, r, 40)
    assert adm.level(r) == "admission"
    assert adm.level(rep(kv=0.93)) == "evict"  # scraped usage counts when above the reservations


def test_batch_reservations_keep_the_interactive_reserve():
    adm, ledger = setup()
    r = rep()
    hold(ledger, r, 740, cls="batch", prio=-10)
    assert adm.decide(d(16 * 10, 0, -10, "batch"), [r], 0).outcome is Outcome.RUN    # 750 <= 750
    assert adm.decide(d(16 * 11, 0, -10, "batch"), [r], 0).outcome is Outcome.QUEUE  # 751 > 750
    assert adm.decide(d(16 * 11, 0, 0), [r], 0).outcome is Outcome.RUN


def test_never_fits_and_context_limits_reject_with_what_to_change():
    r = rep()
    big = setup()[0].decide(d(16 * 930, 0, prio=100), [r], 0)
    assert big.reason is DropReason.KV_CAPACITY and "lower max_tokens" in big.message
    adm, _ = setup(maxContextTokens=8000, tenantQuota=Quota(maxContextTokens=4000))
    ctx = adm.decide(d(7000, 2000), [r], 0)
    assert ctx.reason is DropReason.CONTEXT_LENGTH and "8000" in ctx.message
    tenant = adm.decide(d(3000, 2000), [r], 0)
    assert tenant.reason is DropReason.CONTEXT_LENGTH and "maxContextTokens" in tenant.message


def test_tenant_hard_share_and_soft_share():
    cfg = Admission(kvPoolBlocks=1000, tenantMaxShare=0.15, tenantSoftShare=0.10)
    ledger = KvLedger(block_tokens=16, safety_factor=1.0, window=60)
    adm = KvAdmission(cfg, ledger)
    r = rep()
    hold(ledger, r, 120, fid="t")
    over = adm.decide(d(16 * 40, 0), [r], 0)
    assert over.reason is DropReason.QUOTA and "tenantMaxShare" in over.message and "0.160" in over.message
    assert adm.decide(d(16 * 20, 0), [r], 0).outcome is Outcome.RUN  # 0.14: over soft, under hard, pool calm
    hold(ledger, r, 700, fid="others")  # the replica at 0.82: a tenant over its soft share now waits
    assert adm.decide(d(16 * 20, 0, prio=100), [r], 0).outcome is Outcome.QUEUE
    assert adm.decide(d(16 * 20, 0, prio=100, fid="calm"), [r], 0).outcome is Outcome.RUN


@pytest.mark.parametrize("quota,asked,name", [
    (Quota(maxReservedTokens=1000), 600, "maxReservedTokens"),
    (Quota(maxActiveSequences=1), 16, "maxActiveSequences"),
])
def test_tenant_and_class_quotas(quota, asked, name):
    for scope in ("tenant", "class"):
        kw = {"tenants": {"t": quota}} if scope == "tenant" else {"classes": {"interactive": quota}}
        adm, ledger = setup(**kw)
        r = rep()
        ledger.reserve(request_id="a", fairness_id="t", traffic_class="interactive", priority=0, replica=r.url,
                       prompt_tokens=500, max_new_tokens=0, now=0.0)
        refused = adm.decide(d(asked, 0), [r], 0)
        assert refused.reason is DropReason.QUOTA and name in refused.message, (scope, refused)


def test_token_seconds_quota_counts_what_running_sequences_hold():
    adm, ledger = setup(tenants={"t": Quota(maxTokenSeconds=1000)})
    r = rep()
    ledger.reserve(request_id="a", fairness_id="t", traffic_class="interactive", priority=0, replica=r.url,
                   prompt_tokens=100, max_new_tokens=0, now=0.0)
    assert adm.decide(d(16, 0), [r], 5.0).outcome is Outcome.RUN      # 500 token-seconds
    refused = adm.decide(d(16, 0), [r], 11.0)                          # 1100
    assert refused.reason is DropReason.QUOTA and "maxTokenSeconds" in refused.message


def test_config_rejects_watermarks_without_room_for_one_cycle_of_growth():
    with pytest.raises(ConfigError, match="one scheduling cycle of growth"):
        parse_config("admission: {kvPoolBlocks: 500, hardWatermark: 0.95}\nsaturation: {maxConcurrency: 48}\n", "t")
    parse_config("admission: {kvPoolBlocks: 500, hardWatermark: 0.90}\nsaturation: {maxConcurrency: 48}\n", "t")
    with pytest.raises(ConfigError, match="batchPauseWatermark"):
        parse_config("admission: {admissionWatermark: 0.9, batchPauseWatermark: 0.85}\n", "t")


def test_token_seconds_window_forgets_old_tenants():
    from gateway.kv_ledger import TokenSecondsMeter
    meter = TokenSecondsMeter(window=10)
    meter.add("gone", 100, now=1.0)
    meter.add("here", 50, now=5.0)
    assert meter.total("gone", now=5.0) == 100
    meter.add("here", 50, now=30.0)  # a sweep: "gone" has nothing in the window any more
    assert "gone" not in meter._buckets and meter.total("here", now=30.0) == 50
