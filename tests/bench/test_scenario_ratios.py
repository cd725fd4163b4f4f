"""bench/scenario_ratios.py: two scenarios of one study compared repeat by repeat."""

import json

import pytest

from bench.scenario_ratios import main, ratios


def summary(pairs: dict[str, list[float]]) -> dict:
    return {"runs": [{"scenario": name, "repeat": rep, "p95_ttft_ms": value, "batch_completions": value * 10}
                     for name, values in pairs.items() for rep, value in enumerate(values)]}


def test_ratios_are_taken_within_each_repeat():
    table = ratios(summary({"a": [2.0, 3.0, 8.0], "b": [1.0, 3.0, 2.0]}), "a", "b")
    assert table["p95_ttft_ms"]["ratios"] == [2.0, 1.0, 4.0]
    assert table["p95_ttft_ms"]["median"][0] == 2.0
    assert table["preemptions"]["ratios"] == []  # a figure neither run has


def test_a_repeat_missing_one_scenario_is_left_out():
    table = ratios(summary({"a": [2.0, 3.0], "b": [1.0]}), "a", "b")
    assert table["batch_completions"]["ratios"] == [2.0]


def test_the_command_says_what_to_run_first_and_which_names_are_wrong(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path), "a", "b"])
    assert "holdback bench report" in capsys.readouterr().err
    (tmp_path / "summary.json").write_text(json.dumps(summary({"a": [1.0], "b": [2.0]})))
    with pytest.raises(SystemExit):
        main([str(tmp_path), "a", "c"])
    assert "no repeat has both 'a' and 'c'" in capsys.readouterr().err
    main([str(tmp_path), "a", "b"])
    assert "| p95_ttft_ms | 1.0 | 2.0 | 0.5 | 0.5 (one repeat: no interval) |" in capsys.readouterr().out
