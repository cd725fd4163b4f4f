"""Classification: API keys to tenants and objectives, 401/403, fairness id, TTL and deadline headers."""

import math
import time

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.classification import ClassificationError, Classifier
from gateway.settings import parse_config

CONFIG = """
keys:
  - {key: rt-key, tenant: acme, objectives: [realtime, batch]}
  - {key: batch-key, tenant: workers, objectives: [batch], relaysTenants: true}
  - {key: other-key, tenant: beta, objectives: [batch]}
anonymous: {enabled: true, tenant: anon, objectives: [standard, batch]}
"""


def classify(config=CONFIG, **headers):
    h = CIMultiDictProxy(CIMultiDict({k.replace("_", "-"): v for k, v in headers.items()}))
    return Classifier(parse_config(config, "t")).classify(h)


def test_objective_header_gives_priority_and_tenant_is_the_default_fairness_id():
    c = classify(Authorization="Bearer rt-key", x_llm_d_inference_objective="realtime")
    assert (c.objective, c.priority, c.tenant, c.fairness_id) == ("realtime", 100, "acme", "acme")


def test_a_relay_key_names_the_tenant_it_carries_with_its_own_cache_scope():
    c = classify(Authorization="Bearer batch-key", x_gateway_inference_objective="batch",
                 x_llm_d_inference_fairness_id="tenant-7")
    assert (c.priority, c.fairness_id, c.tenant) == (-10, "tenant-7", "workers")
    other = classify(Authorization="Bearer batch-key", x_gateway_inference_fairness_id="tenant-8")
    own = classify(Authorization="Bearer batch-key")
    assert other.fairness_id == "tenant-8" and own.fairness_id == "workers"
    # Each relayed tenant its own prefix-cache scope: one Batch API tenant never hits another's blocks.
    assert len({c.cache_salt, other.cache_salt, own.cache_salt}) == 3


def test_any_other_caller_is_pinned_to_its_tenant_whatever_fairness_header_it_sends():
    keyed = classify(Authorization="Bearer other-key", x_llm_d_inference_fairness_id="tenant-7")
    assert (keyed.fairness_id, keyed.tenant) == ("beta", "beta")
    assert keyed.cache_salt == classify(Authorization="Bearer other-key").cache_salt
    # A keyless client sending a new id per request gets one share between them all, the anonymous tenant's.
    ids = {classify(x_llm_d_inference_fairness_id=f"fresh-{i}").fairness_id for i in range(5)}
    assert ids == {"anon"}
    # Unless the gateway is a bench's own and says its anonymous callers relay tenants.
    relaying = CONFIG.replace("objectives: [standard, batch]}", "objectives: [standard, batch], relaysTenants: true}")
    assert classify(relaying, x_llm_d_inference_fairness_id="t1").fairness_id == "t1"


@pytest.mark.parametrize("value", ["x" * 129, "tab\there"])
def test_a_relayed_tenant_id_too_long_or_unprintable_is_refused(value):
    with pytest.raises(ClassificationError) as exc:
        classify(Authorization="Bearer batch-key", x_llm_d_inference_fairness_id=value)
    assert exc.value.status == 400 and exc.value.code == "invalid_fairness_id" and "printable" in exc.value.message


def test_batch_key_asking_for_realtime_is_forbidden_with_a_clear_message():
    with pytest.raises(ClassificationError) as exc:
        classify(Authorization="Bearer batch-key", x_llm_d_inference_objective="realtime")
    assert exc.value.status == 403 and "realtime" in exc.value.message and "batch" in exc.value.message


def test_no_escalation_through_unknown_or_missing_objective():
    # Unknown names are served as the default objective (priority 0), which a batch key may not use.
    with pytest.raises(ClassificationError) as exc:
        classify(Authorization="Bearer batch-key", x_llm_d_inference_objective="gold")
    assert exc.value.status == 403
    # Missing header: the lowest objective the key allows.
    assert classify(Authorization="Bearer batch-key").priority == -10


def test_anonymous_gets_priority_zero_for_unknown_or_missing():
    assert classify().priority == 0
    assert classify(x_llm_d_inference_objective="whatever").priority == 0
    with pytest.raises(ClassificationError) as exc:
        classify(x_llm_d_inference_objective="realtime")
    assert exc.value.status == 403


def test_unknown_key_is_401_even_with_anonymous_access():
    with pytest.raises(ClassificationError) as exc:
        classify(Authorization="Bearer nope")
    assert exc.value.status == 401


def test_missing_key_is_401_without_anonymous_access():
    config = CONFIG.replace("enabled: true", "enabled: false")
    with pytest.raises(ClassificationError) as exc:
        classify(config)
    assert exc.value.status == 401 and "Authorization" in exc.value.message


def test_without_keys_any_bearer_is_anonymous():
    c = classify("anonymous: {objectives: ['*']}", Authorization="Bearer EMPTY",
                 x_llm_d_inference_objective="realtime")
    assert (c.priority, c.tenant) == (100, "anonymous")


def test_ttl_and_deadline_headers_smaller_wins():
    c = classify(x_holdback_ttl="30")
    assert c.wait_limit == 30 and c.deadline_in == math.inf
    c = classify(x_holdback_ttl="30", x_holdback_deadline=str(time.time() + 5))
    assert 3 < c.wait_limit <= 5 and c.deadline_in == pytest.approx(c.wait_limit)
    with pytest.raises(ClassificationError) as exc:
        classify(x_holdback_ttl="soon")
    assert exc.value.status == 400 and "x-holdback-ttl" in exc.value.message


def test_the_old_llm_d_prefixed_ttl_header_is_still_accepted_and_named_in_its_errors():
    assert classify(x_llm_d_inference_ttl="12").wait_limit == 12
    assert classify(x_holdback_ttl="7", x_llm_d_inference_ttl="12").wait_limit == 7  # the new name wins
    with pytest.raises(ClassificationError) as exc:
        classify(x_llm_d_inference_ttl="-1")
    assert exc.value.status == 400 and "x-llm-d-inference-ttl" in exc.value.message


@pytest.mark.parametrize("authorization", ["Basic dXNlcjpwYXNz", "Bearer", "Bearer ", "bearer", "Token rt-key"])
def test_malformed_authorization_is_401_when_keys_are_configured(authorization):
    with pytest.raises(ClassificationError) as exc:
        classify(Authorization=authorization)
    assert exc.value.status == 401 and exc.value.code == "invalid_authorization"
    assert "Bearer KEY" in exc.value.message
    # Without keys the gateway authenticates nobody, so the header is ignored.
    assert classify("anonymous: {objectives: ['*']}\n", Authorization=authorization).tenant == "anonymous"


def test_admin_routes_need_an_admin_key_once_any_key_is_configured():
    open_gateway = Classifier(parse_config("", "t"))
    open_gateway.admin(None)  # no keys at all: open, like the inference routes
    closed = Classifier(parse_config(CONFIG, "t"))
    with pytest.raises(ClassificationError, match="no adminKeys"):
        closed.admin("Bearer rt-key")
    gated = Classifier(parse_config(CONFIG + "adminKeys: [{key: adm}]\n", "t"))
    gated.admin("Bearer adm")
    for header, status in ((None, 401), ("Basic x", 401), ("Bearer rt-key", 403)):
        with pytest.raises(ClassificationError) as exc:
            gated.admin(header)
        assert exc.value.status == status
