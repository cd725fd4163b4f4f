"""KV admission (seed 004): commitment estimate, watermarks, interactive reserve, tenant share, verdicts."""

import json

import pytest

from gateway.admission import KvAdmission, Verdict
from gateway.config import Admission
from gateway.replicas import Replica


def policy(**kw):
    return KvAdmission(Admission(enabled=True, kvPoolBlocks=1000, **kw))


def rep(committed=0, kv=None, blocks_total=None):
    return Replica("http://r", healthy=True, committed_blocks=committed, kv_usage=kv,
                   kv_blocks_total=blocks_total)


def test_seed_defaults_give_the_pool_size_from_gib():
    a = KvAdmission(Admission(enabled=True))
    # 52 GiB / (128 KiB per token * 16 tokens per block)
    assert a.default_pool_blocks == 52 * 2**30 // (131072 * 16)
    assert a.sheddable_cap == pytest.approx(0.75)  # min(0.82, 1 - 0.25)
    assert a.interactive_cap == pytest.approx(0.92)


def test_commitment_is_prompt_plus_max_tokens_in_blocks():
    a = policy()
    body = {"messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 60}
    assert a.estimate_tokens(body) == (100, 60)
    assert a.estimate_blocks(json.dumps(body).encode()) == 10  # ceil(160 / 16)


def test_missing_max_tokens_uses_the_conservative_default_and_token_ids_count_exactly():
    a = policy()
    assert a.estimate_tokens({"prompt": [1, 2, 3, 4]}) == (4, 1024)
    assert a.estimate_tokens({"prompt": ["abcd", "efgh"], "max_completion_tokens": 5}) == (2, 5)
    assert a.estimate_tokens({"input": "abcdefgh"}) == (2, 0)
    assert a.estimate_blocks(b"not json") == 64  # 1024 / 16


def test_sheddable_work_may_not_use_the_interactive_reserve():
    a = policy()
    r = rep(committed=700)
    assert not a.fits(60, -10, r)   # 760 > 750
    assert a.fits(50, -10, r)       # 750 <= 750
    assert a.fits(200, 100, r)      # 900 <= 920
    assert not a.fits(221, 100, r)


def test_scraped_usage_counts_when_it_is_higher_than_our_reservations():
    a = policy()
    r = rep(committed=100, kv=0.7)
    assert a.used_blocks(r) == pytest.approx(700)
    assert rep(committed=800, kv=0.1, blocks_total=2000).kv_blocks_total == 2000
    assert a.pool_blocks(rep(blocks_total=2000)) == 2000


def test_verdicts():
    a = policy()
    reps = [rep(committed=741), rep(committed=745)]
    assert a.check(10, 100, "t", reps, {}) is Verdict.DISPATCH
    assert a.check(10, -10, "t", reps, {}) is Verdict.QUEUE          # waits for room
    assert a.check(800, -10, "t", reps, {}) is Verdict.REJECT_KV     # could never fit a replica
    assert a.check(10, -10, "t", reps, {"t": 295}) is Verdict.REJECT_QUOTA  # 0.15 * 2000 = 300
    assert a.check(10, -10, "other", [rep()], {"t": 295}) is Verdict.DISPATCH


def test_watermarks_must_be_ordered():
    with pytest.raises(ValueError):
        Admission(admissionWatermark=0.95, hardWatermark=0.9)
