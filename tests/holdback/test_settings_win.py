"""Settings beat stored defaults: flags from HOLDBACK_<COMPONENT>_<FLAG>, the admin key from the
environment over the one `holdback up` stored, and the pid-file lock of `holdback up`. No process starts."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from async_processor.cli import _parser as worker_parser
from async_processor.config import WorkerSettings
from batch_processor.cli import _parser as processor_parser
from gateway.cli import _parser as gateway_parser
from holdback.db import make_engine, make_sessionmaker
from holdback.env_flags import flag_env_name, flags_from_env
from holdback.cli.instance_lock import LOCK_FILE, AlreadyRunning, InstanceLock, holder_pid
from holdback.schema import upgrade
from holdback.settings import Settings
from holdback.cli.up import LOCAL_KEYS, _parser as up_parser, local_keys
from model_sim.cli import build_parser as sim_parser


def _demo_parser():
    from holdback.cli.demo import _parser

    return _parser(Settings())


def _toy(environ: dict[str, str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="toy", exit_on_error=False)
    p.add_argument("--port", type=int, default=1)
    p.add_argument("--rate", type=float, default=0.5)
    p.add_argument("--mode", choices=["a", "b"], default="a")
    p.add_argument("--fast", action="store_true")
    p.add_argument("--extra", action="append", default=[])
    p.add_argument("--name", required=True)
    return flags_from_env(p, "toy", environ)


def test_every_flag_type_reads_its_variable_and_the_command_line_wins():
    env = {"HOLDBACK_TOY_PORT": "8080", "HOLDBACK_TOY_RATE": "2.5", "HOLDBACK_TOY_MODE": "b",
           "HOLDBACK_TOY_FAST": "true", "HOLDBACK_TOY_EXTRA": "--x=1 '--y 2'", "HOLDBACK_TOY_NAME": "n"}
    args = _toy(env).parse_args([])
    assert (args.port, args.rate, args.mode, args.fast, args.extra, args.name) == (8080, 2.5, "b", True,
                                                                                  ["--x=1", "--y 2"], "n")
    assert _toy(env).parse_args(["--port", "9", "--name", "cli"]).port == 9
    assert _toy({"HOLDBACK_TOY_FAST": "0", "HOLDBACK_TOY_NAME": "n"}).parse_args([]).fast is False
    assert "HOLDBACK_TOY_<FLAG>" in _toy({}).format_help()


@pytest.mark.parametrize("var,value,message", [
    ("HOLDBACK_TOY_PORT", "eighty", "HOLDBACK_TOY_PORT='eighty' is not valid for --port"),
    ("HOLDBACK_TOY_MODE", "c", "HOLDBACK_TOY_MODE='c': choose one of a, b"),
    ("HOLDBACK_TOY_FAST", "maybe", "HOLDBACK_TOY_FAST='maybe': use one of"),
])
def test_a_bad_variable_fails_naming_it(var, value, message, capsys):
    with pytest.raises(SystemExit):
        _toy({var: value})
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("build,component,flag,dest,raw,value", [
    (gateway_parser, "gateway", "--port", "port", "9201", 9201),
    (lambda: worker_parser(WorkerSettings()), "worker", "--drain-timeout", "drain_timeout", "7.5", 7.5),
    (processor_parser, "processor", "--poll-interval", "poll_interval", "0.25", 0.25),
    (sim_parser, "sim", "--decode-base-ms", "decode_base_ms", "3", 3.0),
    (up_parser, "up", "--worker-concurrency", "worker_concurrency", "8", 8),
    (_demo_parser, "demo", "--realtime-rate", "realtime_rate", "2", 2.0),
])
def test_each_component_reads_its_flags_from_the_environment(monkeypatch, build, component, flag, dest, raw, value):
    name = flag_env_name(component, flag)
    monkeypatch.setenv(name, raw)
    argv = ["--port", "1"] if component == "sim" else []
    assert getattr(build().parse_args(argv), dest) == value


def test_the_sim_port_from_the_environment_satisfies_its_required_flag(monkeypatch):
    monkeypatch.setenv("HOLDBACK_SIM_PORT", "8400")
    assert sim_parser().parse_args([]).port == 8400


def test_the_admin_key_from_the_environment_replaces_the_stored_one(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'holdback.db'}")
    upgrade(engine)
    sessions = make_sessionmaker(engine)
    first = local_keys(Settings(data_dir=tmp_path, admin_key=None), sessions)
    assert first["admin"].startswith("hb-admin-")
    kept = local_keys(Settings(data_dir=tmp_path, admin_key=None), sessions)
    assert kept == first, "without HOLDBACK_ADMIN_KEY the stored keys stay"
    chosen = local_keys(Settings(data_dir=tmp_path, admin_key="hb-admin-mine"), sessions)
    assert chosen == {**first, "admin": "hb-admin-mine"}
    stored = json.loads((tmp_path / LOCAL_KEYS).read_text())
    assert stored["admin"] == "hb-admin-mine" and (tmp_path / LOCAL_KEYS).stat().st_mode & 0o077 == 0
    engine.dispose()


def test_a_second_lock_on_one_data_dir_is_refused_naming_the_holder(tmp_path):
    lock = InstanceLock.acquire(tmp_path)
    try:
        with pytest.raises(AlreadyRunning, match=f"pid {os.getpid()} holds"):
            InstanceLock.acquire(tmp_path)
    finally:
        lock.release()
    InstanceLock.acquire(tmp_path).release()  # released: free again


def test_a_pid_file_left_by_a_dead_process_does_not_block(tmp_path):
    (tmp_path / LOCK_FILE).write_text("999999999\n")  # no such pid, and nobody holds the lock
    assert holder_pid(tmp_path / LOCK_FILE) is None
    lock = InstanceLock.acquire(tmp_path)
    assert (tmp_path / LOCK_FILE).read_text().strip() == str(os.getpid())
    lock.release()
