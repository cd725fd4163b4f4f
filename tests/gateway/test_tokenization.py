"""Prompt counting: a local Hugging Face tokenizer, the simulator's, the cache, the counted fallback, and
`tokenizer: auto` (in process once a tokenizer agrees with the replica's /tokenize) against real simulators."""

import asyncio

import aiohttp
import pytest

from gateway.replicas import Replica
from gateway.settings import Admission, ConfigError, parse_config
from gateway.request_size import output_limit
from gateway.tokenization import InProcess, PromptCounter, candidates, find_tokenizer_json, load_local_tokenizer
from tests.support import poll, served

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


def test_the_output_limit_is_read_as_vllm_reads_it():
    def limit(body, path="/v1/completions", context=512, prompt=9):
        got = output_limit(body, path, default=1024, context=context, prompt_tokens=prompt)
        return got.tokens, got.param, got.sequences

    chat = "/v1/chat/completions"
    assert limit({}) == (16, None, 1)                                 # completions: vLLM's default of 16
    assert limit({"max_completion_tokens": 300}) == (16, None, 1)    # /v1/completions reads only max_tokens
    assert limit({"max_tokens": 300}) == (300, "max_tokens", 1)
    assert limit({}, chat) == (503, None, 1)                          # chat: to the end of the context
    assert limit({}, chat, context=None) == (1024, None, 1)          # context unknown: maxNewTokensDefault
    assert limit({"max_tokens": 50, "max_completion_tokens": 20}, chat) == (20, "max_completion_tokens", 1)
    assert limit({"max_tokens": 50, "max_completion_tokens": None}, chat) == (50, "max_tokens", 1)
    assert limit({"max_tokens": 7, "n": 2}) == (7, "max_tokens", 2)
    assert limit({"n": 2, "best_of": 3}, chat) == (503, None, 3)     # best_of when larger
    assert limit({"max_tokens": "7", "n": True}) == (16, None, 1)    # what vLLM refuses, it answers itself
    assert limit({"input": "x", "n": 2}, "/v1/embeddings") == (0, None, 1)


def test_a_chat_without_a_limit_counts_the_rest_of_the_replicas_context():
    counter = PromptCounter(Admission(tokenizer="simulator"))
    body = {"messages": [{"role": "user", "content": "a a a"}], "n": 2}
    got = count(counter, body, "/v1/chat/completions", Replica("http://r", max_model_len=512))
    assert (got.max_new_tokens, got.limit_param, got.sequences) == (512 - got.prompt_tokens, None, 2)
    completion = count(counter, {"prompt": "a a a", "max_completion_tokens": 99}, "/v1/completions",
                       Replica("http://r", max_model_len=512))
    assert (completion.max_new_tokens, completion.limit_param) == (16, None)


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


def test_the_tokenizer_json_is_looked_up_at_the_models_root_not_its_served_name(tmp_path):
    path = tokenizer_file(tmp_path)  # vLLM --served-model-name tiny, weights (and tokenizer) in tmp_path
    replica = Replica("http://r", model="tiny", model_root=str(tmp_path))
    assert [c.path for c in candidates(Admission(), replica)] == [path]


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


def test_what_only_the_replica_renders_reaches_its_tokenize():
    """Tools, another template or its arguments and special tokens change the prompt vLLM renders: they go to
    /tokenize with the prompt (a completion's add_special_tokens too), so a tool-heavy chat is not under-counted."""
    from aiohttp import web

    seen: list[dict] = []

    async def tokenize(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response({"count": 42, "max_model_len": 4096, "tokens": []})

    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools,
            "chat_template_kwargs": {"enable_thinking": False}, "add_special_tokens": True,
            "add_generation_prompt": True}

    async def main():
        app = web.Application()
        app.router.add_post("/tokenize", tokenize)
        counter = PromptCounter(Admission(tokenizer="replica"))
        async with served(app) as url, aiohttp.ClientSession() as session:
            return [await counter.count(chat, "/v1/chat/completions", session, Replica(url, healthy=True)),
                    await counter.count({"model": "m", "prompt": "hi", "add_special_tokens": False},
                                        "/v1/completions", session, Replica(url, healthy=True))]

    counted = asyncio.run(main())
    assert [c.prompt_tokens for c in counted] == [42, 42] and all(c.exact for c in counted)
    assert seen[0] == {k: chat[k] for k in ("model", "messages", "tools", "chat_template_kwargs",
                                            "add_special_tokens", "add_generation_prompt")}
    assert seen[1] == {"model": "m", "prompt": "hi", "add_special_tokens": False}


def test_auto_leaves_a_chat_with_tools_to_the_replica_once_it_counts_in_process(stack):
    [sim] = stack.sim(1)
    replica = identified(sim)
    counter = PromptCounter(Admission(tokenizer="auto"))
    chat = [{"role": "user", "content": "How many?"}]

    async def main():
        async with aiohttp.ClientSession() as session:
            await counter.count({"prompt": "warm up"}, "/v1/completions", session, replica)
            await asyncio.to_thread(poll, lambda: counter.state()["replicas"].get(sim), 30,
                                    "the tokenizer check to finish")
            await counter.count({"messages": chat}, "/v1/chat/completions", session, replica)
            in_process = counter.sources["simulator"]
            await counter.count({"messages": chat, "tools": [{"type": "function", "function": {"name": "f"}}]},
                                "/v1/chat/completions", session, replica)
            return in_process

    in_process = asyncio.run(main())
    assert in_process == 1 and counter.sources["simulator"] == 1  # the plain chat only
    assert counter.sources["replica"] == 2  # the warm-up, and the chat with tools


@pytest.mark.unit
def test_a_chat_with_an_image_or_audio_part_is_the_replicas_to_count():
    from gateway.tokenization import has_media

    text = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}]}]
    image = [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                          {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]
    assert not has_media(text) and not has_media([{"role": "user", "content": "hi"}]) and has_media(image)
