"""The simulator answers as vLLM 0.32 does: against the bytes real vLLM sent (tests/fixtures/vllm/) and through
the surface probe the lead diffs against a live server (tests/real_vllm/surface.py).
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from model_sim.config import Runner
from model_sim.request_queue import SchedulingPolicy
from tests.model_sim.conftest import sim_config, slow
from tests.model_sim.test_engine_http import prompt_of, wait_until
from tests.real_vllm import surface

FIXTURES = Path(__file__).parent.parent / "fixtures" / "vllm"
# As the real-engine tier serves its model: `tiny`, a 512-token context, prefix caching on.
AS_THE_TIER = dict(model="tiny", max_model_len=512, runner=Runner.GENERATE, enable_prefix_caching=True,
                   block_size=128, num_blocks=16384)


def tiny(start_sim, **overrides):
    return start_sim(sim_config(**{**AS_THE_TIER, **overrides}))


def test_the_probe_of_the_simulator_agrees_with_the_bytes_vllm_sent(start_sim):
    sim = tiny(start_sim, api_key="secret")
    got = surface.probe(sim.url, "tiny", api_key="secret")
    facts = {name: r["fact"] for name, r in got.items() if "fact" in r}
    assert facts and all(all(f.values()) for f in facts.values()), facts
    # The streams' framing and every event's key set and types are those of vLLM's own streams.
    assert got["chat_stream"]["stream"] == surface.stream_record((FIXTURES / "chat_stream.sse").read_text())
    assert got["completion_stream"]["stream"] == surface.stream_record(
        (FIXTURES / "completion_stream.sse").read_text())
    errors = json.loads((FIXTURES / "errors.json").read_text())
    for case, fixture in (("unknown_model", "unknown_model_404"), ("prompt_over_context", "prompt_over_context_400"),
                          ("max_tokens_over_context", "max_tokens_over_context_400"),
                          ("embeddings_on_generation_server", "embeddings_on_generation_server_404")):
        assert got[case]["body"] == surface.shape(errors[fixture]), case
    assert got["unknown_model"]["status"] == 404 and got["embeddings_on_generation_server"]["detail"] == "Not Found"
    assert got["no_api_key"] == {"status": 401, "body": {"error": "str"}, "error": {"message": "Unauthorized"}}
    # Every series vLLM's /metrics had, with the same label names.
    vllm_series = surface.metrics_record((FIXTURES / "metrics.prom").read_text())
    assert {n: got["metrics"]["series"].get(n) for n in vllm_series} == vllm_series
    assert "vllm:gpu_cache_usage_perc" not in got["metrics"]["series"]
    assert surface.diff(got, got) == []
    assert surface.diff(got, {**got, "chat": {**got["chat"], "status": 500}}) == ["chat.status: 200 != 500"]


def test_error_bodies_are_vllms_byte_for_byte(start_sim):
    sim = tiny(start_sim)
    errors = json.loads((FIXTURES / "errors.json").read_text())
    post = sim.http.post
    assert post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}
                ).json() == errors["unknown_model_404"]
    assert post("/v1/completions", json={"model": "tiny", "prompt": prompt_of(600)}).json() == \
        errors["prompt_over_context_400"]
    assert post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 600}).json() == \
        errors["max_tokens_over_context_400"]
    r = post("/v1/embeddings", json={"model": "tiny", "input": "x"})
    assert (r.status_code, r.json()) == (404, errors["embeddings_on_generation_server_404"])
    # A prompt that fits with a cap that does not is clamped to the context, not refused.
    clamped = post("/v1/completions", json={"prompt": prompt_of(500), "max_tokens": 100}).json()
    assert clamped["usage"]["completion_tokens"] == 12 and clamped["choices"][0]["finish_reason"] == "length"
    # A prompt of exactly the context leaves no room for a token: vLLM's SamplingParams refuses max_tokens=0.
    full = post("/v1/completions", json={"prompt": prompt_of(512)})
    assert full.status_code == 400 and full.json()["error"]["message"].startswith("max_tokens must be at least 1")
    ids = post("/v1/completions", json={"prompt": [5] * 520}).json()["error"]
    assert "contains 520 input tokens" in ids["message"], "token ids are not truncated, so the count is exact"


def test_an_engine_failure_mid_stream_is_an_error_event_then_done(start_sim):
    # Preemption off: requests that each grow to 6 blocks in a 12-block cache run out of memory mid-stream.
    sim = start_sim(timing=slow(decode_ms=5), num_blocks=12, block_size=16, max_num_seqs=8, preemption=False)
    body = {"prompt": prompt_of(20), "max_tokens": 70, "ignore_eos": True, "stream": True}
    together = threading.Barrier(4)

    def one(_: int) -> str:
        together.wait()
        return httpx.post(sim.url + "/v1/completions", json=body, timeout=60).text

    with ThreadPoolExecutor(4) as pool:
        streams = [surface.stream_record(text) for text in pool.map(one, range(4))]
    failed = [s for s in streams if "error" in s]
    vllm = surface.stream_record((FIXTURES / "chat_stream_engine_error.sse").read_text())
    assert failed and all(s["framing"] == vllm["framing"] == ["chunk", "error", "done"] for s in failed)
    assert all(s["error"] == vllm["error"] and s["shapes"]["error"] == vllm["shapes"]["error"] for s in failed)


def test_runner_chooses_what_a_replica_serves(start_sim):
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    generate = start_sim(runner=Runner.GENERATE)
    assert generate.http.post("/v1/chat/completions", json=chat).status_code == 200
    assert generate.http.post("/v1/embeddings", json={"input": "x"}).json() == {"detail": "Not Found"}
    pooling = start_sim(runner=Runner.POOLING)
    emb = pooling.http.post("/v1/embeddings", json={"input": "x"})
    assert emb.status_code == 200 and set(emb.json()) == {"id", "object", "created", "model", "data", "usage"}
    assert set(emb.json()["data"][0]) == {"index", "object", "embedding"}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", {"prompt": "x"})):
        r = pooling.http.post(path, json=body)
        assert (r.status_code, r.json()) == (404, {"detail": "Not Found"})
    assert pooling.http.post("/tokenize", json={"prompt": "x"}).status_code == 200
    both = start_sim()  # the simulator's default serves everything
    assert both.http.post("/v1/embeddings", json={"input": "x"}).status_code == 200
    assert both.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_an_api_key_guards_v1_and_leaves_the_rest_open(start_sim):
    sim = start_sim(api_key="k1")
    for method, path, body in (("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
                               ("GET", "/v1/models", None), ("POST", "/v1/embeddings", {"input": "x"}),
                               ("GET", "/v1/nothing", None)):
        for auth in (None, "Bearer k2", "Basic k1"):
            r = sim.http.request(method, path, json=body, headers={"Authorization": auth} if auth else None)
            assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"}), (path, auth)
    ok = sim.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"Authorization": "Bearer k1"})
    assert ok.status_code == 200
    for method, path, body in (("GET", "/health", None), ("GET", "/metrics", None), ("GET", "/version", None),
                               ("POST", "/tokenize", {"prompt": "x"}), ("GET", "/admin/state", None)):
        assert sim.http.request(method, path, json=body).status_code == 200, path


def test_prompt_tokens_details_only_with_the_flag(start_sim):
    body = {"prompt": prompt_of(40), "max_tokens": 2}
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}

    def usages(sim) -> tuple[dict, dict]:
        sim.http.post("/v1/completions", json=body)
        whole = sim.http.post("/v1/completions", json=body).json()["usage"]
        last = surface.sse_events(sim.http.post("/v1/completions", json=streamed).text)[-2]["usage"]
        return whole, last

    whole, last = usages(start_sim(enable_prefix_caching=True, block_size=16))
    assert whole["prompt_tokens_details"] is None and "prompt_tokens_details" not in last
    whole, last = usages(start_sim(enable_prefix_caching=True, block_size=16, enable_prompt_tokens_details=True))
    assert whole["prompt_tokens_details"] == {"cached_tokens": 32, "created_cache_tokens": None,
                                              "multimodal_tokens": None}
    assert last["prompt_tokens_details"] == {"cached_tokens": 32}


def test_n_choices_are_sequences_of_their_own(start_sim):
    sim = start_sim(timing=slow(decode_ms=20), block_size=16)
    body = {"prompt": prompt_of(40), "max_tokens": 30, "n": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    with sim.http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        state = sim.state()
        assert state["running"] == 3 and len({q["id"] for q in state["running_requests"]}) == 3
        assert all(q["num_blocks"] >= 3 for q in state["running_requests"]), "each choice holds its own KV"
        text = "\n".join(lines)
    events = [e for e in surface.sse_events(text) if isinstance(e, dict)]
    finished = sorted(c["index"] for e in events for c in e["choices"] if c["finish_reason"] == "length")
    assert finished == [0, 1, 2]
    assert events[-1]["usage"]["completion_tokens"] == 90 and events[-1]["usage"]["prompt_tokens"] == 40
    whole = sim.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                         "max_tokens": 3, "n": 2}).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1] and whole["usage"]["completion_tokens"] == 6
    assert sim.metrics()["vllm:request_params_n_sum"] == 5


def test_the_priority_header_overrides_the_body(start_sim):
    sim = start_sim(timing=slow(decode_ms=20), max_num_seqs=1, scheduling_policy=SchedulingPolicy.PRIORITY)
    holder = sim.raw_request("/v1/completions",
                             json.dumps({"prompt": "x", "max_tokens": 4000, "stream": True}).encode())
    wait_until(lambda: sim.state()["running"] == 1, what="holder running")
    sent = []
    for header in ("-7", "soon"):  # an unreadable header leaves the body's priority, as in vLLM
        sent.append(threading.Thread(target=httpx.post, args=(sim.url + "/v1/completions",),
                                     kwargs={"json": {"prompt": "y", "max_tokens": 1, "priority": 3},
                                             "headers": {"X-Vllm-Priority": header}, "timeout": 60}))
        sent[-1].start()
        wait_until(lambda: sim.state()["waiting"] == len(sent), what="request queued")
    assert [q["priority"] for q in sim.state()["waiting_requests"]] == [-7, 3]
    holder.close()
    for t in sent:
        t.join(60)


def test_the_readme_lists_every_deliberate_difference_the_probe_knows():
    readme = (Path(__file__).parent.parent.parent / "model_sim" / "README.md").read_text()
    known = readme.split("## Known differences from vLLM", 1)[1]
    listed = set(re.findall(r"^- `([a-z_]+)`:", known, flags=re.M))
    assert listed == set(surface.DELIBERATE)
