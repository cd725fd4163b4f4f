"""The study's figures and bookkeeping, on hand-made records: goals, harvest, the places batch held, the
differences from the seed, the occupancy line and resuming a stopped full run."""

import json

import pytest

from bench import study
from bench.report.differences import adaptive_differences, differences
from bench.report.figures import figures, run_harvest
from bench.report.summary import goals, occupancy_cost, paired_ratio, summarize
from bench.study import QUICK, SCENARIOS, StudyMismatch, recorded_runs, run_study


def fig(scenario, repeat, **kw):
    return {"scenario": scenario, "repeat": repeat, **kw}


def test_goal_ratios_pair_scenarios_by_repeat_and_judge_them():
    runs = []
    for r, (base, hb, nc) in enumerate([(300, 310, 600), (350, 355, 700), (320, 330, 640)]):
        runs += [fig("realtime_only", r, p95_ttft_ms=base, realtime_output_tps=30.0),
                 fig("holdback_50", r, p95_ttft_ms=hb, batch_completions=100 + r, batch_output_tps=400.0),
                 fig("no_controls", r, p95_ttft_ms=nc, batch_completions=200, batch_output_tps=600.0),
                 fig("holdback_50_evict", r, p95_ttft_ms=hb, batch_completions=120 + r, batch_output_tps=450.0,
                     evicted_requests=2, evicted_completed=2, duplicate_final_results=0),
                 fig("batch_alone", r, batch_completions=260, batch_output_tps=830.0)]
    summary = summarize(runs)
    hb = paired_ratio(runs, "holdback_50", "realtime_only", "p95_ttft_ms")
    assert hb.n == 3 and hb.value == pytest.approx(330 / 320) and hb.lo <= hb.value <= hb.hi
    judged = {g["goal"]: g for g in goals(summary, runs)}
    assert judged["no_controls"]["verdict"] == "met"
    assert judged["holdback"]["verdict"] == "met"  # 1.014..1.033, all under 1.05
    assert judged["eviction"]["verdict"] == "met"  # 1.18..1.2
    assert judged["adaptive_batch"]["verdict"] == "not measured"
    assert judged["retries"]["verdict"] == "met" and "6 of 6" in judged["retries"]["note"]
    # Harvest from the same repeat: 450 / (830 - 30).
    assert run_harvest(runs, "holdback_50_evict", 1) == pytest.approx(450 / 800)
    assert summary["holdback_50_evict"]["harvest"] == pytest.approx(450 / 800)
    assert summary["holdback_50_evict"]["harvest_ci"] == [pytest.approx(450 / 800)] * 2


def test_an_evicted_request_left_unfinished_misses_the_retry_goal():
    runs = [fig("holdback_50_evict", 0, evicted_requests=3, evicted_completed=2, duplicate_final_results=0,
                batch_completions=10)]
    judged = {g["goal"]: g for g in goals(summarize(runs), runs)}
    assert judged["retries"]["verdict"] == "missed"


def record(name, repeat, w=QUICK, seed=7):
    return {"scenario": {"name": name, "batch": SCENARIOS[name].batch}, "repeat": repeat, "seed": seed + repeat,
            "workload": json.loads(json.dumps(study.asdict(w))), "started_at": 100.0,
            "finished_at": 100.0 + w.lead_s + w.window_s + 12.0}


def test_resume_runs_only_what_is_missing_and_estimates_from_recorded_runs(tmp_path, monkeypatch):
    ran, lines = [], []

    def fake_run(scenario, w, repeat, seed, out_dir, **kw):  # noqa: ANN001, ANN003
        ran.append((scenario.name, repeat))
        (out_dir / "raw" / f"{scenario.name}-r{repeat}.json").write_text(json.dumps(record(scenario.name, repeat)))

    monkeypatch.setattr(study, "run_one", fake_run)
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "no_controls-r0.json").write_text(json.dumps(record("no_controls", 0)))
    (tmp_path / "raw" / "holdback_50-r1.json").write_text("{truncated")  # a run stopped mid-write: run it again
    with pytest.raises(StudyMismatch, match="--resume"):
        run_study(["no_controls", "holdback_50"], QUICK, 2, 7, tmp_path)
    paths = run_study(["no_controls", "holdback_50"], QUICK, 2, 7, tmp_path, resume=True, log=lines.append)
    assert ran == [("holdback_50", 0), ("no_controls", 1), ("holdback_50", 1)]
    assert len(paths) == 4 and all(p.exists() for p in paths)
    assert "3 run(s) to do of 4 (1 already recorded)" in lines[0] and "about 12 s" in lines[0]
    assert "measured on the recorded runs" in lines[0]


def test_resume_refuses_records_of_another_workload_or_seed(tmp_path):
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "no_controls-r0.json").write_text(json.dumps(record("no_controls", 0, seed=8)))
    with pytest.raises(StudyMismatch, match="seed 8 against 7"):
        recorded_runs(tmp_path, QUICK, 7)
    other = study.with_overrides(QUICK, window_s=30.0)
    (tmp_path / "raw" / "no_controls-r0.json").write_text(json.dumps(record("no_controls", 0, w=other)))
    with pytest.raises(StudyMismatch, match="window_s 30.0 against 60.0"):
        recorded_runs(tmp_path, QUICK, 7)


def test_the_duration_estimate_counts_lead_window_and_overhead():
    assert study.run_seconds(SCENARIOS["no_controls"], study.FULL, 25.0) == 60 + 300 + 25
    assert study.run_seconds(SCENARIOS["realtime_only"], study.FULL, 25.0) == 1 + 300 + 25
    assert study.format_duration(5 * 3600 + 7 * 60) == "5 h 07 min"
    assert study.format_duration(600) == "10 min"


def test_gzipped_records_count_as_recorded_and_are_read_by_the_report(tmp_path):
    import gzip

    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "no_controls-r0.json.gz").write_bytes(gzip.compress(json.dumps(record("no_controls", 0)).encode()))
    assert set(recorded_runs(tmp_path, QUICK, 7)) == {("no_controls", 0)}
    assert study.read_record(study.record_paths(tmp_path)[0])["scenario"]["name"] == "no_controls"


def test_figures_count_places_held_from_samples_and_lifetimes():
    rec = {"scenario": {"name": "adaptive_evict", "batch": True}, "repeat": 0,
           "gateway_overrides": {"usageLimit": {"policy": "adaptive-reserve", "margin": 0.05}},
           "window": {"realtime_start": 10.0, "window_s": 10.0},
           "realtime": [{"status": 200, "ttft_s": 0.3, "e2e_s": 2.0, "sent_s": 1.0, "output_tokens": 8},
                        {"status": 200, "ttft_s": 0.3, "e2e_s": 3.0, "sent_s": 2.0, "output_tokens": 8}],
           # Samples before the window (t < 10) do not count.
           "samples": [{"t": 5.0, "bands": {"-10": {"in_flight": 48}}},
                       {"t": 11.0, "bands": {"-10": {"in_flight": 30}}},
                       {"t": 12.0, "bands": {"-10": {"in_flight": 34}}}]}
    f = figures(rec)
    assert f["batch_in_flight_mean"] == 32
    assert f["realtime_in_flight_mean"] == pytest.approx(0.5)  # (2 + 3) s of lifetimes over a 10 s window
    assert summarize([f])["adaptive_evict"]["usage_limit"] == {"policy": "adaptive-reserve", "margin": 0.05}


def test_adaptive_differences_bound_the_goal_by_the_places_realtime_leaves():
    def run(name, done, held, rt=6.0, p95=300.0):
        return fig(name, 0, batch_completions=done, batch_in_flight_mean=held, realtime_in_flight_mean=rt,
                   p95_ttft_ms=p95)

    base = [fig("realtime_only", 0, p95_ttft_ms=300.0), run("reserve_25_evict", 100, 36.0)]
    # 48 - 6 = 42 places at most: 42 / 36 = 1.17 < 1.25, so no policy could meet the goal.
    text = " ".join(adaptive_differences(summarize([*base, run("adaptive_evict", 105, 37.0)]), 48))
    assert "1.05× the batch completions" in text and "1.17×" in text and "no reserve policy can meet" in text
    # With room to spare the text says how much of it the adaptive reserve used: (33 - 30) / (42 - 30).
    roomy = [fig("realtime_only", 0, p95_ttft_ms=300.0), run("reserve_25_evict", 100, 30.0)]
    text = " ".join(adaptive_differences(summarize([*roomy, run("adaptive_evict", 110, 33.0)]), 48))
    assert "1.40×" in text and "used 25% of the room" in text


def test_the_eviction_difference_names_what_lending_the_reserve_completed():
    runs = [fig("realtime_only", 0, p95_ttft_ms=300.0, realtime_requests=1200),
            fig("holdback_50", 0, batch_completions=100, p95_ttft_ms=310.0, preemptions=0),
            fig("holdback_50_evict", 0, batch_completions=95, recomputed_tokens=5000, preemptions=0),
            fig("adaptive_evict", 0, batch_completions=130)]
    text = " ".join(differences({"workload": {}}, summarize(runs), runs))
    assert "-5% against the seed's +9%" in text and "completed 1.30× holdback alone's" in text


def test_occupancy_cost_fits_p95_against_batch_places_and_places_the_adaptive_runs_against_it():
    runs = [fig("realtime_only", r, p95_ttft_ms=300.0) for r in range(3)]
    # Fixed reserves on the line p95 = 300 + 1 ms per place, 10 completions per place.
    for r, (name, held) in enumerate([("reserve_75_evict", 10.0), ("holdback_50", 20.0), ("reserve_25_evict", 30.0)]):
        runs.append(fig(name, r, p95_ttft_ms=300.0 + held, batch_in_flight_mean=held, batch_completions=10 * held))
    # Not fitted: the adaptive reserve, 2 ms above the line; two replicas and no controls are other regimes.
    runs += [fig("adaptive_evict", 0, p95_ttft_ms=327.0, batch_in_flight_mean=25.0, batch_completions=250.0),
             fig("no_controls", 0, p95_ttft_ms=3000.0, batch_in_flight_mean=40.0, batch_completions=400.0),
             fig("two_replicas", 0, p95_ttft_ms=305.0, batch_in_flight_mean=40.0, batch_completions=400.0)]
    occ = occupancy_cost(runs)
    assert occ["runs"] == 6
    assert occ["intercept_ms"] == pytest.approx(300.0) and occ["slope_ms"] == pytest.approx(1.0)
    assert occ["slope_lo_ms"] <= 1.0 <= occ["slope_hi_ms"]
    assert occ["places_at_bound"] == pytest.approx(15.0)  # 1.05 × 300 = 315 ms
    assert occ["places_at_bound_lo"] <= 15.0 <= occ["places_at_bound_hi"]
    assert occ["completions_per_place"] == pytest.approx(10.0) and occ["completions_at_bound"] == pytest.approx(150.0)
    assert occ["adaptive_residual_ms"] == pytest.approx(2.0)
    assert occupancy_cost([fig("realtime_only", 0, p95_ttft_ms=300.0)]) is None


def test_the_adaptive_p95_difference_names_the_band_of_places_that_meets_both_goals():
    def run(name, held, p95, rt=6.0):
        return fig(name, 0, p95_ttft_ms=p95, batch_in_flight_mean=held, batch_completions=10 * held,
                   realtime_in_flight_mean=rt)

    runs = [fig("realtime_only", 0, p95_ttft_ms=300.0), fig("realtime_only", 1, p95_ttft_ms=300.0),
            run("reserve_75_evict", 8.0, 308.0), run("holdback_50", 20.0, 320.0), run("reserve_25_evict", 30.0, 330.0),
            {**run("adaptive_evict", 25.0, 325.0), "usage_limit": {"policy": "adaptive-reserve", "minCeiling": 0.5}}]
    text = " ".join(adaptive_differences(summarize(runs), 48, occupancy_cost(runs)))
    # The line crosses 315 ms at 15 places; 1.25 × the 80 completions of reserve_75_evict need 10 places.
    assert "1.083× realtime-only" in text and "0.0 ms from the line" in text
    assert "below the 20.0 places batch holds at the adaptive reserve's own floor" in text
    assert "between 10.0 places" in text and "and 15.0;" in text
