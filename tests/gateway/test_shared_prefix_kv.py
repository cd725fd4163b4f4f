"""KV admission counts a prompt prefix that running requests on one replica share once, as vLLM's prefix cache holds
it (gateway/flow/ledger.py `SharedPrefixes`), per replica, per traffic class and per fairness id on it."""

import asyncio
import random

import httpx
import pytest

from gateway.bodies import PREFIX_BLOCK_CHARS, prefix_share
from gateway.flow.ledger import SHARE_STRIDE, KvLedger, SharedPrefixes, coarse_prefix, shared_whole_blocks
from gateway.policies.admission import Demand, KvAdmission, KvOutcome
from gateway.replicas import Replica
from gateway.settings import Admission
from gateway.vllm_metrics import parse_vllm_metrics
from holdback.contract import CHAT_ENDPOINT
from holdback.sim_tokenizer import prompt_text
from tests.gateway.test_gateway_sim import wait_until
from tests.gateway.test_kv_admission_sim import Held, hdr, kv


SYSTEM = "You grade answers. " * 200  # 3,800 characters, about 30 text blocks


def chat(question: str, system: str = SYSTEM) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def ask(ledger, rid, replica="r", prompt=1200, new=16, cls="batch", fid="t", question=None, system=SYSTEM,
        salt="s", block=16):
    prefix, share = prefix_share(chat(question or f"question {rid}?", system), CHAT_ENDPOINT.path, salt)
    return ledger.reserve(request_id=rid, fairness_id=fid, traffic_class=cls, priority=-10 if cls == "batch" else 0,
                          replica=replica, prompt_tokens=prompt, max_new_tokens=new, now=0.0, block_size=block,
                          prefix=prefix, prefix_tokens=int(prompt * share))


def test_the_prefix_covers_the_prompts_characters_up_to_its_last_block():
    prefix, share = prefix_share(chat("q?"), CHAT_ENDPOINT.path, "s")
    assert share == 1.0 and len(prefix) >= len(SYSTEM) // PREFIX_BLOCK_CHARS
    long_prefix, long_share = prefix_share(chat("q?", system="word " * 4000), CHAT_ENDPOINT.path, "s")
    assert len(long_prefix) == 64 and 0.4 < long_share < 0.5  # 8,192 of about 20,000 characters
    assert prefix_share({"input": "x"}, "/v1/embeddings", None) == ((), 0.0)


def test_requests_sharing_a_system_prompt_on_one_replica_count_it_once():
    ledger = KvLedger(block_tokens=16, safety_factor=1.0, window=60)
    first = ask(ledger, "a")
    alone = ledger.kv_tokens_on("r")
    assert alone == first.kv_tokens == 76 * 16  # 1,216 tokens: nothing shared yet
    ask(ledger, "b")
    ask(ledger, "c")
    # The system prompt is about 95% of each prompt's characters: each sharer counts only its own question and
    # output, and one block where the prompts part.
    shared = 3 * first.kv_tokens - ledger.kv_tokens_on("r")
    assert 2 * 1000 <= shared <= 2 * 1140
    assert ledger.batch_kv_tokens["r"] == ledger.kv_tokens_on("r") == ledger.tenant("t").kv_tokens
    assert ledger.traffic_class("batch").kv_tokens == ledger.kv_tokens_on("r")
    assert ledger.by_replica["r"].used_kv_tokens == 3 * first.used_kv_tokens - shared


def test_nothing_is_shared_across_replicas_salts_or_different_prompts():
    ledger = KvLedger(block_tokens=16, safety_factor=1.0, window=60)
    a = ask(ledger, "a")
    ask(ledger, "b", replica="other")  # the same prompt on another replica: its own blocks there
    ask(ledger, "c", salt="another tenant's salt", fid="u")
    ask(ledger, "d", system="A different system prompt entirely. " * 100)
    assert ledger.kv_tokens_on("r") == 3 * a.kv_tokens and ledger.kv_tokens_on("other") == a.kv_tokens


def test_a_shared_prefix_is_counted_again_by_its_holders_as_the_others_end_and_nothing_is_left():
    ledger = KvLedger(block_tokens=16, safety_factor=1.0, window=60)
    held = [ask(ledger, str(i)) for i in range(4)]
    assert ledger.unshared(held[0], held[0].used_kv_tokens) < held[0].used_kv_tokens / 5  # the others keep it
    for res in held[:3]:
        ledger.release(res, 1.0)
    assert ledger.kv_tokens_on("r") == held[3].kv_tokens  # the last holder holds the whole prefix again
    assert ledger.unshared(held[3], held[3].used_kv_tokens) == held[3].used_kv_tokens
    ledger.release(held[3], 2.0)
    assert ledger.kv_tokens_on("r") == 0 and ledger.batch_kv_tokens["r"] == 0 and not ledger.shared


def test_between_classes_the_replica_counts_the_prefix_once_and_each_class_its_own_holders():
    ledger = KvLedger(block_tokens=16, safety_factor=1.0, window=60)
    batch = ask(ledger, "batch")
    realtime = ask(ledger, "rt", cls="interactive")
    assert ledger.batch_kv_tokens["r"] == batch.kv_tokens  # batch alone holds it within the batch class
    assert ledger.traffic_class("interactive").kv_tokens == realtime.kv_tokens
    assert ledger.kv_tokens_on("r") < batch.kv_tokens + realtime.kv_tokens - 900


@pytest.mark.parametrize("seed", range(5))
def test_any_sequence_of_reserve_revise_move_and_release_keeps_totals_whole_and_ends_at_zero(seed):
    rnd = random.Random(seed)
    ledger = KvLedger(block_tokens=16, safety_factor=1.0, window=60)
    systems = ["Rules one. " * 150, "Rules two. " * 300, "Short. "]
    live = []
    for step in range(400):
        if live and rnd.random() < 0.45:
            res = live.pop(rnd.randrange(len(live)))
            ledger.release(res, float(step))
        elif live and rnd.random() < 0.2:
            ledger.move(rnd.choice(live), rnd.choice(["r", "q"]))
        elif live and rnd.random() < 0.3:
            res = rnd.choice(live)
            ledger.revise(res, res.output_tokens + rnd.randint(1, 40), float(step), done=rnd.random() < 0.2)
        else:
            system, question = rnd.choice(systems), f"q{rnd.randint(0, 3)}"
            chars = len(prompt_text(CHAT_ENDPOINT.path, chat(question, system)))
            # About 3.2 characters a token, each prompt's own density a little different (its own words).
            live.append(ask(ledger, f"x{step}", replica=rnd.choice(["r", "q"]),
                            prompt=round(chars / 3.2 * rnd.uniform(0.95, 1.05)), new=rnd.randint(1, 200),
                            cls=rnd.choice(["batch", "interactive"]), fid=rnd.choice(["t", "u"]), system=system,
                            question=question))
        for replica in ("r", "q"):
            mine = [res for res in live if res.replica == replica]
            raw = sum(res.kv_tokens for res in mine)
            net = ledger.kv_tokens_on(replica)
            assert net % 16 == 0 and 0.9 * max((res.kv_tokens for res in mine), default=0) <= net <= raw
            assert 0 <= ledger.by_replica[replica].used_kv_tokens <= sum(res.used_kv_tokens for res in mine)
            assert 0 <= ledger.batch_kv_tokens[replica] <= sum(r.kv_tokens for r in mine if r.traffic_class == "batch")
    for res in live:
        ledger.release(res, 500.0)
    assert not ledger.shared and not ledger.by_tenant and not ledger.by_class
    assert ledger.kv_tokens_on("r") == ledger.kv_tokens_on("q") == 0 and sum(ledger.batch_kv_tokens.values()) == 0


class BlockByBlock:
    """`SharedPrefixes` as its definition reads, one block at a time: the reference its bisection must agree with."""

    def __init__(self):
        self.holders, self.tokens, self.extra, self.sharers = {}, {}, 0.0, 0

    def add(self, prefix, per_block):
        for block in prefix:
            if self.holders.get(block):
                self.extra += self.tokens[block]
            else:
                self.tokens[block] = per_block
            self.holders[block] = self.holders.get(block, 0) + 1
        self.sharers += self.holders[prefix[0]] > 1

    def remove(self, prefix):
        self.sharers -= self.holders[prefix[0]] > 1
        for block in prefix:
            self.holders[block] -= 1
            if self.holders[block]:
                self.extra -= self.tokens[block]
            else:
                del self.holders[block], self.tokens[block]


@pytest.mark.parametrize("seed", range(3))
def test_the_bisected_counts_agree_with_counting_block_by_block(seed):
    rnd = random.Random(seed)
    fast, slow = SharedPrefixes(), BlockByBlock()
    # Chained prefixes of a tree: three roots, branching at random depths, as prompts sharing leading blocks do.
    trees = [[(root, i) for i in range(40)] for root in range(3)]
    live = []
    for _ in range(600):
        if live and rnd.random() < 0.5:
            prefix = live.pop(rnd.randrange(len(live)))
            fast.remove(prefix)
            slow.remove(prefix)
        else:
            stem = rnd.choice(trees)[:rnd.randint(1, 40)]
            prefix = tuple(hash(b) for b in stem) + tuple(hash(("own", rnd.random())) for _ in range(rnd.randint(0, 5)))
            per_block = rnd.uniform(20, 40)
            fast.add(prefix, per_block)
            slow.add(prefix, per_block)
            live.append(prefix)
        assert dict(fast.holders) == slow.holders and fast.sharers == slow.sharers
        assert fast.extra == pytest.approx(slow.extra, abs=1e-6)
        if live:  # a prefix that runs: every block of it is held, so held() is its tokens
            probe = rnd.choice(live)
            assert fast.held(probe) == pytest.approx(sum(slow.tokens[b] for b in probe))
            shared = [b for b in probe if slow.holders[b] > 1]
            assert fast.held_by_others(probe) == pytest.approx(sum(slow.tokens[b] for b in shared))
    for prefix in live:
        fast.remove(prefix)
    assert not fast.holders and not fast.upto and fast.sharers == 0 and fast.extra == pytest.approx(0, abs=1e-6)


def test_the_ledger_holds_no_less_than_vllm_for_a_shared_system_prompt():
    """vLLM holds the shared prompt's whole blocks once and each request's own rest: the ledger, from characters,
    holds at least that (never less), and at most a step of its prefix (SHARE_STRIDE text blocks) and two blocks
    more a request."""
    block = 16
    ledger = KvLedger(block_tokens=block, safety_factor=1.0, window=60)
    # The prompt's tokens are spread evenly over its characters (as the estimate assumes): the system prompt is
    # 3,800 of 3,836 characters (its chat rendering), so about 1,188 of the 1,200 tokens.
    n = 8
    held = [ask(ledger, str(i), new=0, question=f"q{i}") for i in range(n)]
    text_chars = len(SYSTEM) + 36
    shared_tokens = 1200 * len(SYSTEM) // text_chars - 10
    vllm_blocks = shared_tokens // block + n * (-(-(1200 - (shared_tokens // block) * block) // block))
    ledger_blocks = ledger.by_replica["r"].used_kv_tokens // block
    step_blocks = -(-1200 * SHARE_STRIDE * PREFIX_BLOCK_CHARS // text_chars // block)
    assert vllm_blocks <= ledger_blocks <= vllm_blocks + (step_blocks + 2) * n
    assert ledger_blocks < sum(res.used_blocks for res in held) / 4


def setup(pool_blocks=104, block=128):
    cfg = Admission(kvPoolBlocks=pool_blocks, blockTokens=block, tenantMaxShare=1.0, tenantSoftShare=1.0)
    ledger = KvLedger(block_tokens=block, safety_factor=1.0, window=60)
    return KvAdmission(cfg, ledger), ledger


def demand(question, prompt=1200, new=16, system=SYSTEM, salt="s"):
    prefix, share = prefix_share(chat(question, system), CHAT_ENDPOINT.path, salt)
    return Demand(prompt, new, -10, "batch", "t", prefix=prefix, prefix_tokens=int(prompt * share))


def test_admission_runs_as_many_sharers_as_the_pool_holds_counting_the_prompt_once():
    """The real-engine prefix study's system-prompt workload: 104 blocks of 128 tokens, batch capped at 0.75 of
    them (78 blocks). A request of 1,200 + 16 tokens takes 10 blocks: 7 such would fill batch's share if counted
    whole; vLLM holds the shared 1,000-odd tokens once, and each request's own rest in 2 blocks."""
    adm, ledger = setup()
    replica = Replica("r", healthy=True, kv_usage=0.0, prefix_caching=True)
    running = 0
    while running < 40:
        d = demand(f"question {running}?")
        decision = adm.decide(d, [replica], 0.0)
        if decision.outcome is not KvOutcome.RUN:
            break
        ledger.reserve(request_id=str(running), fairness_id="t", traffic_class="batch", priority=-10,
                       replica="r", prompt_tokens=d.prompt_tokens, max_new_tokens=d.max_new_tokens, now=0.0,
                       block_size=128, prefix=d.prefix, prefix_tokens=d.prefix_tokens, sharing=True)
        running += 1
    assert running >= 25  # counted whole: 7 (vLLM holds 31 in 40 blocks: 9 shared, one each of its own)
    assert ledger.batch_kv_tokens["r"] <= 0.75 * 104 * 128
    unshared = demand("question?", system="Another long system prompt. " * 140)
    assert adm.decide(unshared, [replica], 0.0).outcome is KvOutcome.QUEUE  # its own 10 blocks do not fit
    # What runs there shares nothing with a prompt of another tenant (salt): it is counted whole.
    assert adm.added(demand("q?", salt="other"), 1280, replica, "batch") == 1280
    coarse, _ = coarse_prefix(demand("q?").prefix, 1200)
    assert adm.added(demand("q?"), 1280, replica, "batch") == 1280 - shared_whole_blocks(
        ledger.shared["r"].held(coarse), 128) <= 3 * 128


# -- over HTTP: the gateway (one process and relays) in front of `holdback sim`, whose KV holds a shared prefix once --

SIM_ARGS = ("--num-blocks", "400", "--max-model-len", "16000", "--decode-base-ms", "30", "--max-num-seqs", "16",
            "--enable-prefix-caching")
CONFIG = """
saturation: {maxConcurrency: 16}
usageLimit: {policy: static}
metrics: {scrapeIntervalSeconds: 0.1}
flowControl: {cachedFirstLookahead: 0}
admission: {tokenizer: simulator, tenantMaxShare: 1.0, tenantSoftShare: 1.0, queueDeadlineMs: 60000}
"""


def batch_body(system: str, i: int) -> dict:
    """About 1,000 tokens of `system`, 20 of its own, 400 out: 89 blocks of 16 tokens counted whole."""
    return {"model": "sim-model", "prompt": system + f" question {i}" + " why" * 18, "max_tokens": 400,
            "ignore_eos": True, "stream": True}


@pytest.mark.parametrize("gateway_workers", [1, 2], ids=["one-process", "workers-2"], indirect=True)
def test_through_the_gateway_batch_sharing_a_system_prompt_runs_as_the_replica_holds_it(stack):
    """400 blocks of 16 tokens; batch may reserve 0.75 of them (300). Six batch requests with one system prompt of
    1,000 tokens: each is 89 blocks counted whole, so three would fit; the simulator holds the prompt once, so
    the gateway runs all six, its ledger never under what the replica reports used. Six with prompts of their own
    then run three at a time."""
    [sim] = stack.sim(1, *SIM_ARGS)
    gw = stack.gateway([sim], CONFIG)

    async def main():
        async with httpx.AsyncClient(base_url=gw.url, timeout=120) as client:
            await wait_until(lambda: kv(gw, sim)["total_blocks"] == 400)
            shared = [Held(client, batch_body(" sys" * 1000, i), hdr("batch", "bulk")) for i in range(6)]
            await wait_until(lambda: gw.band(-10)["in_flight"] == 6, timeout=60)
            await wait_until(lambda: all(h.chunks for h in shared), timeout=60)
            await wait_until(lambda: (kv(gw, sim)["scraped_used_blocks"] or 0) >= 89, timeout=30)
            state = kv(gw, sim)
            assert 89 + 5 * 25 <= state["reserved_blocks"] <= 300 < 6 * 89
            assert state["reserved_blocks"] >= state["scraped_used_blocks"]  # never under what the replica holds
            for h in shared:
                await h.close()
            await wait_until(lambda: kv(gw, sim)["reserved_blocks"] == 0)
            own = [Held(client, batch_body(f" own{i}" * 1000, i), hdr("batch", "bulk")) for i in range(6)]
            await wait_until(lambda: gw.band(-10)["in_flight"] == 3 and gw.band(-10)["queued"] == 3, timeout=60)
            assert kv(gw, sim)["reserved_blocks"] == 3 * 89
            for h in own:
                await h.close()

    asyncio.run(main())


def test_a_replica_without_a_prefix_cache_shares_nothing():
    adm, ledger = setup()
    for caching in (False, None):  # off, or not reported
        replica = Replica("r", healthy=True, kv_usage=0.0, prefix_caching=caching)
        held = [ledger.reserve(request_id=str(i), fairness_id="t", traffic_class="batch", priority=-10, replica="r",
                               prompt_tokens=1200, max_new_tokens=16, now=0.0, block_size=128,
                               prefix=demand(f"q{i}").prefix, prefix_tokens=1200, sharing=bool(caching))
                for i in range(3)]
        assert ledger.kv_tokens_on("r") == 3 * 10 * 128 and not ledger.shared
        assert adm.added(demand("q?"), 1280, replica) == 1280
        for res in held:
            ledger.release(res, 1.0)
    sharing = [ask(ledger, str(i), block=128) for i in range(2)]
    ledger.move(sharing[1], "r", sharing=False)  # to a replica whose prefix cache is off: counted whole there
    assert ledger.kv_tokens_on("r") == 2 * 10 * 128 and set(ledger.shared["r"].holders.values()) == {1}


def test_the_replicas_prefix_cache_is_read_from_its_cache_config_info():
    line = ('vllm:cache_config_info{block_size="16",enable_prefix_caching="%s",engine="0",num_gpu_blocks="100"} 1.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n')
    assert parse_vllm_metrics(line % "True")["enable_prefix_caching"] == 1.0
    assert parse_vllm_metrics(line % "False")["enable_prefix_caching"] == 0.0
    assert "enable_prefix_caching" not in parse_vllm_metrics(line.replace('enable_prefix_caching="%s",', ""))
