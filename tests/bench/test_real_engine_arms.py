"""Every arm of the real-engine study is a config the gateway accepts (no key given twice, none unknown)."""

import pytest

from bench.lib.engines import SLOTS
from bench.real_engine.study import BASE_CONFIG, CALLERS, arms
from gateway.settings import parse_config


@pytest.mark.parametrize("arm", [a for a in arms(SLOTS) if a.gateway is not None], ids=lambda a: a.name)
def test_each_gateway_arm_parses(arm):
    text = (BASE_CONFIG % {"slots": SLOTS} if arm.shared else CALLERS) + arm.gateway
    parse_config(text, f"{arm.name}.yaml", env={})


def test_the_cores_each_process_used_are_summarised_per_arm_and_reported():
    """Each run's cores by role (the load, the gateway, vLLM's API server and engine) become the arm's medians over
    its runs, and the report's table lists every role, a role a run lacks counted as 0."""
    from bench.real_engine.traffic import Record
    from bench.real_engine.report import cpu_table, summarise

    arm_list = [a for a in arms(SLOTS) if a.name in ("realtime-only", "vllm-priority", "shipped-default")]

    def rec(arm: str, group: int, cpu: dict[str, float]) -> Record:
        r = Record(arm, 0, group=group, ttft=[0.05] * 20, batch_completed=10, batch_tokens=3000, cpu=cpu)
        return r

    records = []
    for group, gw in enumerate((0.2, 0.6, 0.4)):
        records += [rec("realtime-only", group, {"load": 0.1, "gateway": 0.1, "vLLM API server": 0.2}),
                    rec("vllm-priority", group, {"load": 0.3, "vLLM API server": 0.5, "vLLM engine": 0.9}),
                    rec("shipped-default", group, {"load": 0.3, "gateway": gw, "vLLM API server": 0.5,
                                                   "vLLM engine": 0.8})]
    summary = summarise(records, arm_list)
    assert summary["shipped-default"]["cpu"] == {"gateway": 0.4, "load": 0.3, "vLLM API server": 0.5,
                                                 "vLLM engine": 0.8}
    assert "gateway" not in summary["vllm-priority"]["cpu"]
    lines = cpu_table(summary)
    assert lines[3] == "| arm | gateway | load | vLLM API server | vLLM engine | all |"
    assert lines[-1].endswith("| 0.40 | 0.30 | 0.50 | 0.80 | 2.00 |")
    assert any(line.startswith("| vLLM priority alone (no gateway) | 0.00 | 0.30 |") for line in lines)


@pytest.mark.e2e
def test_the_study_s_processes_are_told_apart_by_their_command_lines():
    import subprocess
    import sys
    import time

    import psutil

    from bench.real_engine.study import cpu_role

    assert cpu_role(psutil.Process()) == "load"
    wait = "import sys; sys.stdin.read()"
    cases = {("-m", "holdback.cli", "gateway", "--port", "1"): "gateway",
             ("-m", "holdback.cli", "sim", "--port", "1"): "simulator",
             ("-m", "vllm.entrypoints.openai.api_server", "--model", "m"): "vLLM API server",
             ("-m", "something.else"): None}
    for argv, role in cases.items():
        proc = subprocess.Popen([sys.executable, "-c", wait, *argv], stdin=subprocess.PIPE)
        try:
            found = psutil.Process(proc.pid)
            deadline = time.monotonic() + 30
            while found.cmdline()[1:3] != ["-c", wait]:  # empty, or the parent's, until the child has exec'd
                assert time.monotonic() < deadline, found.cmdline()
                time.sleep(0.01)
            assert cpu_role(found) == role, argv
        finally:
            proc.communicate(b"")


def test_the_scrape_cost_bench_asks_vllm_for_the_series_the_gateway_scrapes():
    """The bench spells the gateway's query itself (a benchmark uses public interfaces only): it must not drift."""
    from bench.real_engine.scrape_cost import FILTERED, SERIES
    from gateway.vllm_metrics import FILTERED_METRICS, GAUGES

    assert set(SERIES) == {*GAUGES, "vllm:cache_config_info"}
    assert FILTERED == FILTERED_METRICS


def test_the_simulator_s_fidelity_is_decided_only_when_its_interval_is():
    """sim ÷ engine per ratio, with an interval from resampling each side's groups: within 15% only when the whole
    interval is, outside only when none of it is; groups that spread wider than that leave it undecided."""
    from bench.real_engine.report import fidelity

    def arm(p95: list[float], done: list[float]) -> dict:
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731 - odd counts only here
        return {"p95_ratio": {"value": med(p95)}, "batch_ratio": {"value": med(done)},
                "per_group": {"p95_ratio": p95, "batch_ratio": done}}

    engine = {"steady": arm([2.0, 2.02, 1.98], [1.0, 1.01, 0.99]), "far": arm([2.0, 2.02, 1.98], [1.0, 1.01, 0.99]),
              "spread": arm([1.0, 2.0, 3.0], [1.0, 1.01, 0.99]), "one": arm([2.0], [1.0])}
    sim = {"steady": arm([2.1, 2.08, 2.12], [1.0, 1.0, 1.01]), "far": arm([3.0, 3.1, 2.9], [1.0, 1.0, 1.0]),
           "spread": arm([2.0, 2.01, 1.99], [1.0, 1.0, 1.0]), "one": arm([2.0], [1.0])}
    out = fidelity(engine, sim)
    assert out["steady"]["within_15pct"] == "yes", out["steady"]
    assert 0.85 <= out["steady"]["p95_ratio"]["lo"] <= out["steady"]["p95_ratio"]["value"] == 1.05
    assert out["far"]["within_15pct"] == "no" and out["far"]["p95_ratio"]["lo"] > 1.15, out["far"]
    spread = out["spread"]["p95_ratio"]
    assert out["spread"]["within_15pct"] == "undecided" and spread["lo"] < 0.85 < 1.15 < spread["hi"], spread
    # One group a side has no interval: the point decides, as before.
    assert out["one"]["within_15pct"] == "yes" and out["one"]["p95_ratio"]["lo"] is None
    assert out["steady"]["tokens_ratio"] is None  # not measured: no verdict from it


def test_a_study_s_report_is_recomputed_from_its_raw_records(tmp_path):
    """`--report DIR` runs nothing: the summary and the report come again from DIR's raw.json, with the settings
    its summary.json recorded, and say the same figures a run would."""
    import json
    from dataclasses import asdict

    from bench.real_engine.study import main
    from bench.real_engine.traffic import Record

    records = []
    for engine, rounds in (("vllm", 3), ("sim", 2)):
        for group in range(rounds):
            g = group + (10 if engine == "sim" else 0)
            records += [Record("realtime-only", group, engine, g, ttft=[0.05 + 0.001 * group] * 20),
                        Record("vllm-priority", group, engine, g, ttft=[0.5] * 20, batch_completed=100,
                               batch_tokens=30000, steps=4000),
                        Record("shipped-default", group, engine, g, ttft=[0.06] * 20, batch_completed=95 + group,
                               batch_tokens=29000, steps=3900, evictions=60)]
    (tmp_path / "raw.json").write_text(json.dumps([asdict(r) for r in records]))
    settings = {"rounds": 3, "sim_rounds": 2, "window": 20.0, "lead": 5.0, "replicas": 1, "burst": 10, "rate": 3.0,
                "batch_inflight": 10, "batch_tokens": [200, 400], "slots": SLOTS, "no_sim": False}
    (tmp_path / "summary.json").write_text(json.dumps({"args": settings, "favoured": True, "timing": {
        "prefill_ms_per_token": 0.0, "decode_base_ms": 2.0, "decode_ms_per_seq": 0.1}}))
    assert main(["--report", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["args"] == settings and summary["engine"]["shipped-default"]["batch_completed"] == [95, 96, 97]
    assert summary["engine"]["shipped-default"]["per_group"]["batch_ratio"] == [0.95, 0.96, 0.97]
    assert summary["fidelity"]["shipped-default"]["batch_ratio"]["value"] == round(0.955 / 0.96, 3)
    report = (tmp_path / "report.md").read_text()
    assert "95, 96, 97" in report and "### The simulator" in report
    # The plots are drawn from the same records and linked from the report.
    for plot in ("goal_ratios.png", "ttft_cdf.png", "fidelity.png"):
        assert (tmp_path / plot).read_bytes().startswith(b"\x89PNG") and f"![{plot}]({plot})" in report


def test_report_mode_says_what_it_needs_when_the_run_is_not_there(tmp_path, capsys):
    from bench.real_engine.study import main

    with pytest.raises(SystemExit) as exc:
        main(["--report", str(tmp_path)])
    assert exc.value.code == 2
    assert "needs the raw.json and summary.json a run with --out wrote there" in capsys.readouterr().err
