"""Prompt counting: a local Hugging Face tokenizer, the simulator's, the cache, the counted fallback, and
`tokenizer: auto` (in process once a tokenizer agrees with the replica's /tokenize) against real simulators."""

import asyncio

import aiohttp
import pytest

from gateway.config import Admission, ConfigError, parse_config
from gateway.replicas import Replica
from gateway.tokenization import InProcess, PromptCounter, find_tokenizer_json, load_local_tokenizer
from tests.support import poll

tokenizers = pytest.importorskip("tokenizers", reason="admission.tokenizer `local` needs the tokenizers package "
                                 "(pip install '.[local-tokenizer]')")


def tokenizer_file(tmp_path):
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "again": 3}
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def count(counter, body, path="/v1/completions", url=None):
    async def go():
        async with aiohttp.ClientSession() as session:
            return await counter.count(body, path, session, url)
    return asyncio.run(go())


def test_local_tokenizer_counts_completion_prompts_in_process(tmp_path):
    cfg = Admission(tokenizer="local", tokenizerFile=tokenizer_file(tmp_path))
    counter = PromptCounter(cfg)
    assert count(counter, {"prompt": "hello world, again", "max_tokens": 7}).prompt_tokens == 4  # "," is [UNK]
    assert count(counter, {"prompt": ["hello", "world again"]}).prompt_tokens == 3
    assert count(counter, {"prompt": [1, 2, 3]}).prompt_tokens == 3
    assert counter.fallbacks == 0


def test_local_tokenizer_config_errors_say_what_to_change(tmp_path):
    with pytest.raises(ConfigError, match="tokenizerFile"):
        parse_config("admission: {tokenizer: local}\n", "t")
    load_local_tokenizer.cache_clear()
    with pytest.raises(ConfigError, match="not a readable tokenizer.json"):
        load_local_tokenizer(str(tmp_path / "missing.json"))


def test_without_a_tokenizer_the_estimate_is_used_and_counted():
    fallbacks = []
    counter = PromptCounter(Admission(tokenizer="replica", tokenizeTimeoutMs=200), lambda: fallbacks.append(1))
    got = count(counter, {"messages": [{"role": "user", "content": "x" * 40}]}, "/v1/chat/completions",
                Replica("http://127.0.0.1:9"))  # nothing listens there
    assert (got.prompt_tokens, got.max_new_tokens, got.exact) == (10, 1024, False)
    assert counter.fallbacks == 1 and fallbacks == [1]
    assert count(counter, {"input": "abcd"}, "/v1/embeddings").max_new_tokens == 0


def test_simulator_tokenizer_matches_the_simulator_and_counts_are_cached():
    counter = PromptCounter(Admission(tokenizer="simulator", tokenCacheSize=1))
    assert count(counter, {"prompt": "a a a a"}).prompt_tokens == 4
    assert count(counter, {"prompt": "a a a a"}).exact
    assert len(counter._cache) == 1
    count(counter, {"prompt": "b b"})
    assert len(counter._cache) == 1  # bounded by tokenCacheSize


def test_auto_is_the_default_and_the_check_interval_must_not_be_negative():
    assert Admission().tokenizer == "auto" and Admission().tokenizerCheckEvery == 1000
    with pytest.raises(ConfigError, match="tokenizerCheckEvery"):
        parse_config("admission: {tokenizerCheckEvery: -1}\n", "t")


def test_the_models_tokenizer_json_is_found_in_its_directory_or_the_hub_cache(tmp_path, monkeypatch):
    model_dir = tmp_path / "llama"
    model_dir.mkdir()
    (model_dir / "tokenizer.json").write_text("{}")
    assert find_tokenizer_json(str(model_dir)) == str(model_dir / "tokenizer.json")
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    assert find_tokenizer_json("org/model") is None
    repo = hub / "models--org--model"
    for rev in ("old", "pinned"):
        (repo / "snapshots" / rev).mkdir(parents=True)
        (repo / "snapshots" / rev / "tokenizer.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("pinned\n")
    assert find_tokenizer_json("org/model") == str(repo / "snapshots" / "pinned" / "tokenizer.json")
    (repo / "refs" / "main").write_text("gone\n")  # refs/main names a snapshot without one: the newest that has one
    assert find_tokenizer_json("org/model") in {str(repo / "snapshots" / r / "tokenizer.json") for r in ("old", "pinned")}
    assert find_tokenizer_json(None) is None and find_tokenizer_json("no-slash-model") is None


def identified(url: str) -> Replica:
    """A replica as the pool knows it once /v1/models and /version have answered (holdback sim)."""
    replica = Replica(url, healthy=True)
    replica.model, replica.runtime_version = "sim-model", "model_sim"
    return replica


def test_auto_counts_in_process_once_the_simulator_tokenizer_agrees_with_the_replica(stack, tmp_path):
    [sim] = stack.sim(1)
    replica = identified(sim)
    # A tokenizer.json that disagrees with the replica (word level: punctuation is [UNK], one token per word)
    # is tried first and refused; the simulator's own tokenizer agrees and is used, chat included.
    counter = PromptCounter(Admission(tokenizer="auto", tokenizerFile=tokenizer_file(tmp_path)))

    async def main():
        async with aiohttp.ClientSession() as session:
            first = await counter.count({"prompt": "Hello, world!"}, "/v1/completions", session, replica)
            state = await asyncio.to_thread(poll, lambda: counter.state()["replicas"].get(sim), 30,
                                            "the tokenizer check to finish")
            assert state == {"model": "sim-model", "in_process": "simulator", "chat_in_process": True}
            texts = ["  two  spaces, then\ttab", "naïve — 東京 🙂", "x" * 40]
            mine = [await counter.count({"prompt": t}, "/v1/completions", session, replica) for t in texts]
            chat = [{"role": "user", "content": "How many?"}, {"role": "assistant", "content": "Three, so"}]
            resumed = {"messages": chat, "continue_final_message": True, "add_generation_prompt": False}
            for doc in ({"messages": chat}, resumed):  # a resumed answer continues its message: fewer tokens
                mine.append(await counter.count(doc, "/v1/chat/completions", session, replica))
            theirs = []
            for doc in [{"prompt": t} for t in texts] + [{"messages": chat}, resumed]:
                async with session.post(sim + "/tokenize", json=doc) as resp:
                    theirs.append((await resp.json())["count"])
            return first, mine, theirs

    first, mine, theirs = asyncio.run(main())
    assert first.exact and first.prompt_tokens == 4  # asked the replica while the check ran
    assert [c.prompt_tokens for c in mine] == theirs and all(c.exact for c in mine)
    assert theirs[-1] < theirs[-2]
    assert counter.sources["simulator"] == 5 and counter.sources["replica"] == 1
    assert counter.fallbacks == 0


def test_a_spot_check_that_disagrees_sends_prompts_back_to_the_replica(stack):
    [sim] = stack.sim(1)
    replica = identified(sim)
    counter = PromptCounter(Admission(tokenizer="auto", tokenizerCheckEvery=2))
    # Pretend a wrong tokenizer had passed the probes: one token per prompt.
    counter._verified[counter._identity(replica)] = InProcess("tokenizer.json", lambda prompt, chat, options: 1,
                                                                 chat=False)

    async def main():
        async with aiohttp.ClientSession() as session:
            counts = [await counter.count({"prompt": f"prompt number {i}, three words"}, "/v1/completions",
                                          session, replica) for i in range(2)]
            await asyncio.to_thread(poll, lambda: counter.disagreements, 30, "the spot check to disagree")
            counts.append(await counter.count({"prompt": "and now it is exact"}, "/v1/completions",
                                              session, replica))
            return counts

    counts = asyncio.run(main())
    assert [c.prompt_tokens for c in counts] == [1, 1, 5]
    assert counter.state()["replicas"][sim]["in_process"] is None and counter.sources["replica"] == 1


def test_a_check_the_replica_does_not_answer_is_postponed_not_decided():
    counter = PromptCounter(Admission(tokenizer="auto", tokenizeTimeoutMs=200))
    replica = identified("http://127.0.0.1:9")  # nothing listens there

    async def main():
        async with aiohttp.ClientSession() as session:
            got = await counter.count({"prompt": "x" * 8}, "/v1/completions", session, replica)
            await asyncio.gather(*counter._verifying.values())
            again = await counter.count({"prompt": "y" * 8}, "/v1/completions", session, replica)
            return got, again, dict(counter._verifying)

    got, again, verifying = asyncio.run(main())
    assert (got.prompt_tokens, got.exact, again.exact) == (2, False, False)  # the counted estimate
    assert counter.state()["replicas"] == {}  # no verdict: the simulator's tokenizer is neither used nor refused
    assert counter._identity(replica) in counter._retry_at and verifying == {}  # not re-checked before the retry
