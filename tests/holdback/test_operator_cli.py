"""The operator's first hour at the command line: `make up` takes flags, `keys create` shows the key's id,
every `--help` explains each argument (no "(default: None)" for a required port), and the data dir's growth is
visible (`holdback data usage`) and its logs can be cut while `holdback up` writes them (`holdback data trim-logs`)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from bench import cli as bench_cli
from holdback.cli import data as data_cli
from holdback.cli import db as db_cli
from holdback.cli import keys as keys_cli
from model_sim.cli import build_parser as sim_parser
from tests.support import REPO


@pytest.fixture
def in_dir(tmp_path, monkeypatch):
    """Run as from a fresh directory: no DATABASE_URL, the data dir ./data under tmp_path."""
    monkeypatch.chdir(tmp_path)
    for var in ("DATABASE_URL", "REDIS_URL", "HOLDBACK_DATA_DIR", "HOLDBACK_FILES_URL"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def test_make_up_passes_its_args_to_holdback_up():
    # Run as a user runs it, not as a sub-make: under `make test-services` the inherited MAKEFLAGS/MAKELEVEL
    # would make it print "Leaving directory" after the command.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    dry = subprocess.run(["make", "-n", "up", "ARGS=--api-port 9000 --sim-replicas 4"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.strip().splitlines()[-1].endswith("holdback up --api-port 9000 --sim-replicas 4"), dry.stdout


def test_keys_create_shows_the_id_beside_the_secret(in_dir, capsys):
    assert keys_cli.main(["create", "--tenant", "acme", "--create"]) == 0
    out, err = capsys.readouterr()
    assert re.fullmatch(r"hb-\S+\n", out), "stdout is the secret alone, for KEY=$(holdback keys create ...)"
    key_id = re.search(r"key id: (\S+) \(tenant acme", err).group(1)
    assert f"holdback keys revoke {key_id}" in err
    assert keys_cli.main(["list"]) == 0
    listed = capsys.readouterr().out
    assert re.search(rf"^{re.escape(key_id)}\s+acme\s+{re.escape(out[:8])}", listed, re.M), listed


def _help(main, argv: list[str], capsys) -> str:  # noqa: ANN001
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 0
    return capsys.readouterr().out


def _positionals(help_text: str) -> dict[str, str]:
    """Each positional argument of a --help text and the help beside it."""
    section = help_text.split("positional arguments:", 1)[1].split("\n\n", 1)[0]
    found: dict[str, str] = {}
    for line in section.splitlines():
        if entry := re.match(r"^  (\S+)\s*(.*)$", line):
            name = entry.group(1)
            found[name] = entry.group(2)
        elif line.strip():  # a wrapped help line
            found[name] += " " + line.strip()
    return found


def test_db_upgrade_and_bench_report_explain_their_arguments(capsys):
    db = _positionals(_help(db_cli.main, ["upgrade", "--help"], capsys))
    assert "head" in db["revision"] and "migration" in db["revision"], db
    report = _positionals(_help(bench_cli.main, ["report", "--help"], capsys))
    assert "holdback bench study" in report["DIR"] and "raw/" in report["DIR"], report
    assert "seed" not in _help(bench_cli.main, ["--help"], capsys).lower()


def test_sim_help_shows_no_default_for_the_required_port(monkeypatch):
    monkeypatch.delenv("HOLDBACK_SIM_PORT", raising=False)
    parser = sim_parser()
    text = parser.format_help()
    assert "(default: None)" not in text, [line for line in text.splitlines() if "None" in line]
    assert re.search(r"--port PORT\s+port of replica 0; replica i uses PORT\+i \(required\)", text), text
    assert "(default: 127.0.0.1)" in text, "flags with a default still show it"
    with pytest.raises(SystemExit):
        parser.parse_args([])  # still required


def test_trim_keeps_the_last_whole_lines_and_an_appending_writer_goes_on_at_the_end(tmp_path):
    log = tmp_path / "api.log"
    writer = open(log, "ab")  # as `holdback up` opens each child's log
    try:
        writer.write(b"".join(f"line {i:04d}\n".encode() for i in range(1000)))  # 10 bytes a line
        writer.flush()
        assert data_cli.trim(log, 95) == (10_000, 90)
        assert log.read_bytes() == b"".join(f"line {i:04d}\n".encode() for i in range(991, 1000))
        writer.write(b"after the cut\n")
        writer.flush()
        assert log.read_bytes().endswith(b"line 0999\nafter the cut\n") and b"\0" not in log.read_bytes()
        assert data_cli.trim(log, 10_000) == (104, 104), "a log under the limit is left as it is"
    finally:
        writer.close()


def test_data_usage_names_every_part_and_trim_logs_cuts_them(in_dir, capsys):
    data = in_dir / "data"
    (data / "logs").mkdir(parents=True)
    (data / "files").mkdir()
    (data / "logs" / "worker.log").write_bytes(b"x" * 99 + b"\n" + b"y" * (3 * 1024 * 1024))
    (data / "files" / "file-1").write_bytes(b"z" * 2048)
    (data / "holdback.db").write_bytes(b"d" * 4096)
    (data / "local-keys.json").write_text("{}")
    assert data_cli.main(["usage"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"data dir {data.resolve()}\n")
    for part, size in (("logs/", "3.0 MiB"), ("files/", "2.0 KiB"), ("holdback.db", "4.0 KiB"), ("other", "2 B")):
        assert re.search(rf"^  {re.escape(part)}\s+{re.escape(size)} in 1 file\(s\): ", out, re.M), (part, out)
    assert "holdback data trim-logs" in out and "holdback files gc" in out
    assert data_cli.main(["trim-logs", "--keep-mb", "1"]) == 0
    assert capsys.readouterr().out.strip().endswith("worker.log: 3.0 MiB -> 1.0 MiB")
    assert os.path.getsize(data / "logs" / "worker.log") == 1024 * 1024


def test_data_refuses_a_missing_dir_and_a_negative_size(in_dir, capsys):
    with pytest.raises(SystemExit):
        data_cli.main(["usage"])
    assert "no data dir at" in capsys.readouterr().err
    (in_dir / "data").mkdir()
    with pytest.raises(SystemExit):
        data_cli.main(["trim-logs", "--keep-mb", "-1"])
    assert "--keep-mb must be at least 0" in capsys.readouterr().err
