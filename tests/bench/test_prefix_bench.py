"""bench/prefix.py: documents × questions through the Batch API in file order and with the processor's prefix plan."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from bench.prefix import branched_conversations, lines, main, one_system_prompt
from bench.real_engine.prefix import completion_lines, parse


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


def test_one_system_prompt_is_every_lines_prefix_and_the_inputs_are_each_lines_own():
    texts = [text for _, text in one_system_prompt(20, 100, seed=3)]
    heads = {text.split("\n\n")[0] for text in texts}
    assert len(texts) == 20 and len(heads) == 1 and len(next(iter(heads)).split()) == 100
    assert len({text.split("\n\n")[1] for text in texts}) == 20


def test_branched_conversations_share_prefixes_of_different_lengths_within_a_conversation_only():
    lines = branched_conversations(4, 6, 100, seed=3)
    assert len(lines) == 24 and [cid for cid, _ in lines] != sorted(cid for cid, _ in lines)
    by = {}
    for cid, text in lines:
        by.setdefault(cid.split("-")[0], []).append(text)
    firsts = {c: {t.split("\n")[0] for t in texts} for c, texts in by.items()}
    assert all(len(f) == 1 for f in firsts.values()) and len(set().union(*firsts.values())) == 4
    depths = {t.count("Assistant:") for texts in by.values() for t in texts}
    assert len(depths) > 1 and depths <= {1, 2, 3, 4, 5}


@pytest.mark.parametrize("workload", ["shared", "no-shared", "system-prompt", "branched"])
def test_the_real_engine_study_sends_each_workload_as_completions_of_its_size(workload: str) -> None:
    _, args = parse(["--documents", "3", "--questions", "4", "--doc-words", "50", "--max-tokens", "5"])
    lines = completion_lines(args, "m", workload, seed=1)
    assert len(lines) == 12 and all(x["model"] == "m" and x["max_tokens"] == 5 for x in lines)
    assert all(x["prompt"].startswith("Answer from the document.\n\n") for x in lines)
