"""bench/micro/shared_prefix_cost.py on a few pairs: every case timed against no prefix; bad flags refused. Not the
figures."""

from __future__ import annotations

import pytest

from bench.micro.shared_prefix_cost import CASES, main


def test_a_tiny_run_times_every_case_against_no_prefix():
    out = main(["--rounds", "2", "--number", "20"])
    assert set(out) == set(CASES) and out["no prefix"]["ratio"] == 1.0
    assert all(figure["us"] > 0 for figure in out.values())


@pytest.mark.parametrize("flag", ["--rounds", "--number"])
def test_a_flag_that_must_be_positive_is_refused_with_its_name(flag, capsys):
    with pytest.raises(SystemExit):
        main([flag, "0"])
    assert f"{flag} must be at least 1" in capsys.readouterr().err
