"""Every arm of the real-engine study is a config the gateway accepts (no key given twice, none unknown)."""

import pytest

from bench.real_engine_study import BASE_CONFIG, CALLERS, SLOTS, arms
from gateway.config import parse_config


@pytest.mark.parametrize("arm", [a for a in arms(SLOTS) if a.gateway is not None], ids=lambda a: a.name)
def test_each_gateway_arm_parses(arm):
    text = (BASE_CONFIG % {"slots": SLOTS} if arm.shared else CALLERS) + arm.gateway
    parse_config(text, f"{arm.name}.yaml", env={})


def test_the_cores_each_process_used_are_summarised_per_arm_and_reported():
    """Each run's cores by role (the load, the gateway, vLLM's API server and engine) become the arm's medians over
    its runs, and the report's table lists every role, a role a run lacks counted as 0."""
    from bench.real_engine_study import summarise
    from bench.real_engine_traffic import Record
    from bench.report.real_engine import cpu_table

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

    from bench.real_engine_study import cpu_role

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
    from bench.real_engine_scrape_cost import FILTERED, SERIES
    from gateway.replicas import FILTERED_METRICS, GAUGES

    assert set(SERIES) == {*GAUGES, "vllm:cache_config_info"}
    assert FILTERED == FILTERED_METRICS
