"""Prompt counting: a local Hugging Face tokenizer, the simulator's, the cache, and the counted fallback."""

import asyncio

import aiohttp
import pytest

from gateway.config import Admission, ConfigError, parse_config
from gateway.tokenization import PromptCounter, load_local_tokenizer

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
                "http://127.0.0.1:9")  # nothing listens there
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
