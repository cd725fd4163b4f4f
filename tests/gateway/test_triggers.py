"""The eviction triggers' registry is the one list: every `Trigger` but the replica-queue follow-up has exactly
one trigger object, and the gateway's README lists them in the order they run."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.flow.request import Trigger
from gateway.flow.triggers import TRIGGERS

pytestmark = pytest.mark.unit

README = Path(__file__).resolve().parents[2] / "gateway" / "README.md"


def test_every_trigger_has_one_object_and_the_follow_up_none():
    named = [t.trigger for t in TRIGGERS]
    assert sorted(named, key=lambda t: t.value) == sorted(set(Trigger) - {Trigger.REPLICA_QUEUE},
                                                          key=lambda t: t.value)
    assert len(named) == len(set(named))


def test_the_readme_lists_the_triggers_in_the_order_they_run():
    text = README.read_text()
    table = text[text.index("| trigger | stage | evicts |"):].split("\n\n")[0]
    rows = [line.split("|")[1].strip().strip("`") for line in table.splitlines()[2:]]
    assert rows == [t.trigger.value for t in TRIGGERS]
