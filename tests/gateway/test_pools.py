"""Model pools in the config and in routing: each pool's own settings over the top-level ones, the mistakes a
config can make with pools (and the message naming what to change), and how a `model` picks its pool."""

import pytest

from gateway.metrics import GatewayMetrics
from gateway.pools import DEFAULT_POOL, ModelPools, PoolRouting
from gateway.replicas import Replica, ReplicaPool
from gateway.settings import ConfigError, parse_config, with_admission, with_replicas

A1, A2, B = "http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"
TWO_POOLS = f"""
saturation: {{maxConcurrency: 8}}
admission: {{enabled: false}}
pools:
  - {{name: pool-a, models: [model-a, alias-a], replicas: [{A1}, {A2}]}}
  - name: pool-b
    models: [model-b]
    replicas: [{B}]
    endpoints: [/v1/completions]
    saturation: {{maxConcurrency: 2}}
    usageLimit: {{policy: static, threshold: 0.9}}
    engine: {{maxNumSeqs: 4}}
"""


def test_a_pools_own_keys_replace_the_top_level_ones_and_the_rest_are_the_top_levels():
    cfg = parse_config(TWO_POOLS, "pools.yaml").config
    a, b = (cfg.of_pool(p) for p in cfg.pools)
    assert a.replicas == [A1, A2] and b.replicas == [B]
    assert a.saturation.maxConcurrency == 8 and b.saturation.maxConcurrency == 2
    assert b.saturation.detector == a.saturation.detector == "concurrency"  # merged key by key
    assert (a.usageLimit.threshold, b.usageLimit.policy, b.usageLimit.threshold) == (1.0, "static", 0.9)
    assert b.engine.maxNumSeqs == 4 and a.engine.maxNumSeqs is None and b.capacity(B) == 4
    assert a.admission.enabled is b.admission.enabled is False
    assert cfg.pools[1].endpoints == ["/v1/completions"] and cfg.pools[0].endpoints is None


@pytest.mark.parametrize("text, says", [
    (f"pools:\n  - {{name: a, models: [m], replicas: [{A1}]}}\n  - {{name: b, models: [m], replicas: [{B}]}}\n",
     "model 'm' is in pools 'a' and 'b'"),
    (f"pools:\n  - {{name: a, models: [m], replicas: [{A1}]}}\n  - {{name: b, models: [n], replicas: [{A1}/]}}\n",
     f"replica '{A1}' is in pools 'a' and 'b'"),
    (f"replicas: [{A1}]\npools:\n  - {{name: a, models: [m], replicas: [{A1}]}}\n",
     f"replica '{A1}' is listed in `replicas` and in pools 'a'"),
    ("pools:\n  - {name: a, models: [m]}\n  - {name: a, models: [n]}\n", "two pools are named 'a'"),
    ("pools:\n  - {name: a, models: [m], replica: []}\n", "pools.0.replica: Extra inputs are not permitted"),
    ("pools:\n  - {name: a, models: [m], admission: {kvPoolGB: 4}}\n",
     "pools['a']: admission.kvPoolGB: Extra inputs are not permitted"),
    ("pools:\n  - {name: a, models: [m], health: {intervalSeconds: 2}}\n",
     "pools.0.health: Extra inputs are not permitted"),
    ("pools:\n  - {name: a, models: []}\n", "pools.0.models: List should have at least 1 item"),
    ("pools:\n  - {name: a, models: [m], endpoints: [/v1/chat]}\n", "pools.0.endpoints.0: Input should be"),
])
def test_a_config_with_a_pool_mistake_is_refused_naming_it(text, says):
    with pytest.raises(ConfigError) as exc:
        parse_config(text, "pools.yaml")
    assert says in str(exc.value), str(exc.value)


def test_replicas_from_the_command_line_join_a_config_with_pools_grouped_by_model():
    loaded = with_replicas(parse_config(TWO_POOLS, "pools.yaml"), ["http://127.0.0.1:9004"])
    assert loaded.config.replicas == ["http://127.0.0.1:9004"] and len(loaded.config.pools) == 2
    with pytest.raises(ConfigError, match="is listed in `replicas` and in pools 'pool-b'"):
        with_replicas(loaded, [B])


def test_a_model_picks_its_pool_an_absent_one_the_first_and_an_unknown_one_none():
    routing = PoolRouting([{"name": "pool-a", "models": ["model-a", "alias-a"], "endpoints": None, "configured": True},
                           {"name": "pool-b", "models": ["model-b", "lora-b"], "endpoints": ["/v1/completions"],
                            "configured": True}])
    assert [routing.route(m) for m in ("model-a", "alias-a", "model-b", "lora-b")] == ["pool-a"] * 2 + ["pool-b"] * 2
    assert routing.route(None) == routing.route("") == routing.route(7) == "pool-a"
    assert routing.route("model-c") is None
    assert routing.served() == ["model-a", "alias-a", "model-b", "lora-b"]
    assert routing.endpoints("pool-b") == ("/v1/completions",) and routing.endpoints("pool-a") is None


def _identify(pools: ModelPools, url: str, *listed: tuple[str, str | None]) -> Replica:
    replica = next(r for r in pools.shared.replicas if r.url == url)
    replica.model, replica.listed, replica.identified, replica.healthy = listed[0][0], tuple(listed), True, True
    pools.shared.on_identify(replica)
    return replica


def test_replicas_without_pools_are_grouped_by_the_model_they_report():
    loaded = parse_config(f"replicas: [{A1}, {A2}, {B}]\nadmission: {{enabled: false}}\n", "auto.yaml")
    pools = ModelPools(loaded, ReplicaPool([]), GatewayMetrics())
    # Before any replica said what it serves they are all in `default`, which takes any model.
    assert list(pools.pools) == [DEFAULT_POOL] and len(pools.pools[DEFAULT_POOL].replicas.replicas) == 3
    assert pools.routing().route("whatever") == DEFAULT_POOL
    _identify(pools, A1, ("model-a", None))
    _identify(pools, B, ("model-b", None), ("lora-b", "model-b"))
    _identify(pools, A2, ("model-a", None), ("alias-a", None))
    assert {name: (p.served(), [r.url for r in p.replicas.replicas]) for name, p in pools.pools.items()} == {
        DEFAULT_POOL: (["model-a", "alias-a"], [A1, A2]), "model-b": (["model-b", "lora-b"], [B])}
    routing = pools.routing()
    assert [routing.route(m) for m in ("alias-a", "lora-b", "model-c")] == [DEFAULT_POOL, "model-b", None]
    assert [r.url for r in pools.flow("model-b").pool.healthy()] == [B]


def test_a_replica_listed_without_a_pool_joins_the_configured_pool_of_its_model():
    loaded = with_replicas(parse_config(TWO_POOLS, "pools.yaml"), ["http://127.0.0.1:9004", "http://127.0.0.1:9005"])
    pools = ModelPools(loaded, ReplicaPool([]), GatewayMetrics())
    assert [p.name for p in pools.ordered()] == ["pool-a", "pool-b"]
    _identify(pools, "http://127.0.0.1:9004", ("model-b", None))
    _identify(pools, "http://127.0.0.1:9005", ("model-c", None))
    assert [r.url for r in pools.pools["pool-b"].replicas.replicas] == [B, "http://127.0.0.1:9004"]
    assert pools.flow("pool-b").pool.replicas[1].capacity == 4  # pool-b's engine settings apply to it
    assert pools.routing().route("model-c") == "model-c" and pools.default().name == "pool-a"


def test_a_rollback_turns_admission_on_in_every_pool_keeping_a_pools_lower_watermark():
    text = (f"admission: {{enabled: false, admissionWatermark: 0.8}}\npools:\n"
            f"  - {{name: a, models: [m], replicas: [{A1}], admission: {{enabled: false, admissionWatermark: 0.6}}}}\n"
            f"  - {{name: b, models: [n], replicas: [{B}], admission: {{enabled: false}}}}\n"
            f"  - {{name: c, models: [o], replicas: [{A2}]}}\n")
    rolled = with_admission(parse_config(text, "pools.yaml"), enabled=True, admissionWatermark=0.7).config
    a, b, c = (rolled.of_pool(p).admission for p in rolled.pools)
    assert a.enabled and b.enabled and c.enabled, "a pool's own `enabled: false` must not outlast a rollback"
    assert (a.admissionWatermark, b.admissionWatermark, c.admissionWatermark) == (0.6, 0.7, 0.7)
