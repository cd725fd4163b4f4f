"""The OpenAI and vLLM HTTP surface, called with the official openai client where it fits."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from model_sim.faults import FaultSettings
from model_sim.generation import output_text
from tests.model_sim.conftest import sim_config


def client(sim) -> openai.OpenAI:
    return openai.OpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0)


def test_chat_and_completions_streaming_and_not_with_usage(sim):
    oai = client(sim)
    chat = oai.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "Hello there"}],
                                       max_tokens=7)
    assert chat.choices[0].message.content == output_text(0, 7)
    assert chat.choices[0].finish_reason == "length"
    count = sim.http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hello there"}]}).json()["count"]
    assert chat.usage.prompt_tokens == count and chat.usage.completion_tokens == 7

    chunks = list(oai.chat.completions.create(
        model="sim-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == output_text(0, 5)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 5 and not chunks[-1].choices

    done = oai.completions.create(model="sim-model", prompt="The quick brown fox", max_tokens=3)
    assert done.choices[0].text == output_text(0, 3)
    assert done.usage.prompt_tokens == sim.http.post("/tokenize", json={"prompt": "The quick brown fox"}).json()["count"]

    streamed = list(oai.completions.create(model="sim-model", prompt=[5, 6, 7], max_tokens=4, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == output_text(0, 4)
    assert streamed[-1].choices[0].finish_reason == "length"


def test_a_stream_interval_sends_the_first_token_at_once_then_whole_intervals(sim):
    body = {"prompt": "count", "max_tokens": 10, "stream": True, "stream_interval": 4,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with sim.http.stream("POST", "/v1/completions", json=body) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines()
                  if line.startswith("data: {") and '"choices":[{' in line.replace(" ", "")]
    counts = [e["usage"]["completion_tokens"] for e in events]
    per_event = [b - a for a, b in zip([0] + counts, counts)]
    assert "".join(e["choices"][0]["text"] for e in events) == output_text(0, 10)
    assert per_event[0] == 1 and all(n >= 4 for n in per_event[1:-1]) and sum(per_event) == 10, per_event
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    bad = sim.http.post("/v1/completions", json={**body, "stream_interval": 0})
    _assert_envelope(bad, 400, "stream_interval", "at least 1")


def test_without_max_tokens_completions_get_16_and_chat_the_rest_of_the_context(start_sim):
    sim = start_sim(max_model_len=256)
    assert client(sim).completions.create(model="sim-model", prompt="x").usage.completion_tokens == 16
    chat = client(sim).chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "x"}])
    assert chat.usage.completion_tokens == 256 - chat.usage.prompt_tokens
    # On /v1/completions only max_tokens counts, and an explicit null is 16 too (vLLM 0.32, tests/real_vllm/surface.py).
    done = sim.http.post("/v1/completions", json={"prompt": "x", "max_completion_tokens": 3}).json()
    assert done["usage"]["completion_tokens"] == 16
    unset = sim.http.post("/v1/completions", json={"prompt": "x", "max_tokens": None}).json()
    assert unset["usage"]["completion_tokens"] == 16
    capped = start_sim(max_model_len=256, default_max_tokens=5)  # a model whose generation config sets one
    assert client(capped).chat.completions.create(
        model="sim-model", messages=[{"role": "user", "content": "x"}]).usage.completion_tokens == 5


def test_random_output_length_is_seeded_and_capped_unless_ignore_eos(start_sim):
    sim = start_sim(output_length_mode="random", seed=7)
    oai = client(sim)
    lengths = [oai.completions.create(model="sim-model", prompt="a b c", max_tokens=50).usage.completion_tokens
               for _ in range(12)]
    assert all(1 <= n <= 50 for n in lengths) and len(set(lengths)) > 1
    forced = oai.completions.create(model="sim-model", prompt="a", max_tokens=50, extra_body={"ignore_eos": True})
    assert forced.usage.completion_tokens == 50 and forced.choices[0].finish_reason == "length"
    again = start_sim(output_length_mode="random", seed=7)
    replay = [client(again).completions.create(model="sim-model", prompt="a b c", max_tokens=50).usage.completion_tokens
              for _ in range(12)]
    assert replay == lengths


def test_embeddings_models_tokenize_detokenize(sim):
    oai = client(sim)
    emb = oai.embeddings.create(model="sim-model", input=["one two", "three"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) == 384
    assert abs(sum(v * v for v in emb.data[0].embedding) - 1.0) < 1e-6
    again = oai.embeddings.create(model="sim-model", input="one two")
    assert again.data[0].embedding == emb.data[0].embedding
    assert emb.usage.prompt_tokens == 3
    assert [m.id for m in oai.models.list()] == ["sim-model"]

    assert sim.http.post("/v1/embeddings", json={"model": "gpt-9", "input": "x"}).status_code == 404

    text = "Héllo, wörld! Tokenizers are deterministic:   12345678 ok."
    tok = sim.http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 8192
    assert "".join(tok["token_strs"]) == text
    assert sim.http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == text
    assert sim.http.get("/health").status_code == 200


def test_every_response_names_the_replica_and_echoes_the_request_id(sim):
    for r in (sim.http.get("/health"), sim.http.get("/metrics"), sim.http.get("/nope"),
              sim.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                            headers={"x-request-id": "row-42"})):
        assert r.headers["x-sim-replica"] == "0"
    assert r.headers["x-request-id"] == "row-42"


def _assert_envelope(r: httpx.Response, status: int, param: str | None, phrase: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["code"] == status
    assert phrase in err["message"], err["message"]


def test_bad_input_answers_400_with_a_message_that_says_what_to_change(start_sim):
    sim = start_sim(num_blocks=8, max_model_len=4096)
    post = sim.http.post
    _assert_envelope(post("/v1/chat/completions", json={"model": "sim-model"}), 400, "messages", "\"messages\" is required")
    _assert_envelope(post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]}),
                     400, "messages", "role must be one of")
    _assert_envelope(post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404, "model",
                     "Valid aliases: sim-model")
    _assert_envelope(post("/v1/completions", json={"prompt": "x", "max_tokens": 5000}), 400, "max_tokens",
                     "max_tokens=5000 cannot be greater than max_model_len=4096")
    # Fits the context but never the 8 x 16-token KV cache.
    _assert_envelope(post("/v1/completions", json={"prompt": "x", "max_tokens": 200}), 400, "max_tokens",
                     "could never run")
    _assert_envelope(post("/v1/completions", json={"prompt": "x", "max_tokens": 0}), 400, "max_tokens",
                     "max_tokens must be at least 1, got 0.")
    _assert_envelope(post("/v1/completions", json={"prompt": "x", "n": 0}), 400, None, "n must be at least 1")
    _assert_envelope(post("/v1/completions", json={"prompt": "x", "min_tokens": 9, "max_tokens": 4}), 400, None,
                     "min_tokens must be less than or equal to max_tokens=4")
    # A field of the wrong type is answered as vLLM's request model answers it (tests/real_vllm/surface.py).
    bad_type = post("/v1/completions", json={"prompt": "x", "priority": "high"})
    _assert_envelope(bad_type, 400, "body.priority", "Input should be a valid integer")
    assert bad_type.json()["error"]["type"] == "Bad Request"
    # Sampling fields the simulator ignores are still typed as vLLM types them.
    _assert_envelope(post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                        "temperature": "hot"}), 400, "body.temperature",
                     "Input should be a valid number")
    _assert_envelope(post("/v1/completions", json={"prompt": "x", "top_k": 2.5}), 400, "body.top_k",
                     "fractional part")
    for lax in ({"temperature": "0.5"}, {"top_p": 1}, {"top_k": "3"}, {"seed": None}):
        assert post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **lax}).status_code == 200, lax
    _assert_envelope(post("/v1/completions", json={"prompt": "x", "stream_options": {"include_usage": True}}),
                     400, "stream_options", "only be defined when `stream=True`")
    _assert_envelope(post("/v1/completions", json={}), 400, "prompt", "\"prompt\" is required")
    _assert_envelope(post("/v1/completions", content=b"{not json"), 400, None, "not valid JSON")
    _assert_envelope(post("/v1/embeddings", json={"input": ""}), 400, "input", "empty")
    _assert_envelope(post("/detokenize", json={"tokens": [-1]}), 400, "tokens", "non-negative")
    nothing = sim.http.get("/v1/nothing")
    assert nothing.status_code == 404 and nothing.json() == {"detail": "Not Found"}

    with pytest.raises(openai.BadRequestError) as info:
        client(sim).chat.completions.create(model="sim-model", messages=[], max_tokens=1)
    assert "messages" in str(info.value)
    state = sim.state()
    assert state["running"] == 0 and state["waiting"] == 0 and state["kv"]["used"] == 0


def test_faults_at_full_rate_runtime_changes_and_forced_header(start_sim):
    sim = start_sim(faults=FaultSettings(rate_429=1.0))
    body = {"prompt": "x", "max_tokens": 2}
    for _ in range(5):
        r = sim.http.post("/v1/completions", json=body)
        _assert_envelope(r, 429, None, "Injected fault")
        assert r.headers["retry-after"] == "1"
    with pytest.raises(openai.RateLimitError):
        client(sim).chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "x"}])

    r = sim.http.post("/admin/faults", json={"rate_429": 0, "rate_503": 1.0})
    assert r.status_code == 200 and r.json()["rate_503"] == 1.0
    for _ in range(3):
        _assert_envelope(sim.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}),
                         503, None, "Injected fault")
    sim.http.post("/admin/faults", json={"rate_503": 0.0, "rate_500": 1.0})
    _assert_envelope(sim.http.post("/v1/embeddings", json={"input": "x"}), 500, None, "Injected fault")
    sim.http.post("/admin/faults", json={"rate_500": 0.0})
    assert sim.http.post("/v1/completions", json=body).status_code == 200

    for status in (500, 503, 429, 418):
        r = sim.http.post("/v1/completions", json=body, headers={"x-sim-force-error": str(status)})
        assert r.status_code == status and r.json()["error"]["code"] == status
    _assert_envelope(sim.http.post("/v1/completions", json=body, headers={"x-sim-force-error": "ok"}),
                     400, "x-sim-force-error", "from 400 to 599")

    _assert_envelope(sim.http.post("/admin/faults", json={"rate_429": 2}), 400, None, "between 0 and 1")
    _assert_envelope(sim.http.post("/admin/faults", json={"rate_429": 0.6, "rate_500": 0.6}), 400, None, "at most 1")
    _assert_envelope(sim.http.post("/admin/faults", json={"rate_404": 1}), 400, None, "unknown fault setting")
    faults = sim.http.get("/admin/faults").json()
    assert faults["injected"]["429"] >= 6 and faults["injected"]["503"] >= 4

    sim.http.post("/admin/faults", json={"delay_ms": 300})
    t0 = time.monotonic()
    assert sim.http.post("/v1/completions", json=body).status_code == 200
    assert time.monotonic() - t0 >= 0.3
    assert sim.http.get("/health").status_code == 200  # faults apply to inference routes only


def test_metrics_exposition_uses_vllm_names_and_model_label(sim):
    sim.http.post("/v1/completions", json={"prompt": "a b c d", "max_tokens": 3})
    text = sim.http.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:e2e_request_latency_seconds_count",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert f'{name}{{engine="0",' in text and 'model_name="sim-model"' in text, name
    m = sim.metrics()
    assert m["vllm:prompt_tokens_total"] == 4 and m["vllm:generation_tokens_total"] == 3
    assert m["vllm:time_to_first_token_seconds_count"] == 1 and m["vllm:e2e_request_latency_seconds_count"] == 1
    assert m["vllm:request_prompt_tokens_sum"] == 4 and m["vllm:request_params_n_count"] == 1
    assert "vllm:gpu_cache_usage_perc" not in text, "vLLM dropped the legacy name"
    assert m["vllm:inter_token_latency_seconds_count"] == 2
    assert json.loads(sim.http.get("/admin/state").text)["generation_tokens"] == 3


def test_metrics_slash_answers_name_filters_with_those_series_alone_as_vllms_mount_does(sim):
    """vLLM's GET /metrics answers everything whatever the query; its /metrics/ mount (prometheus_client's app)
    answers `name[]=` with those series alone, which is what the gateway's scrape asks for."""
    from gateway.vllm_metrics import FILTERED_METRICS, GAUGES, METRICS_QUERY, parse_vllm_metrics

    sim.http.post("/v1/completions", json={"prompt": "a b c d", "max_tokens": 3})
    full = sim.http.get("/metrics").text
    one = sim.http.get("/metrics/", params=[("name[]", "vllm:num_requests_running")]).text
    assert {line.split("{")[0] for line in one.splitlines() if line.startswith("vllm:")} == \
        {"vllm:num_requests_running"}
    assert len(sim.http.get("/metrics" + METRICS_QUERY).text) > len(full) // 2  # the route ignores the query
    scraped = sim.http.get(FILTERED_METRICS).text
    names = {line.split("{")[0].split(" ")[0] for line in scraped.splitlines() if line.startswith("vllm:")}
    assert names == {name for name in (*GAUGES, "vllm:cache_config_info") if name in full}
    assert parse_vllm_metrics(scraped) == parse_vllm_metrics(full)  # everything the gateway reads, in a tenth
    assert len(scraped) * 10 < len(full)


def test_return_token_ids_gives_the_outputs_and_the_prompts_ids_as_vllm_does(sim):
    """What the workers' resume by token ids reads: each choice's (and chunk's) output ids, the prompt's once."""
    from holdback.sim_tokenizer import Tokenizer

    post = sim.http.post
    prompt_ids = post("/tokenize", json={"prompt": "The quick brown fox"}).json()["tokens"]
    whole = post("/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 5,
                                          "return_token_ids": True}).json()["choices"][0]
    assert whole["prompt_token_ids"] == prompt_ids and len(whole["token_ids"]) == 5
    assert Tokenizer().decode(whole["token_ids"]) == whole["text"]
    plain = post("/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 5}).json()["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None
    events = [json.loads(line[6:]) for line in post("/v1/completions", json={
        "prompt": "The quick brown fox", "max_tokens": 5, "return_token_ids": True, "stream": True}).text.splitlines()
        if line.startswith("data: {")]
    assert [e["choices"][0]["prompt_token_ids"] for e in events] == [prompt_ids] + [None] * 4
    assert [i for e in events for i in e["choices"][0]["token_ids"]] == whole["token_ids"]
    chat = post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                              "return_token_ids": True}).json()
    assert len(chat["choices"][0]["token_ids"]) == 3 and chat["prompt_token_ids"]
