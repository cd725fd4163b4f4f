"""Backends for tests: each test gets its own database and its own Redis namespace.

HOLDBACK_TEST_BACKEND=embedded (default): SQLite in a fresh data dir and an embedded Redis for it.
HOLDBACK_TEST_BACKEND=services: a fresh PostgreSQL database cloned from a migrated template, and
the machine's Redis with a per-test namespace. `make test` runs the suite once with each.

Every test that starts no process (no `backend`, no child processes) is marked `unit` at collection;
`make test-fast` runs only those. A unit test that starts a process anyway fails, naming the fix.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import redis
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from holdback.broker import ensure_embedded_redis, stop_embedded_redis
from holdback.db import make_engine
from holdback.schema import upgrade
from holdback.settings import Settings
from bench.lib import forkserver
from tests import reaper

BACKEND = os.environ.get("HOLDBACK_TEST_BACKEND", "embedded")
POSTGRES_URL = os.environ.get("HOLDBACK_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("HOLDBACK_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
ADMIN_KEY = "hb-admin-test-key"
# What a test's own HTTP calls wait for an answer, unless the call says (`timeout=`). httpx's default, 5 s, is less
# than a server under test can take on a loaded two-core machine: an API in a test's own process took longer to
# answer a 404 beside two CPU burners and four test workers. Set here once for every httpx call in the test
# processes (not in the processes the tests start, which set their own).
TEST_HTTP_TIMEOUT = httpx.Timeout(60.0)
for _call in (httpx.request, httpx.get, httpx.options, httpx.head, httpx.post, httpx.put, httpx.patch, httpx.delete,
              httpx.stream.__wrapped__, httpx.Client.__init__, httpx.AsyncClient.__init__):
    _call.__kwdefaults__["timeout"] = TEST_HTTP_TIMEOUT
# Fixtures that start processes (the embedded Redis, simulators, gateways, workers): their tests are not unit.
PROCESS_FIXTURES = {"backend", "stack", "scripted", "platform_factory", "browser", "vllm", "one_at_a_time_vllm"}
# A module that imports these can start processes itself (`holdback ...` children via tests.support).
PROCESS_NAMES = ("subprocess", "Processes", "forkserver")
NOT_UNIT_MARKERS = ("e2e", "browser")


# Fixtures whose behaviour depends on the backend (the database, Redis): the services pass runs only the tests that
# use one, or that are marked `services` (they need the PostgreSQL and Redis servers themselves and run only there);
# every other test would only repeat the embedded pass.
BACKEND_FIXTURES = {"backend", "_pg_template"}
SERVICES_FIXTURES = {"empty_postgres"}
FAILURE_DIR = os.environ.get("HOLDBACK_TEST_FAILURE_DIR", "")
_FAILED = pytest.StashKey[list]()


def pytest_configure(config):  # noqa: ANN001
    report_dir = Path(FAILURE_DIR) if FAILURE_DIR else None
    if report_dir is not None:
        report_dir.mkdir(parents=True, exist_ok=True)
    reaper.watch(report_dir)
    forkserver.enable()  # after the reaper's token is in the environment: the server and its forks carry it


@pytest.hookimpl(tryfirst=True)  # before the tier's own order (tests/real_vllm/conftest.py), which it keeps
def pytest_collection_modifyitems(config, items):  # noqa: ANN001
    for item in items:
        if SERVICES_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.services)
    here, elsewhere = [], []
    for item in items:
        (here if _in_this_pass(item) else elsewhere).append(item)
    if elsewhere:
        config.hook.pytest_deselected(items=elsewhere)
        items[:] = here
    for item in items:
        if any(item.get_closest_marker(m) for m in NOT_UNIT_MARKERS) or PROCESS_FIXTURES & set(item.fixturenames):
            continue
        module = getattr(item, "module", None)
        if module is not None and any(name in vars(module) for name in PROCESS_NAMES):
            continue
        item.add_marker(pytest.mark.unit)
    items.sort(key=_cost_rank)


def _cost_rank(item) -> int:  # noqa: ANN001
    """The slow first, the unit tests last (a stable sort: each group keeps its order). Under xdist a pass ends when
    its last test does: a 70 s drill handed out last kept one worker busy while the others sat idle (the embedded
    pass's last minute on four workers); handed out first, the seconds-long unit tests fill the end instead."""
    if item.get_closest_marker("e2e") or item.get_closest_marker("browser"):
        return 0
    return 2 if item.get_closest_marker("unit") else 1


def _in_this_pass(item) -> bool:  # noqa: ANN001
    on_services = item.get_closest_marker("services") is not None
    if BACKEND == "services":
        return on_services or bool(BACKEND_FIXTURES & set(item.fixturenames))
    return not on_services


@pytest.fixture(autouse=True)
def _unit_starts_no_process(request, monkeypatch):  # noqa: ANN001
    """Keep the `unit` marker true: a unit test that starts a child process fails at once."""
    if request.node.get_closest_marker("unit") is None:
        return

    def refused(args) -> AssertionError:  # noqa: ANN001
        return AssertionError(f"a unit test started a process ({args!r}): mark the test e2e, or add the fixture "
                              "that starts it to PROCESS_FIXTURES in tests/conftest.py")

    def refuse(self, args, *rest, **kw):  # noqa: ANN001
        if list(args)[:1] == ["fc-list"]:
            # matplotlib's font manager lists the system's fonts once, the first time it is imported on a machine
            # (it then keeps a cache): a library's own probe, not a process the test starts.
            return real(self, args, *rest, **kw)
        raise refused(args)

    def refuse_fork(self, args, **kw):  # noqa: ANN001 - a child this process's fork server would fork
        raise refused(args)

    real = subprocess.Popen._execute_child
    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(forkserver.ForkServer, "spawn", refuse_fork)


@dataclass
class Backend:
    """Everything a holdback process needs to find this test's database and Redis."""

    kind: str
    data_dir: Path
    database_url: str
    redis_url: str
    namespace: str
    admin_key: str = ADMIN_KEY
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        return {
            "HOLDBACK_DATA_DIR": str(self.data_dir),
            "DATABASE_URL": self.database_url,
            "REDIS_URL": self.redis_url,
            "HOLDBACK_REDIS_NAMESPACE": self.namespace,
            "HOLDBACK_ADMIN_KEY": self.admin_key,
            **self.extra_env,
        }

    def settings(self, **overrides) -> Settings:
        values = dict(
            data_dir=self.data_dir,
            database_url=self.database_url,
            redis_url=self.redis_url,
            redis_namespace=self.namespace,
            admin_key=self.admin_key,
        )
        values.update(overrides)
        return Settings(**values)

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url)


@pytest.fixture(scope="session")
def _pg_template() -> Iterator[str | None]:
    if BACKEND != "services":
        yield None
        return
    name = f"hb_tmpl_{os.getpid()}"
    admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False)
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    yield name
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def backend(_pg_template: str | None) -> Iterator[Backend]:
    # Short path: the embedded Redis listens on a unix socket whose path must stay under ~100 chars.
    data_dir = Path(tempfile.mkdtemp(prefix="hbt-"))
    tag = uuid.uuid4().hex[:10]
    namespace = f"hbt-{tag}"
    if BACKEND == "services":
        db = f"hbt_{tag}"
        admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{db}" TEMPLATE "{_pg_template}"'))
        database_url = make_url(POSTGRES_URL).set(database=db).render_as_string(hide_password=False)
        b = Backend("services", data_dir, database_url, REDIS_URL, namespace)
        try:
            yield b
        finally:
            r = b.redis()
            for key in r.scan_iter(match=f"*{namespace}*", count=1000):
                r.delete(key)
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'))
            admin.dispose()
            shutil.rmtree(data_dir, ignore_errors=True)
    else:
        database_url = f"sqlite:///{data_dir / 'holdback.db'}"
        engine = make_engine(database_url)
        upgrade(engine)
        engine.dispose()
        redis_url = ensure_embedded_redis(data_dir)
        try:
            yield Backend("embedded", data_dir, database_url, redis_url, namespace)
        finally:
            stop_embedded_redis(data_dir)
            shutil.rmtree(data_dir, ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):  # noqa: ANN001
    """With HOLDBACK_TEST_FAILURE_DIR set (`.ci/run` sets it), a failed test leaves its error and its children's
    logs there, and a line `BACKEND nodeid: first error line` in failures.txt."""
    report = yield
    if FAILURE_DIR:
        if report.failed:
            item.stash.setdefault(_FAILED, []).append(report)
        if report.when == "teardown" and item.stash.get(_FAILED, None):
            _record_failure(item, item.stash[_FAILED])
    return report


def _record_failure(item, reports) -> None:  # noqa: ANN001
    root = Path(FAILURE_DIR)
    here = root / BACKEND / re.sub(r"[^A-Za-z0-9_.-]+", "_", item.nodeid)[:150]
    here.mkdir(parents=True, exist_ok=True)
    with (here / "error.txt").open("w") as out:
        for report in reports:
            out.write(f"===== {report.when}: {item.nodeid}\n{report.longreprtext}\n")
            for title, content in report.sections:
                out.write(f"----- {title}\n{content}\n")
    crash = getattr(reports[0].longrepr, "reprcrash", None)
    first = (crash.message if crash is not None else reports[0].longreprtext).strip().splitlines() or ["?"]
    with (root / "failures.txt").open("a") as out:
        out.write(f"{BACKEND} {item.nodeid}: {first[0][:300]}\n")
    tmp = item.funcargs.get("tmp_path")
    budget = 50 << 20  # the logs a failure keeps, at most
    for log in sorted(tmp.rglob("*.log")) if tmp is not None else ():
        size = log.stat().st_size
        if log.is_file() and size <= budget:
            target = here / "logs" / log.relative_to(tmp)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(log, target)
            budget -= size
