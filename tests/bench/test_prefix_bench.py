"""bench/prefix.py: documents × questions through the Batch API in file order and with the processor's prefix plan."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from bench.prefix import lines, main


def test_the_file_is_documents_by_questions_shuffled_and_the_unshared_one_shares_no_document():
    shared = [json.loads(x) for x in lines(4, 3, 50, 8, True, seed=1).splitlines()]
    assert len(shared) == 12 and [x["custom_id"] for x in shared] != sorted(x["custom_id"] for x in shared)
    docs = Counter(x["body"]["messages"][1]["content"].split("\n\n")[0] for x in shared)
    assert sorted(docs.values()) == [3, 3, 3, 3]
    alone = [json.loads(x) for x in lines(4, 3, 50, 8, False, seed=1).splitlines()]
    assert len({x["body"]["messages"][1]["content"].split("\n\n")[0] for x in alone}) == 12


@pytest.mark.e2e
def test_one_round_on_one_replica_reports_both_arms_and_the_plan_hits_the_cache_more(tmp_path: Path) -> None:
    report = main(["--rounds", "1", "--replicas", "1", "--documents", "12", "--questions", "5", "--doc-tokens", "400",
                   "--num-blocks", "300", "--max-num-seqs", "4", "--out", str(tmp_path)])
    (setting,) = report["settings"]
    assert {r["arm"] for r in setting["runs"]} == {"file-order", "plan"}
    assert all(r["requests"] == 60 and r["tokens_per_second"] > 0 for r in setting["runs"])
    assert setting["hit_rate"]["plan"]["value"] > setting["hit_rate"]["file-order"]["value"]
    assert setting["tokens_per_second_ratio"]["value"] > 0
    assert json.loads((tmp_path / "results.json").read_text())["settings"][0]["setting"] == "1-replica"
