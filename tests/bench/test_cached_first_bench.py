"""bench/cached_first.py on a tiny file: both arms run, only the on arm sends requests ahead, the report has its
ratios; bad flags refused. Not the figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from bench.cached_first import gateway_config, main


def test_the_arms_differ_only_in_the_lookahead_over_the_shipped_config():
    on, off = yaml.safe_load(gateway_config(64)), yaml.safe_load(gateway_config(0))
    assert on["flowControl"]["cachedFirstLookahead"] == 64 and off["flowControl"]["cachedFirstLookahead"] == 0
    off["flowControl"]["cachedFirstLookahead"] = 64
    assert on == off and on["admission"]["enabled"] is True


@pytest.mark.parametrize("flag", ["--rounds", "--lookahead", "--concurrency"])
def test_a_flag_that_must_be_positive_is_refused_with_its_name(flag: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main([flag, "0"])
    assert f"{flag} must be at least 1" in capsys.readouterr().err


@pytest.mark.e2e
def test_one_tiny_round_runs_both_arms_and_writes_the_report(tmp_path: Path) -> None:
    # A round too short for the gateway to learn the engine's 2 slots (it takes 2 s of requests waiting there): KV
    # admission is what keeps requests in the gateway's queue, where cached-first reorders them. 16 blocks hold
    # a few of these requests as the replica holds them (a shared prefix once); 40 would hold all 16 sent.
    summary = main(["--rounds", "1", "--documents", "6", "--questions", "4", "--doc-words", "150", "--max-tokens", "4",
                    "--concurrency", "16", "--slots", "2", "--kv-blocks", "16", "--out", str(tmp_path)])
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [r["arm"] for r in runs] == ["on", "off"]
    on, off = runs
    assert off["sent_ahead"] == 0 and on["sent_ahead"] > 0, runs
    assert all(r["makespan"] > 0 and r["computed_prompt_tokens"] > 0 for r in runs)
    assert len(summary["makespan_on_over_off"]["per_round"]) == 1
