"""bench/real_engine/prefix.py on the simulator, tiny: every arm of both workloads runs once and the report has its
ratios, hit rates and plot; the ratios between made-up arms; bad flags refused. Not the goal figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.real_engine.prefix import PICKERS, main
from bench.real_engine.prefix_report import RATIOS, per_group, summarise


def _run(workload: str, arm: str, group: int, tokens_per_step: float, hit_rate: float = 0.5) -> dict:
    return {"workload": workload, "arm": arm, "group": group, "tokens_per_step": tokens_per_step, "makespan": 10.0,
            "ttft_p95": 0.1, "hit_rate": hit_rate, "lines_failed": 0, "realtime_failed": 0, "evictions": 0}


def test_ratios_pair_the_arms_of_each_group_and_a_missing_arm_drops_its_group():
    runs = [_run("shared", "vllm-priority", 0, 4.0), _run("shared", "plan", 0, 6.0),
            _run("shared", "vllm-priority", 1, 5.0), _run("shared", "plan", 1, 7.5),
            _run("shared", "plan", 2, 9.0)]  # group 2 has no vLLM arm
    plan_over_vllm = RATIOS[0]
    assert (plan_over_vllm.num, plan_over_vllm.den) == ("plan", "vllm-priority")
    assert per_group(runs, plan_over_vllm) == [1.5, 1.5]
    summary = summarise(runs)
    assert summary["ratios"][plan_over_vllm.name]["value"] == 1.5
    assert summary["hit_rate"]["shared: plan"]["per_group"] == [0.5, 0.5, 0.5]


@pytest.mark.parametrize("flag", ["--groups", "--kv-blocks", "--step-tokens", "--doc-words"])
def test_a_flag_that_must_be_positive_is_refused_with_its_name(flag: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main([flag, "0"])
    assert f"{flag} must be at least 1" in capsys.readouterr().err


@pytest.mark.e2e
def test_one_tiny_group_on_the_simulator_runs_every_arm_and_writes_the_report(tmp_path: Path) -> None:
    summary = main(["--engine", "sim", "--groups", "1", "--workloads", "shared", "--documents", "4", "--questions",
                    "3", "--doc-words", "150", "--max-tokens", "4", "--slots", "2", "--kv-blocks", "40", "--rate", "20",
                    "--sim-arg=--decode-base-ms=1", "--sim-arg=--prefill-ms-per-token=0.01", "--out", str(tmp_path)])
    raw = json.loads((tmp_path / "raw.json").read_text())
    assert [r["arm"] for r in raw["runs"]] == ["vllm-priority", "plan", "plan-off", "line-order"]
    for run in raw["runs"]:
        assert run["lines_failed"] == 0 and run["batch_tokens"] == 12 * 4, run
        assert run["steps"] > 0 and run["queries"] > 0, run
    # Realtime ran beside the batch through holdback (vLLM alone may finish before realtime's first arrival). At 20/s
    # realtime's first arrival (seeded) is 0.03 s into an arm; at 2/s it was 0.34 s, and holdback's arms, which take
    # 0.3 s since the workers stream 8 tokens an event, could end before it.
    assert all(r["ttft"] for r in raw["runs"] if r["arm"] != "vllm-priority")
    # Every step and makespan ratio of the workload (realtime's need vLLM alone to have had realtime).
    assert {r.name for r in RATIOS if r.workload == "shared" and r.figure != "ttft_p95" and r.num not in PICKERS
            } <= set(summary["ratios"])
    assert all(len(e["per_group"]) == 1 for e in summary["ratios"].values())
    assert set(summary["hit_rate"]) == {"shared: vllm-priority", "shared: plan", "shared: plan-off",
                                        "shared: line-order"}
    assert summary["cached_first_per_group"]["shared: line-order"] == [0]  # cachedFirstLookahead: 0 in that arm
    text = (tmp_path / "summary.md").read_text()
    assert "shared: tokens_per_step plan ÷ vllm-priority" in text and (tmp_path / "prefix_ratios.png").stat().st_size


@pytest.mark.e2e
def test_two_tiny_replicas_on_the_simulator_run_the_picker_by_load_and_by_prefix(tmp_path: Path) -> None:
    summary = main(["--engine", "sim", "--replicas", "2", "--groups", "1", "--workloads", "shared", "--documents",
                    "4", "--questions", "3", "--doc-words", "150", "--max-tokens", "4", "--slots", "2", "--kv-blocks",
                    "40", "--rate", "20", "--sim-arg=--decode-base-ms=1", "--sim-arg=--prefill-ms-per-token=0.01",
                    "--out", str(tmp_path)])
    raw = json.loads((tmp_path / "raw.json").read_text())
    assert [r["arm"] for r in raw["runs"]] == list(PICKERS)
    for run in raw["runs"]:
        assert run["lines_failed"] == 0 and run["batch_tokens"] == 12 * 4 and run["tokens_per_second"] > 0, run
        assert run["steps"] > 0 and run["queries"] > 0 and run["ttft"], run
    assert "shared: tokens_per_second prefix-affinity ÷ least-loaded" in summary["ratios"]
    assert "2 replica(s)" in (tmp_path / "summary.md").read_text()
