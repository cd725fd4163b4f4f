"""The real-engine KV drills' figures (bench/real_engine/kv_drills_report.py) from hand-made runs: ratios taken
within a group, preemptions summed over the groups, the ledger against vLLM's usage; the report's plots."""

from __future__ import annotations

import json

import pytest

from bench.real_engine.kv_drills_report import ledger_gap, summarise, write_report


def run(arm: str, group: int, *, ttft=(), tokens=0, steps=None, preemptions=0, samples=(), window=None) -> dict:
    return {"drill": "surge", "arm": arm, "group": group, "window_s": 10, "ttft": list(ttft), "realtime_refused": {},
            "other": {}, "batch_tokens": tokens, "batch_refused": 0, "batch_evicted": 0, "steps": steps,
            "preemptions": preemptions, "samples": [list(s) for s in samples], "window": window}


def test_ratios_are_taken_within_each_group_and_preemptions_summed():
    raw = {"runs": [
        run("realtime-alone", 0, ttft=[0.1] * 20), run("vllm-alone", 0, ttft=[0.5] * 20, tokens=1000, steps=500,
                                                       preemptions=4),
        run("admission-off", 0, ttft=[0.3] * 20, tokens=900, steps=500, preemptions=6),
        run("admission-on", 0, ttft=[0.12] * 20, tokens=900, steps=450, preemptions=0),
        # A slower machine in group 1: every figure doubles, the ratios do not move.
        run("realtime-alone", 1, ttft=[0.2] * 20), run("vllm-alone", 1, ttft=[1.0] * 20, tokens=500, steps=250,
                                                       preemptions=2),
        run("admission-off", 1, ttft=[0.6] * 20, tokens=450, steps=250, preemptions=2),
        run("admission-on", 1, ttft=[0.24] * 20, tokens=450, steps=225, preemptions=1),
    ]}
    s = summarise(raw)["surge"]
    assert s["preemptions"] == {"vllm-alone": 6, "admission-off": 8, "admission-on": 1}
    assert s["preemptions_on_over_off"] == pytest.approx(1 / 8)
    assert s["batch_per_step_on_over_alone"] == pytest.approx([1.0, 1.0])
    assert s["p95_on_over_alone"] == pytest.approx([1.2, 1.2])
    assert s["p95_vllm_over_alone"] == pytest.approx([5.0, 5.0])
    assert "tuned" not in s


def test_a_tuned_admission_arm_is_compared_with_vllm_alone_and_with_admission_on_in_its_group():
    raw = {"runs": [
        run("realtime-alone", 0, ttft=[0.1] * 20), run("vllm-alone", 0, tokens=1000, steps=500, preemptions=4),
        run("admission-on", 0, tokens=600, steps=500), run("admission-tuned", 0, ttft=[0.15] * 20, tokens=800,
                                                           steps=500, samples=[(0.1, 30, 25.0)]),
    ]}
    t = summarise(raw)["surge"]["tuned"]
    assert t["batch_per_step_over_alone"] == pytest.approx([0.8])
    assert t["batch_per_step_over_on"] == pytest.approx([800 / 600])
    assert t["p95_over_alone"] == pytest.approx([1.5])
    assert t["ledger_gap"]["median"] == pytest.approx(1.2) and t["preemptions"] == 0


def test_the_ledger_gap_is_reserved_over_used_where_vllm_used_blocks_and_its_worst_shortfall():
    runs = {0: run("admission-on", 0, samples=[(0.0, 0, 0.0), (0.1, 24, 20.0), (0.2, 24, 24.0), (0.3, None, 10.0),
                                               (0.4, 10, 13.0)])}
    gap = ledger_gap(runs)
    # The idle sample and the one the gateway did not answer are left out.
    assert gap["samples"] == 3
    assert gap["median"] == pytest.approx(1.0)  # of 10/13, 1.0, 1.2
    assert gap["worst_under_blocks"] == gap["worst_under_blocks_whole_run"] == 3.0  # no window recorded: all


def test_the_ledger_gap_in_the_window_leaves_out_the_streams_closed_at_its_end():
    # At 10.4 the bench has closed its batch streams: the gateway released 30 blocks, vLLM's gauge still shows them.
    runs = {0: run("admission-on", 0, window=[0.5, 10.5], samples=[(0.2, 0, 4.0), (5.0, 30, 25.0),
                                                                     (10.4, 30, 26.0), (10.6, 0, 25.0)])}
    gap = ledger_gap(runs)
    assert gap["samples"] == 2 and gap["worst_under_blocks"] == 0.0
    assert gap["worst_under_blocks_whole_run"] == 25.0


def test_the_report_draws_each_drills_kv_blocks_and_the_goal_ratios_and_links_them(tmp_path):
    samples = [(0.1 * i, 30, 24.0) for i in range(40)]
    runs = [run("realtime-alone", g, ttft=[0.1] * 20) for g in (0, 1)]
    runs += [run("vllm-alone", g, tokens=1000, steps=500, preemptions=3, window=[1.0, 3.0],
                 samples=[(t, None, 39.0) for t, _, _ in samples]) for g in (0, 1)]
    runs += [run("admission-on", g, ttft=[0.11] * 20, tokens=700, steps=500, window=[1.0, 3.0], samples=samples)
             for g in (0, 1)]
    runs += [run("admission-tuned", 0, ttft=[0.12] * 20, tokens=800, steps=500, samples=samples)]
    raw = {"args": {"groups": "2", "window": "2.0", "seed": "47", "tuned": "interactiveReserve: 0.1"},
           "favoured": True, "engine": {"kv_blocks": 40, "block_size": 128, "slots": 8, "cpu": 0}, "runs": runs}
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "runs.json").write_text(json.dumps(raw))
    report = write_report(tmp_path)
    for name in ("kv_blocks_surge.png", "goal_ratios.png"):
        assert (tmp_path / name).stat().st_size > 1000
        assert f"]({name})" in report
    assert (tmp_path / "report.md").read_text() == report
