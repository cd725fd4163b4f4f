"""Scheduling behaviour seen from outside: KV growth, aborts on disconnect, preemption, prefix
sharing, priority order, and /metrics agreeing with /admin/state.

Assertions are structural (counts, orders, block ids, step counters), never wall-clock limits.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from model_sim.generation import output_text
from model_sim.request_queue import SchedulingPolicy
from model_sim.timing import TimingModel
from tests.model_sim.conftest import sim_config, slow


def wait_until(predicate, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def prompt_of(n: int, word: str = "w") -> str:
    """A prompt of exactly n tokens of the simulator's tokenizer."""
    return " ".join([word] * n)


def sse_events(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def test_blocks_grow_with_output(start_sim):
    sim = start_sim(timing=slow(decode_ms=10), block_size=16)
    body = {"prompt": prompt_of(10), "max_tokens": 60, "stream": True}
    seen = []
    with sim.http.stream("POST", "/v1/completions", json=body) as r:
        for event in sse_events(r):
            if not event["choices"]:
                continue
            state = sim.state()
            if state["running_requests"]:
                req = state["running_requests"][0]
                tokens = req["num_prompt_tokens"] + req["num_output_tokens"]
                # Between steps a request holds blocks for all its tokens but possibly the newest one.
                assert -(-(tokens - 1) // 16) <= req["num_blocks"] <= -(-tokens // 16), req
                m = sim.metrics()
                seen.append(req["num_blocks"])
                assert state["kv"]["used"] >= req["num_blocks"]
                assert abs(m["vllm:kv_cache_usage_perc"] * state["kv"]["num_blocks"] - state["kv"]["used"]) <= 5
    # 10 + 59 tokens end in 5 blocks; a loaded client may miss the first or last few observations.
    assert seen == sorted(seen) and min(seen) <= 2 and max(seen) >= 4, seen
    assert sim.state()["kv"]["used"] == 0 and sim.metrics()["vllm:kv_cache_usage_perc"] == 0


def _idle(sim) -> bool:
    m = sim.metrics()
    return (m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
            and m["vllm:kv_cache_usage_perc"] == 0)


def test_disconnect_mid_stream_frees_everything_within_one_step(start_sim):
    # One-second decode steps: an abort that waited for the step to end would show up as a step.
    sim = start_sim(timing=slow(decode_ms=1000), block_size=16)
    body = json.dumps({"prompt": prompt_of(100), "max_tokens": 500, "stream": True}).encode()
    sock = sim.raw_request("/v1/completions", body)
    buf = b""
    while buf.count(b"data: ") < 2:
        buf += sock.recv(65536)
    state = sim.state()
    assert state["running"] == 1 and state["kv"]["used"] >= 7
    steps_before = state["num_steps"]
    sock.close()
    wait_until(lambda: _idle(sim), what="running, waiting and KV usage back to 0")
    state = sim.state()
    assert state["num_steps"] - steps_before <= 1
    assert state["finished"]["abort"] == 1 and state["generation_tokens"] < 5
    m = sim.metrics()
    assert m['vllm:request_success_total{finished_reason="abort"}'] == 1


def test_disconnect_while_waiting_frees_it_streaming_or_not(start_sim):
    sim = start_sim(timing=slow(decode_ms=50), max_num_seqs=1)
    holder = sim.raw_request("/v1/completions", json.dumps({"prompt": "x", "max_tokens": 400, "stream": True}).encode())
    wait_until(lambda: sim.state()["running"] == 1, what="the first request running")
    for stream in (True, False):
        sock = sim.raw_request("/v1/completions",
                               json.dumps({"prompt": prompt_of(40), "max_tokens": 20, "stream": stream}).encode())
        wait_until(lambda: sim.metrics()["vllm:num_requests_waiting"] == 1, what="a waiting request")
        used = sim.state()["kv"]["used"]
        sock.close()
        wait_until(lambda: sim.metrics()["vllm:num_requests_waiting"] == 0, what="the waiting request gone")
        state = sim.state()
        assert state["running"] == 1 and state["kv"]["used"] <= used + 1
    assert sim.state()["finished"]["abort"] == 2
    holder.close()
    wait_until(lambda: _idle(sim), what="idle after the holder left")
    assert sim.state()["finished"] == {"stop": 0, "length": 0, "abort": 3}


def test_disconnect_of_a_running_non_streaming_request_aborts_it(start_sim):
    sim = start_sim(timing=slow(decode_ms=20))
    sock = sim.raw_request("/v1/completions", json.dumps({"prompt": prompt_of(30), "max_tokens": 1000}).encode())
    wait_until(lambda: sim.state()["generation_tokens"] >= 3, what="tokens generated")
    sock.close()
    wait_until(lambda: _idle(sim), what="idle after disconnect")
    state = sim.state()
    assert state["finished"]["abort"] == 1 and state["generation_tokens"] < 1000


def test_kv_full_run_preempts_and_still_completes_every_request(start_sim):
    # 24 blocks x 16 tokens; 12 requests that each grow to 6 blocks.
    sim = start_sim(timing=slow(decode_ms=5), num_blocks=24, block_size=16, max_num_seqs=16)
    body = {"prompt": prompt_of(20), "max_tokens": 70, "ignore_eos": True}
    together = threading.Barrier(12)

    def one(i: int) -> dict:
        together.wait()
        r = httpx.post(sim.url + "/v1/completions", json=body | {"stream": i % 2 == 0}, timeout=60)
        assert r.status_code == 200
        if i % 2 == 0:
            return {"text": "".join(e["choices"][0]["text"] for e in
                                    (json.loads(l[6:]) for l in r.text.splitlines()
                                     if l.startswith("data: {")) if e["choices"])}
        return {"text": r.json()["choices"][0]["text"]}

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(12)))
    assert all(res["text"] == output_text(0, 70) for res in results)
    m = sim.metrics()
    assert m["vllm:num_preemptions_total"] > 0
    assert m["vllm:generation_tokens_total"] == 12 * 70
    assert m['vllm:request_success_total{finished_reason="length"}'] == 12
    assert _idle(sim)
    assert sim.state()["num_preemptions"] == m["vllm:num_preemptions_total"]


def test_prefix_caching_reuses_blocks_and_never_frees_a_shared_block_early(start_sim):
    sim = start_sim(timing=slow(decode_ms=15), enable_prefix_caching=True, block_size=16)
    shared = prompt_of(64, "s")
    short = {"prompt": shared + " a", "max_tokens": 40, "stream": True}
    long = {"prompt": shared + " b", "max_tokens": 100, "stream": True}
    with sim.http.stream("POST", "/v1/completions", json=short) as ra:
        events_a = sse_events(ra)
        next(events_a)
        with httpx.Client(base_url=sim.url, timeout=30) as other, other.stream("POST", "/v1/completions",
                                                                                 json=long) as rb:
            events_b = sse_events(rb)
            next(events_b)
            state = sim.state(blocks=True)
            a, b = sorted(state["running_requests"], key=lambda r: r["max_tokens"])
            assert b["num_cached_tokens"] == 64
            assert a["block_ids"][:4] == b["block_ids"][:4]
            shared_ids = b["block_ids"][:4]
            for _ in events_a:
                pass  # a runs to its end while b keeps running
            wait_until(lambda: sim.state()["running"] == 1, what="the short request finished")
            state = sim.state(blocks=True)
            (b,) = state["running_requests"]
            assert b["block_ids"][:4] == shared_ids
            assert state["kv"]["used"] == b["num_blocks"], "shared blocks stay allocated, a's own ones are free"
            m = sim.metrics()
            assert m["vllm:prefix_cache_hits_total"] == 64
            assert m["vllm:prefix_cache_queries_total"] == state["prefix_cache_queries"] > 64
            assert "".join(e["choices"][0]["text"] for e in events_b if e["choices"])
    wait_until(lambda: _idle(sim), what="idle")
    state = sim.state()
    assert state["kv"]["cached_free"] >= 4, "finished prefixes stay cached for reuse"
    r = sim.http.post("/v1/completions", json={"prompt": shared + " c", "max_tokens": 2})
    assert r.status_code == 200
    assert sim.metrics()["vllm:prefix_cache_hits_total"] == 128


def test_priority_policy_admits_lower_values_first(start_sim):
    sim = start_sim(timing=slow(decode_ms=20), max_num_seqs=1, scheduling_policy=SchedulingPolicy.PRIORITY)
    holder = sim.raw_request("/v1/completions", json.dumps({"prompt": "x", "max_tokens": 4000, "stream": True}).encode())
    wait_until(lambda: sim.state()["running"] == 1, what="holder running")
    finished: list[int] = []
    lock = threading.Lock()

    def send(priority: int) -> None:
        r = httpx.post(sim.url + "/v1/completions", json={"prompt": "y", "max_tokens": 2, "priority": priority},
                       timeout=60)
        assert r.status_code == 200
        with lock:
            finished.append(priority)

    priorities = [5, -3, 0, 10, -3, 2]
    threads = []
    for p in priorities:
        threads.append(threading.Thread(target=send, args=(p,)))
        threads[-1].start()
        wait_until(lambda: sim.state()["waiting"] == len(threads), what="request queued")
    waiting = sim.state()["waiting_requests"]
    assert [r["priority"] for r in waiting] == sorted(priorities)
    holder.close()
    for t in threads:
        t.join(60)
    assert finished == sorted(priorities)


def test_metrics_agree_with_admin_state_under_load(start_sim):
    sim = start_sim(timing=TimingModel(step_overhead_ms=100.0, prefill_ms_per_token=0.0, decode_base_ms=0.0,
                                       decode_ms_per_seq=0.0),
                    max_num_seqs=4, num_blocks=64, enable_prefix_caching=True)
    socks = [sim.raw_request("/v1/completions", json.dumps(
        {"prompt": prompt_of(40 + i, "l"), "max_tokens": 30 + i, "stream": i % 2 == 0}).encode()) for i in range(7)]
    wait_until(lambda: sim.state()["running"] == 4 and sim.state()["waiting"] == 3, what="4 running, 3 waiting")
    checked = 0
    for _ in range(40):
        before = sim.state()
        m = sim.metrics()
        after = sim.state(blocks=True)
        if before["num_steps"] != after["num_steps"]:
            continue  # a step ended between the reads; take another snapshot
        checked += 1
        assert m["vllm:num_requests_running"] == after["running"] == len(after["running_requests"])
        assert m["vllm:num_requests_waiting"] == after["waiting"] == len(after["waiting_requests"])
        assert m["vllm:kv_cache_usage_perc"] == after["kv"]["used"] / after["kv"]["num_blocks"]
        held = {b for r in after["running_requests"] + after["waiting_requests"] for b in r["block_ids"]}
        assert after["kv"]["used"] == len(held), "every used block is held by a live request"
        assert sum(r["num_blocks"] for r in after["running_requests"]) > len(held), "prefix blocks are shared"
        assert m["vllm:num_preemptions_total"] == after["num_preemptions"]
        assert m["vllm:prefix_cache_queries_total"] == after["prefix_cache_queries"]
        assert m["vllm:prefix_cache_hits_total"] == after["prefix_cache_hits"]
        assert m["vllm:generation_tokens_total"] == after["generation_tokens"]
        assert m["vllm:prompt_tokens_total"] == after["prompt_tokens"]
        assert m["sim:aborted_computed_tokens_total"] == after["aborted_computed_tokens"]
        if checked >= 5:
            break
    assert checked >= 5
    for s in socks:
        s.close()
    wait_until(lambda: _idle(sim), what="idle after all clients left")


def test_kv_oom_fails_requests_with_an_error_and_is_counted(start_sim):
    # Preemption off: four requests that each grow to 6 blocks in a 12-block cache run out of memory.
    sim = start_sim(timing=slow(decode_ms=5), num_blocks=12, block_size=16, max_num_seqs=8, preemption=False)
    body = {"prompt": prompt_of(20), "max_tokens": 70, "ignore_eos": True}
    together = threading.Barrier(4)

    def one(i: int) -> tuple[int, str]:
        together.wait()
        if i % 2:
            r = httpx.post(sim.url + "/v1/completions", json=body, timeout=60)
            return r.status_code, r.text
        with httpx.stream("POST", sim.url + "/v1/completions", json=body | {"stream": True}, timeout=60) as r:
            events = list(sse_events(r))
            return (500 if any("error" in e for e in events) else r.status_code), json.dumps(events[-1:])

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(4)))
    failed = [text for status, text in results if status == 500]
    assert failed and all("out of memory" in text for text in failed)
    state = sim.state()
    assert state["kv_oom"] >= 1 and state["kv_oom_failed_requests"] == len(failed)
    assert sim.metrics()["sim:kv_oom_total"] == state["kv_oom"]
    assert _idle(sim)


def test_kv_usage_history_samples_usage_over_time(start_sim):
    sim = start_sim(timing=slow(decode_ms=200), num_blocks=64, block_size=16)
    t0 = time.time()
    sock = sim.raw_request("/v1/completions", json.dumps({"prompt": prompt_of(40), "max_tokens": 200,
                                                           "ignore_eos": True, "stream": True}).encode())
    try:
        busy = wait_until(lambda: [s for s in sim.state()["kv_usage_history"] if s[1] > 0], what="a busy sample")
        assert busy[0][0] >= t0 and busy[0][1] >= 3 / 64  # at least 40 prompt tokens + 1 output: 3 of 64 blocks
    finally:
        sock.close()
    wait_until(lambda: sim.state()["kv_usage_history"][-1][1] == 0, what="an idle sample after the abort")
    history = sim.state()["kv_usage_history"]
    assert [t for t, _ in history] == sorted(t for t, _ in history)
    later = sim.http.get("/admin/state", params={"history_since": history[-1][0]}).json()["kv_usage_history"]
    assert later and later[0][0] >= history[-1][0]
    assert sim.http.get("/admin/state", params={"history_since": "soon"}).status_code == 400


def test_steps_that_compute_prompts_pay_the_prefill_base_and_per_request_cost(start_sim):
    # 60 ms for any step computing prompts and 10 ms per prompt, nothing else: however a burst of four splits
    # over steps (which the arrivals' timing decides), every reply waits at least one such step (70 ms), and
    # the last waits for all four prompts' share (60 + 4 x 10 ms at least). Time can only add to these bounds.
    sim = start_sim(timing=TimingModel(step_overhead_ms=0.0, prefill_ms_per_token=0.0, decode_base_ms=0.0,
                                       decode_ms_per_seq=0.0, prefill_base_ms=60.0, prefill_ms_per_seq=10.0))

    def one(i: int) -> float:
        start = time.monotonic()
        r = httpx.post(sim.url + "/v1/completions", json={"prompt": f"burst {i}", "max_tokens": 1}, timeout=30)
        assert r.status_code == 200, r.text
        return (time.monotonic() - start) * 1000

    with ThreadPoolExecutor(4) as pool:
        took = sorted(pool.map(one, range(4)))
    assert took[0] >= 70 and took[-1] >= 100, took
