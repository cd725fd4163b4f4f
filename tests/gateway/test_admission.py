"""KV admission policy and ledger as units: sizing, the watermark ladder, quotas, the growth-room check."""

from dataclasses import replace
import pytest

from gateway.calibration import Profile
from gateway.flow.interface import Outcome as FlowOutcome
from gateway.flow.ledger import KvLedger
from gateway.flow.request import DropReason
from gateway.policies.admission import Demand, KvAdmission, KvOutcome
from gateway.replicas import Replica
from gateway.settings import Admission, ConfigError, Quota, parse_config
from tests.gateway.test_flow_control import controller, req, run


def setup(**kw):
    cfg = Admission(kvPoolBlocks=1000, tenantMaxShare=1.0, tenantSoftShare=1.0, longRequestTokens=1600, **kw)
    ledger = KvLedger(block_tokens=16, safety_factor=cfg.safetyFactor, window=60)
    return KvAdmission(cfg, ledger), ledger


def rep(url="http://r", kv=None):
    return Replica(url, healthy=True, kv_usage=kv)


def hold(ledger, replica, blocks, cls="interactive", fid="other", prio=100):
    return ledger.reserve(request_id="h", fairness_id=fid, traffic_class=cls, priority=prio, replica=replica.url,
                          prompt_tokens=blocks * 16, max_new_tokens=0, now=0.0)


def d(prompt, new, prio=0, cls="interactive", fid="t", **kw):
    return Demand(prompt, new, prio, cls, fid, **kw)


def test_reservation_is_prompt_plus_max_new_in_blocks_times_the_safety_factor():
    ledger = KvLedger(block_tokens=16, safety_factor=1.5, window=60)
    assert ledger.kv_tokens_for(100, 60) == 15 * 16  # ceil(160/16) = 10 blocks, x 1.5
    res = ledger.reserve(request_id="a", fairness_id="t", traffic_class="batch", priority=-10, replica="r",
                         prompt_tokens=100, max_new_tokens=60, now=0.0)
    assert (ledger.kv_tokens_on("r"), ledger.by_replica["r"].used_kv_tokens) == (15 * 16, 7 * 16)
    assert (res.blocks, res.used_blocks) == (15, 7)


def test_a_reservation_is_whole_blocks_of_its_replicas_own_block_size():
    ledger = KvLedger(block_tokens=16, safety_factor=1.0, window=60)  # 16: only for a replica that reports none
    res = ledger.reserve(request_id="a", fairness_id="t", traffic_class="interactive", priority=0, replica="r",
                         prompt_tokens=100, max_new_tokens=60, now=0.0, block_size=128)
    assert (res.kv_tokens, res.blocks, res.used_kv_tokens, res.used_blocks) == (256, 2, 128, 1)
    assert ledger.revision_due(res) == 29  # the 129th held token opens the second block
    ledger.revise(res, 40, 1.0)
    assert (res.used_kv_tokens, ledger.revision_due(res)) == (256, 60)
    ledger.move(res, "s", block_size=16)  # reassigned to a replica of 16-token blocks: its 140 tokens, re-rounded
    assert (res.kv_tokens, res.used_kv_tokens, ledger.kv_tokens_on("r"), ledger.kv_tokens_on("s")) == (
        256, 144, 0, 256)


def test_revise_follows_output_and_release_frees_everything():
    ledger = KvLedger(block_tokens=16, safety_factor=1.0, window=60)
    res = ledger.reserve(request_id="a", fairness_id="t", traffic_class="interactive", priority=0, replica="r",
                         prompt_tokens=32, max_new_tokens=64, now=0.0)
    assert ledger.kv_tokens_on("r") == 6 * 16
    ledger.revise(res, 16, 1.0)
    assert ledger.by_replica["r"].used_kv_tokens == 3 * 16 and ledger.kv_tokens_on("r") == 6 * 16  # worst case held
    ledger.revise(res, 20, 2.0, done=True)  # generation ended early: only what is used stays reserved
    assert ledger.kv_tokens_on("r") == 4 * 16
    assert ledger.token_seconds(fairness_id="t", now=2.0) == pytest.approx(32 * 1 + 48 * 1)
    assert ledger.release(res, 3.0) and not ledger.release(res, 3.0)
    assert ledger.kv_tokens_on("r") == 0 and ledger.tenant("t").active == 0


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
        assert (b.blocks, b.used_blocks, due_only.kv_tokens_on("r")) == (a.blocks, a.used_blocks,
                                                                          every.kv_tokens_on("r")), out
    # The ledger is touched once per block crossed (and at the output limit), not once per token.
    assert revisions <= max_new // 16 + 2


def test_the_watermark_ladder():
    adm, ledger = setup()
    r = rep()
    hold(ledger, r, 790)
    # short standard fits to the hard watermark, long standard stops at 0.82
    assert adm.decide(d(16 * 20, 0), [r], 0).outcome is KvOutcome.RUN                 # 810 <= 920
    assert adm.decide(d(16 * 100, 0), [r], 0).outcome is KvOutcome.QUEUE             # long: 890 > 820
    assert adm.decide(d(16 * 100, 0, prio=100), [r], 0).outcome is KvOutcome.RUN     # realtime: 890 <= 920
    # batch pauses at 0.88
    assert adm.decide(d(16 * 80, 0, -10, "batch"), [r], 0).outcome is KvOutcome.RUN   # 870 <= 880
    assert adm.decide(d(16 * 95, 0, -10, "batch"), [r], 0).outcome is KvOutcome.QUEUE  # 885 > 880
    # nothing above the hard watermark
    assert adm.decide(d(16 * 140, 0, prio=100), [r], 0).outcome is KvOutcome.QUEUE   # 930 > 920
    assert adm.level(r) == "normal"
    hold(ledger, r, 40)
    assert adm.level(r) == "admission"
    assert adm.level(rep(kv=0.93)) == "evict"  # scraped usage counts when above the reservations


def test_batch_reservations_keep_the_interactive_reserve():
    adm, ledger = setup()
    r = rep()
    hold(ledger, r, 740, cls="batch", prio=-10)
    assert adm.decide(d(16 * 10, 0, -10, "batch"), [r], 0).outcome is KvOutcome.RUN    # 750 <= 750
    assert adm.decide(d(16 * 11, 0, -10, "batch"), [r], 0).outcome is KvOutcome.QUEUE  # 751 > 750
    assert adm.decide(d(16 * 11, 0, 0), [r], 0).outcome is KvOutcome.RUN


def test_never_fits_and_context_limits_reject_with_what_to_change():
    r = rep()
    big = setup()[0].decide(d(16 * 930, 0, prio=100), [r], 0)
    assert big.reason is DropReason.KV_NEVER_FITS and "930 KV blocks of 16 tokens" in big.message
    assert "lower max_tokens" in big.message
    adm, _ = setup(maxContextTokens=8000, tenantQuota=Quota(maxContextTokens=4000))
    ctx = adm.decide(d(8000, 16), [r], 0)
    assert ctx.reason is DropReason.CONTEXT_LENGTH and "maximum context length is 8000 tokens" in ctx.message
    tenant = adm.decide(d(3000, 2000), [r], 0)
    assert tenant.reason is DropReason.CONTEXT_LENGTH and "maxContextTokens" in tenant.message


def test_the_context_limit_rejects_only_what_vllm_rejects_and_reserves_what_it_runs():
    adm, _ = setup()
    r = Replica("http://r", healthy=True, max_model_len=512)
    # A prompt that fills the context: vLLM answers 400 and so does the gateway, saying what to change.
    full = adm.decide(d(512, 16), [r], 0)
    assert full.reason is DropReason.CONTEXT_LENGTH
    assert "maximum context length is 512 tokens" in full.message and "at most 511 tokens" in full.message
    assert adm.decide(d(512, 0), [r], 0).outcome is KvOutcome.RUN  # an embedding (no output) may fill it
    # An explicit limit above the context: 400 naming the field, as vLLM's.
    over = adm.decide(d(2, 600, limit_param="max_tokens"), [r], 0)
    assert over.reason is DropReason.CONTEXT_LENGTH
    assert "max_tokens=600 cannot be greater than" in over.message and "512" in over.message
    # Prompt + limit past the context: vLLM clamps the output to the context's end and answers 200.
    for new, param in ((510, "max_tokens"), (512, "max_completion_tokens"), (1024, None), (600, None)):
        asked = d(2, new, limit_param=param)
        assert adm.decide(asked, [r], 0).outcome is KvOutcome.RUN, (new, param)
        assert adm.within_context(asked, [r]).max_new_tokens == 510
    assert adm.kv_tokens(adm.within_context(d(9, 1024), [r]), r) == 512  # 9 + 503, not 9 + 1024


def test_an_estimated_prompt_is_never_refused_for_its_length_and_reserves_at_most_the_context():
    # Characters / 4 (the tokenizer timed out) can be far from the model's count: the replica decides.
    adm, _ = setup()
    r = Replica("http://r", healthy=True, max_model_len=512)
    guessed = d(700, 16, prompt_exact=False)
    assert adm.decide(guessed, [r], 0).outcome is KvOutcome.RUN
    clamped = adm.within_context(guessed, [r])
    assert (clamped.prompt_tokens, clamped.max_new_tokens) == (511, 1)
    assert adm.kv_tokens(clamped, r) == 512
    assert adm.decide(d(700, 16), [r], 0).reason is DropReason.CONTEXT_LENGTH  # counted: refused as vLLM would
    # An explicit limit past the context does not depend on the prompt's count: still refused.
    assert adm.decide(d(7, 600, limit_param="max_tokens", prompt_exact=False), [r], 0).reason \
        is DropReason.CONTEXT_LENGTH


def test_the_pool_and_reservations_are_counted_in_the_replicas_own_block_size():
    # tests/fixtures/vllm/metrics.prom (real vLLM): 16384 blocks of 128 tokens, kv_cache_size_tokens 2,097,152.
    adm, _ = setup()  # blockTokens 16
    r = Replica("http://r", healthy=True, kv_block_size=128, num_gpu_blocks=16384)
    assert (adm.block_size(r), adm.pool_tokens(r)) == (128, 2_097_152)
    assert adm.kv_tokens(d(100, 0), r) == 128
    # 300,000 tokens fit under 0.92 of the real pool; as 16384 blocks of 16 tokens (262,144) they never would.
    assert adm.decide(d(300_000, 0, prio=100), [r], 0).outcome is KvOutcome.RUN
    r.kv_cache_size_tokens = 1_000_000  # reported (hybrid models: not blocks x block size): it wins
    assert adm.pool_tokens(r) == 1_000_000
    # A replica that reports nothing: the calibration profile's geometry, else the config's (blockTokens).
    assert (adm.block_size(rep()), adm.pool_tokens(rep())) == (16, 16000)
    profile = Profile(model="m", runtime_version="v", gpu_sku="g", num_gpu_blocks=500, block_size=32,
                      max_model_len=None, measured_at=0.0)
    profiled = KvAdmission(adm.cfg, adm.ledger, profile)
    assert (profiled.block_size(rep()), profiled.pool_tokens(rep())) == (32, 16000)
    assert profiled.block_size(r) == 128  # the replica's own still wins


def test_dispatch_reserves_the_output_vllm_runs_in_the_replicas_blocks_and_admin_state_shows_both_units():
    async def main():
        fc, clock = controller("admission: {tenantMaxShare: 1.0, tenantSoftShare: 1.0}\nusageLimit: {policy: static}")
        replica = fc.pool.replicas[0]
        # As real vLLM reports itself (tests/fixtures/vllm/metrics.prom, --max-model-len 512).
        replica.max_model_len, replica.kv_block_size = 512, 128
        replica.num_gpu_blocks, replica.kv_cache_size_tokens = 16384, 2_097_152
        chat = req(fc, clock, "realtime")
        chat.ask = replace(chat.ask, prompt_tokens=9, max_new_tokens=1024)  # vLLM generates at most 503 of them
        assert fc.submit(chat) is FlowOutcome.DISPATCHED
        assert (chat.reservation.max_new_tokens, chat.reservation.kv_tokens, chat.reservation.blocks) == (503, 512, 4)
        pair = req(fc, clock, "realtime")
        pair.ask = replace(pair.ask, prompt_tokens=100, max_new_tokens=100, sequences=2)  # n=2: two outputs
        assert fc.submit(pair) is FlowOutcome.DISPATCHED
        assert (pair.reservation.max_new_tokens, pair.reservation.kv_tokens) == (200, 384)
        kv = fc.snapshot()["kv"]["replicas"][replica.url]
        assert (kv["block_size"], kv["total_kv_tokens"], kv["total_blocks"]) == (128, 2_097_152, 16384)
        assert (kv["reserved_kv_tokens"], kv["reserved_blocks"], kv["used_blocks"]) == (896, 7, 2)
        assert fc.snapshot()["kv"]["tenants"]["t"]["share"] == round(896 / 2_097_152, 6)
    run(main())


def test_every_sequence_reserves_its_own_output():
    adm, _ = setup()
    r = rep()
    assert adm.kv_tokens(d(100, 100, sequences=3), r) == 400
    assert adm.decide(d(16 * 100, 16 * 500, prio=100), [r], 0).outcome is KvOutcome.RUN  # 600 of 920 blocks
    two = adm.decide(d(16 * 100, 16 * 500, prio=100, sequences=2), [r], 0)          # 1100: never fits
    assert two.reason is DropReason.KV_NEVER_FITS and "x 2 sequences" in two.message


def test_tenant_hard_share_and_soft_share():
    cfg = Admission(kvPoolBlocks=1000, tenantMaxShare=0.15, tenantSoftShare=0.10)
    ledger = KvLedger(block_tokens=16, safety_factor=1.0, window=60)
    adm = KvAdmission(cfg, ledger)
    r = rep()
    hold(ledger, r, 120, fid="t")
    over = adm.decide(d(16 * 40, 0), [r], 0)
    assert over.reason is DropReason.QUOTA and "tenantMaxShare" in over.message and "0.160" in over.message
    assert adm.decide(d(16 * 20, 0), [r], 0).outcome is KvOutcome.RUN  # 0.14: over soft, under hard, pool calm
    hold(ledger, r, 700, fid="others")  # the replica at 0.82: a tenant over its soft share now waits
    assert adm.decide(d(16 * 20, 0, prio=100), [r], 0).outcome is KvOutcome.QUEUE
    assert adm.decide(d(16 * 20, 0, prio=100, fid="calm"), [r], 0).outcome is KvOutcome.RUN


def test_a_tenant_holding_nothing_runs_one_request_bigger_than_its_hard_share():
    """A request over the share alone (a long context on a small pool) runs when its tenant holds nothing, one
    at a time: refusing it "retry later" would refuse it forever, since the tenant has nothing of its own to end."""
    cfg = Admission(kvPoolBlocks=1000, tenantMaxShare=0.15, tenantSoftShare=0.10)
    ledger = KvLedger(block_tokens=16, safety_factor=1.0, window=60)
    adm = KvAdmission(cfg, ledger)
    r = rep()
    assert adm.decide(d(16 * 200, 0), [r], 0).outcome is KvOutcome.RUN  # 0.22 of the pool, the tenant at 0
    hold(ledger, r, 200, fid="t")
    second = adm.decide(d(16 * 200, 0), [r], 0)
    assert second.reason is DropReason.QUOTA and "3200 KV tokens reserved + 3200 asked" in second.message
    assert adm.decide(d(16 * 1200, 0), [r], 0).reason is DropReason.KV_NEVER_FITS, "the pool itself still binds"


def test_a_tenant_allowed_the_whole_pool_waits_for_room_instead_of_being_refused():
    """tenantMaxShare 1.0 (a lone tenant's setting): a tenant whose next request would take it past the pool is
    not over any quota; it waits for KV room (queued until queueDeadlineMs) as any request that does not fit."""
    adm, ledger = setup()
    r = rep()
    hold(ledger, r, 950, fid="t")
    over = adm.decide(d(16 * 100, 0, prio=100), [r], 0)  # 1,050 of the pool's 1,000 blocks: no room now
    assert (over.outcome, over.reason) == (KvOutcome.QUEUE, None), over


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
    assert adm.decide(d(16, 0), [r], 5.0).outcome is KvOutcome.RUN      # 500 token-seconds
    refused = adm.decide(d(16, 0), [r], 11.0)                          # 1100
    assert refused.reason is DropReason.QUOTA and "maxTokenSeconds" in refused.message


def test_config_rejects_watermarks_without_room_for_one_cycle_of_growth():
    with pytest.raises(ConfigError, match="one scheduling cycle of growth"):
        parse_config("admission: {kvPoolBlocks: 500, hardWatermark: 0.95}\nsaturation: {maxConcurrency: 48}\n", "t")
    parse_config("admission: {kvPoolBlocks: 500, hardWatermark: 0.90}\nsaturation: {maxConcurrency: 48}\n", "t")
    with pytest.raises(ConfigError, match="batchPauseWatermark"):
        parse_config("admission: {admissionWatermark: 0.9, batchPauseWatermark: 0.85}\n", "t")


def test_token_seconds_window_forgets_old_tenants():
    from gateway.flow.ledger import TokenSecondsMeter
    meter = TokenSecondsMeter(window=10)
    meter.add("gone", 100, now=1.0)
    meter.add("here", 50, now=5.0)
    assert meter.total("gone", now=5.0) == 100
    meter.add("here", 50, now=30.0)  # a sweep: "gone" has nothing in the window any more
    assert "gone" not in meter._buckets and meter.total("here", now=30.0) == 50
