"""The prefix-affinity scorer: a request goes where its prompt's leading blocks were sent, unless that replica is
much busier than the least loaded; block hashes are salted per tenant and chained."""

from __future__ import annotations

import httpx
import pytest

from gateway.bodies import PREFIX_BLOCK_CHARS, PREFIX_MAX_BLOCKS, prefix_blocks
from gateway.policies.picker import EndpointPicker
from gateway.policies.prefix_affinity import PrefixAffinity
from gateway.policies.saturation import ConcurrencyDetector
from gateway.replicas import Replica

CHAT = "/v1/chat/completions"


def _chat(text: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}]}


def _picker(**scorer) -> EndpointPicker:
    picker = EndpointPicker(max_concurrency=8)
    picker.scorer = PrefixAffinity(**scorer)
    return picker


def test_prefix_blocks_are_chained_salted_and_bounded():
    doc = "D" * (3 * PREFIX_BLOCK_CHARS)
    one, two = prefix_blocks(_chat(doc + " first?"), CHAT, "tenant:a"), prefix_blocks(_chat(doc + " second?"), CHAT,
                                                                                      "tenant:a")
    shared = sum(1 for x, y in zip(one, two) if x == y)
    assert shared == 3 and one[3:] != two[3:]  # the document's blocks, not the question's
    assert set(prefix_blocks(_chat(doc), CHAT, "tenant:b")).isdisjoint(one)  # another tenant's scope
    assert prefix_blocks(_chat("X" + doc), CHAT, "tenant:a")[1:3] != one[1:3]  # chained: equal blocks later differ
    assert len(prefix_blocks(_chat("w" * PREFIX_BLOCK_CHARS * (PREFIX_MAX_BLOCKS + 5)), CHAT, None)) \
        == PREFIX_MAX_BLOCKS
    assert prefix_blocks({"input": "x"}, "/v1/embeddings", None) == ()
    assert prefix_blocks(None, CHAT, None) == ()
    assert prefix_blocks({"prompt": "hello"}, "/v1/completions", None) != ()


def test_a_request_follows_its_prefix_while_the_other_replica_is_not_much_less_loaded():
    d = ConcurrencyDetector(max_concurrency=8)
    p = _picker(max_load_gap=0.5)
    a, b = Replica("http://a", healthy=True, in_flight=0), Replica("http://b", healthy=True, in_flight=0)
    doc_1 = prefix_blocks(_chat("one " * 200 + "q1"), CHAT, "s")
    doc_2 = prefix_blocks(_chat("two " * 200 + "q1"), CHAT, "s")
    first = p.pick([a, b], d, 0, prefix=doc_1)
    first.in_flight += 1
    other = p.pick([a, b], d, 0, prefix=doc_2)
    assert other is not first  # nothing of doc 2 anywhere: the least loaded
    for q in range(3):  # doc 1's next questions stay with it, 3 of 8 slots busier than the other
        again = p.pick([a, b], d, 0, prefix=prefix_blocks(_chat("one " * 200 + f"q{q + 2}"), CHAT, "s"))
        assert again is first
        again.in_flight += 1
    first.in_flight = other.in_flight + 5  # now 5 of 8 slots busier: more than the gap
    assert p.pick([a, b], d, 0, prefix=doc_1) is other


def test_least_loaded_without_a_prefix_and_only_candidates_with_room():
    d = ConcurrencyDetector(max_concurrency=2)
    p = _picker()
    a, b = Replica("http://a", healthy=True, in_flight=1), Replica("http://b", healthy=True, in_flight=0)
    blocks = prefix_blocks(_chat("doc " * 100), CHAT, "s")
    p.scorer.sent("http://a", blocks)
    assert p.pick([a, b], d, 0) is b  # no prefix: least-loaded's score
    a.in_flight = 2  # full
    assert p.pick([a, b], d, 0, prefix=blocks) is b
    b.in_flight = 2
    assert p.pick([a, b], d, 0, prefix=blocks) is None


def test_what_was_sent_is_remembered_per_replica_up_to_its_bound():
    scorer = PrefixAffinity(blocks_per_replica=4)
    scorer.sent("http://a", (1, 2, 3))
    assert scorer.held("http://a", (1, 2, 3, 9)) == 3 and scorer.held("http://b", (1,)) == 0
    scorer.sent("http://a", (7, 8))  # 5 blocks: the least recent (1) goes
    assert scorer.held("http://a", (1, 2)) == 0 and scorer.held("http://a", (7, 8)) == 2
    with pytest.raises(ValueError, match="max_load_gap"):
        PrefixAffinity(max_load_gap=-1)


def _hits(url: str) -> tuple[float, float]:
    """The simulator's prefix-cache counters (vllm:prefix_cache_hits, _queries), in tokens."""
    text = httpx.get(url + "/metrics", timeout=10).text
    read = {name: sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith(name + "_total"))
            for name in ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries")}
    return read["vllm:prefix_cache_hits"], read["vllm:prefix_cache_queries"]


@pytest.mark.parametrize("gateway_workers", [1, 2], ids=["one-process", "workers-2"], indirect=True)
def test_configured_the_gateway_sends_each_documents_questions_where_its_prefix_went(stack):
    """`picker: {policy: prefix-affinity}`: questions about three documents, interleaved, each go to the replica
    the document's first question went to, and the replicas' prefix caches hit what least-loaded's rotation
    misses (the relays of `--workers 2` send the blocks to flow control with the request)."""
    # Three (not an even number): least-loaded's rotation over two idle replicas would keep an even count apart.
    documents = [f"Document {d}: " + " ".join(f"word{d}x{i}" for i in range(400)) for d in range(3)]
    asks = [(d, f"{documents[d]}\nQuestion {q}?") for q in range(4) for d in range(3)]

    def run(policy: str) -> tuple[dict[int, set[str]], float]:
        sims = stack.sim(2, "--zero-latency", "--enable-prefix-caching")
        gw = stack.gateway(sims, f"picker: {{policy: {policy}}}\n")
        homes: dict[int, set[str]] = {}
        for d, text in asks:
            r = httpx.post(gw.url + "/v1/completions", json={"model": "sim-model", "prompt": text, "max_tokens": 2},
                           timeout=30)
            assert r.status_code == 200, r.text
            homes.setdefault(d, set()).add(r.headers["x-holdback-replica"])
        hits, queries = map(sum, zip(*(_hits(url) for url in sims)))
        return homes, hits / queries

    homes, rate = run("prefix-affinity")
    assert all(len(replicas) == 1 for replicas in homes.values()), homes
    assert len(set().union(*homes.values())) == 2, "the documents are spread over both replicas"
    rotated, least_loaded_rate = run("least-loaded")
    assert any(len(replicas) == 2 for replicas in rotated.values()), rotated
    assert rate > least_loaded_rate, (rate, least_loaded_rate)
