"""The contract between processes is spelled once: every header, drop reason and the job function path appear
as a string literal only in `holdback/contract.py` among the repository's non-test Python files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from holdback import contract
from holdback.contract import DropReason, is_eviction, is_no_endpoints
from holdback.attempts import classify
from holdback.models import AttemptOutcome

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {"tests", ".venv", "node_modules", ".git", "data"}


def _sources() -> list[Path]:
    return [p for p in ROOT.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(ROOT).parts)
            and p != ROOT / "holdback" / "contract.py"]


def _contract_names() -> list[str]:
    names = [v for k, v in vars(contract).items() if k.endswith("_HEADER") and isinstance(v, str)]
    names += [v for k, v in vars(contract).items() if k.endswith("_ALIASES") or k == "REPLICA_HEADERS" for v in v]
    # "evicted" is also a value of the attempt-outcome and gateway-status enums (different names that happen
    # to share the word), so only the reasons no other enum uses are checked here.
    names += [r.value for r in DropReason if r is not DropReason.EVICTED]
    names.append(contract.JOB_FUNCTION)
    return sorted(set(names))


def test_every_contract_name_is_spelled_once_outside_tests():
    sources = {p: p.read_text(encoding="utf-8") for p in _sources()}
    assert len(sources) > 50  # the walk found the repository, not an empty directory
    spelled = {}
    for name in _contract_names():
        literal = re.compile(r"""(['"])""" + re.escape(name) + r"\1")
        where = [str(p.relative_to(ROOT)) for p, text in sources.items() if literal.search(text)]
        if where:
            spelled[name] = where
    assert spelled == {}, f"import these from holdback.contract instead: {spelled}"


def test_the_checker_sees_a_literal_spelling():
    literal = re.compile(r"""(['"])""" + re.escape(contract.DROP_REASON_HEADER) + r"\1")
    assert literal.search((ROOT / "holdback" / "contract.py").read_text())


@pytest.mark.parametrize("reason,evicted", [
    ("evicted", True), ("evicted-kv-pressure", True), ("Evicted-Preempted ", True),
    ("evictedx", False), ("rejected-saturated", False), ("", False), (None, False),
])
def test_drop_reasons_match_by_family(reason, evicted):
    assert is_eviction(reason) is evicted


def test_an_llm_d_evicted_refinement_is_counted_as_an_eviction_and_no_endpoints_as_a_path_failure():
    out = classify(429, {contract.DROP_REASON_HEADER: "evicted-by-priority"})
    assert out.kind is AttemptOutcome.evicted and out.evicted and out.shed
    assert classify(429, {contract.DROP_REASON_HEADER: "rejected-saturated"}).kind is AttemptOutcome.rejected
    assert is_no_endpoints("rejected-no-endpoints") and not is_no_endpoints("rejected-saturated")
    down = classify(503, {contract.DROP_REASON_HEADER: "rejected-no-endpoints-zone-a"})
    assert down.path_failure and not down.transient


def test_every_redis_name_lives_under_the_namespace():
    ns = "ns-x"
    names = [contract.requests_queue_name(ns), contract.cancel_channel(ns), contract.circuit_key(ns),
             contract.pause_key(ns, "q"), contract.dashboard_samples_key(ns), contract.dashboard_slot_key(ns, 3),
             contract.worker_name(ns, "host", 1)]
    assert all(n.startswith(ns) for n in names) and len(set(names)) == len(names)
    assert contract.requests_queue_name(ns).startswith(contract.queue_name_prefix(ns))


def test_the_inference_endpoints_are_one_table_looked_up_by_path():
    assert len(set(contract.INFERENCE_PATHS)) == len(contract.INFERENCE_ENDPOINTS)
    for endpoint in contract.INFERENCE_ENDPOINTS:
        assert contract.inference_endpoint(endpoint.path) is endpoint
        # What generates has an output limit to read; what does not (embeddings) has none.
        assert bool(endpoint.limit_params) is endpoint.generates
    assert contract.inference_endpoint("/v1/models") is None
    assert [e.path for e in contract.INFERENCE_ENDPOINTS if e.resumable] == ["/v1/chat/completions",
                                                                            "/v1/completions"]
