"""Continuing a request and scoping the prefix cache: `continue_final_message` / `add_generation_prompt`,
a completions prompt that ends with the model's own text, `cache_salt`, and `cached_tokens` in usage.
"""

from __future__ import annotations

import json

import pytest

from model_sim.generation import WORDS, continuation_offset, output_text
from holdback.sim_tokenizer import render_chat
from tests.model_sim.test_engine_http import prompt_of, sse_events

QUESTION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]


@pytest.mark.parametrize("text, expected", [
    ("", 0),
    ("Tell me", 0),
    ("Tell me" + output_text(0, 1), 1),
    ("Tell me" + output_text(0, 9), 9),
    (output_text(0, 9), 9),
    ("Tell me" + output_text(1, 9), 0),  # does not start at the first output word
    ("Tell me" + output_text(0, 3) + " me" + output_text(0, 2), 2),  # only the tail run counts
    ("x" + output_text(0, 2 * len(WORDS) + 5), 2 * len(WORDS) + 5),  # past one lap of the word list
])
def test_continuation_offset_counts_the_output_words_a_text_ends_with(text, expected):
    assert continuation_offset(text) == expected


def test_chat_template_flags_follow_vllm():
    messages = QUESTION + [{"role": "assistant", "content": "Once"}]
    assert render_chat(QUESTION).endswith("<|user|>\nTell me a story.\n<|assistant|>\n")
    assert render_chat(QUESTION, add_generation_prompt=False).endswith("<|user|>\nTell me a story.\n")
    assert render_chat(messages, add_generation_prompt=False, continue_final_message=True).endswith(
        "<|assistant|>\nOnce")


def test_chat_continue_final_message_writes_on_where_the_answer_stopped(sim):
    whole = sim.http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 12}).json()
    text = whole["choices"][0]["message"]["content"]
    assert text == output_text(0, 12)
    partial = output_text(0, 5)
    resumed = sim.http.post("/v1/chat/completions", json={
        "messages": QUESTION + [{"role": "assistant", "content": partial}], "max_tokens": 7,
        "continue_final_message": True, "add_generation_prompt": False}).json()
    assert partial + resumed["choices"][0]["message"]["content"] == text
    assert resumed["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"] == "length"


def test_chat_with_both_flags_is_refused_with_the_field_to_change(sim):
    r = sim.http.post("/v1/chat/completions", json={
        "messages": QUESTION, "continue_final_message": True, "add_generation_prompt": True})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "continue_final_message" and "add_generation_prompt" in err["message"]


def test_a_new_chat_turn_starts_the_answer_afresh(sim):
    """Without continue_final_message an assistant message is history: the answer starts at word 0."""
    body = {"messages": QUESTION + [{"role": "assistant", "content": output_text(0, 4)},
                                    {"role": "user", "content": "More."}], "max_tokens": 3}
    assert sim.http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"] == \
        output_text(0, 3)


def test_completions_prompt_plus_text_so_far_continues_the_text(sim):
    prompt = "Once upon a time"
    whole = sim.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 10}).json()
    text = whole["choices"][0]["text"]
    streamed = []
    with sim.http.stream("POST", "/v1/completions", json={"prompt": prompt + text[:len(output_text(0, 4))],
                                                          "max_tokens": 6, "stream": True}) as r:
        streamed = [e["choices"][0]["text"] for e in sse_events(r) if e["choices"]]
    assert output_text(0, 4) + "".join(streamed) == text


def test_continuous_usage_stats_put_the_running_usage_on_every_chunk(sim):
    body = {"prompt": prompt_of(10), "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with sim.http.stream("POST", "/v1/completions", json=body) as r:
        events = list(sse_events(r))
    token_chunks = [e for e in events if e["choices"]]
    assert [e["usage"]["completion_tokens"] for e in token_chunks] == [1, 2, 3, 4]
    assert all(e["usage"]["prompt_tokens"] == 10 for e in token_chunks)
    assert events[-1]["usage"]["completion_tokens"] == 4 and not events[-1]["choices"]


def _cached(sim, prompt: str, salt: str | None, stream: bool = False) -> int:
    body: dict = {"prompt": prompt, "max_tokens": 2}
    if salt is not None:
        body["cache_salt"] = salt
    if not stream:
        r = sim.http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    body.update(stream=True, stream_options={"include_usage": True})
    with sim.http.stream("POST", "/v1/completions", json=body) as r:
        return list(sse_events(r))[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cache_salt_scopes_prefix_hits_and_usage_reports_them(start_sim):
    sim = start_sim(enable_prefix_caching=True, block_size=16, enable_prompt_tokens_details=True)
    prompt = prompt_of(70)
    assert _cached(sim, prompt, "tenant-a") == 0
    assert _cached(sim, prompt, "tenant-a") == 64, "the same salt hits every full block"
    assert _cached(sim, prompt, "tenant-a", stream=True) == 64
    assert _cached(sim, prompt, "tenant-b") == 0, "another salt never sees tenant a's blocks"
    assert _cached(sim, prompt, None) == 0, "no salt is a scope of its own"
    assert _cached(sim, prompt, None) == 64


def test_cache_salt_must_be_a_non_empty_string(sim):
    for bad in ("", 7):
        r = sim.http.post("/v1/completions", content=json.dumps({"prompt": "x", "cache_salt": bad}),
                          headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_an_offload_tier_serves_a_prefix_the_gpu_cache_has_overwritten_and_metrics_count_it(start_sim):
    # 8 GPU blocks of 16 tokens: a second, 119-token prompt overwrites the first one's blocks, but the tier
    # (vLLM's CPU offloading) still holds them, so the repeat is loaded back, and usage says so.
    sim = start_sim(enable_prefix_caching=True, block_size=16, num_blocks=8, offload_blocks=64,
                    enable_prompt_tokens_details=True)
    first, other = prompt_of(70), "x " + prompt_of(118)  # other: all 8 blocks
    assert _cached(sim, first, "tenant-a") == 0
    assert _cached(sim, other, "tenant-a") == 0
    assert _cached(sim, first, "tenant-a") == 64
    assert _cached(sim, first, "tenant-b") == 0, "the tier keeps the salt's scope"
    metrics = sim.metrics()
    assert metrics["vllm:external_prefix_cache_hits_total"] == 64
    assert metrics["vllm:prefix_cache_hits_total"] == 0
    state = sim.state()
    assert state["offload_hits"] == 64 and state["kv"]["offload"]["num_blocks"] == 64
