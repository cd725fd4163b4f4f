"""The drills end to end at minimal size: a real stack on simulated replicas, one drill, every gate judged.

This needs the gateway's KV ledger (`kv` in /admin/state, `holdback_gateway_kv_release_seconds`): without
it the release gate cannot be measured and fails, which is the point — a regression in the KV policy or
in what it exports fails here.
"""

from __future__ import annotations

import logging

import pytest

from bench.report import drills as drill_report
from bench.drills.plan import SMOKE
from bench.drills.run import run_drills


@pytest.mark.e2e
def test_cancellation_storm_drill_passes_every_gate(tmp_path):
    logging.getLogger("httpx").setLevel(logging.WARNING)
    run_drills(SMOKE, admission=True, seed=14, out_dir=tmp_path, drills=("storm",))
    _, results = drill_report.render(tmp_path)
    (record, gates), = results
    table = drill_report.console_table(record, gates)
    by_name = {g.name: g for g in gates}
    assert by_name["release after cancel"].status == "pass", table
    assert not [g for g in gates if g.failed], table
    # The storm really ran: its requests were cancelled by the client, and the report was written.
    assert sum(1 for r in record["requests"] if r["phase"] == "storm" and r["status"] == 499) > 0
    assert (tmp_path / "report.md").read_text().count("| release after cancel |") == 1
