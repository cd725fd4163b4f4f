"""`holdback gateway` refuses a bad config file at start with a line that says what to change."""

import pytest

from gateway.cli import main


def test_bad_config_at_start_exits_2_and_names_the_key(tmp_path, capsys):
    bad = tmp_path / "gw.yaml"
    bad.write_text("eviction: {maxPerDecision: 0}\n")
    assert main(["--config", str(bad), "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert '"event":"config_rejected"' in err and "eviction.maxPerDecision" in err


def test_bad_replicas_flag_exits_2(capsys):
    assert main(["--replicas", "localhost:8000", "--port", "1"]) == 2
    assert "--replicas" in capsys.readouterr().err


def test_help_describes_the_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--config", "--host", "--port", "--replicas"):
        assert flag in out
