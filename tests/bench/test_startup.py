"""bench/startup.py: each service's start-up CPU and wall time from two trees, and their ratio."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench.startup import main

REPO = Path(__file__).resolve().parents[2]
# Appended to the baseline copy's simulator command: a second of CPU before it serves.
BURN = "\nimport time as _t\n_end = _t.process_time() + 1.0\nwhile _t.process_time() < _end:\n    _spun = True\n"


@pytest.mark.e2e
def test_one_round_measures_both_trees_and_takes_the_ratio(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    base = tmp_path / "base"
    for package in ("holdback", "model_sim"):  # all `holdback sim` imports
        shutil.copytree(REPO / package, base / package, ignore=shutil.ignore_patterns("__pycache__"))
    with open(base / "model_sim" / "cli.py", "a") as cli:
        cli.write(BURN)
    out = tmp_path / "startup.json"

    assert main(["--baseline", str(base), "--rounds", "1", "--warmup", "0", "--services", "sim",
                 "--json", str(out)]) == 0

    result = json.loads(out.read_text())
    assert result["imports_from"] == {"this": str(REPO / "holdback" / "__init__.py"),
                                      "baseline": str(base.resolve() / "holdback" / "__init__.py")}
    cpu = result["services"]["sim"]["cpu_s"]
    (this,), (baseline,) = cpu["this"], cpu["baseline"]
    assert baseline - this > 0.8, "the baseline's simulator spun a CPU-second more before it served"
    assert cpu["ratios"] == [round(baseline / this, 4)]
    assert cpu["ratio"]["value"] == pytest.approx(baseline / this) and cpu["ratio"]["n"] == 1
    wall = result["services"]["sim"]["wall_s"]
    assert len(wall["this"]) == len(wall["baseline"]) == 1 and wall["this"][0] > 0
    assert result["all"]["cpu_s"]["this"] == [this]
    assert "| sim | " in capsys.readouterr().out


def test_a_baseline_that_is_no_holdback_tree_is_refused_with_what_to_make(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["--baseline", str(tmp_path)])
    assert "git worktree add --detach" in str(refused.value)


def test_an_unknown_service_is_refused_naming_the_choices(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit):
        main(["--baseline", str(tmp_path), "--services", "sim,apis"])
    assert "choose from sim, gateway, api, processor, worker" in capsys.readouterr().err
