"""Config loading: defaults, the shipped file, key_env resolution, digests and clear rejections."""

import pytest

from gateway.settings import ConfigError, DEFAULT_CONFIG_PATH, load_config, parse_config, with_replicas


def test_shipped_default_is_the_seed_operating_point():
    loaded = load_config(None, env={})
    cfg = loaded.config
    assert loaded.source == str(DEFAULT_CONFIG_PATH)
    assert loaded.digest.startswith("sha256:") and len(loaded.digest) == 7 + 64
    assert cfg.saturation.detector == "concurrency" and cfg.saturation.maxConcurrency == 48
    assert cfg.eviction.enabled and cfg.eviction.maxPerDecision == 2
    assert {n: o.priority for n, o in cfg.objectives.items()} == {"realtime": 100, "standard": 0, "batch": -10}
    assert cfg.band_priorities() == [100, 0, -10]
    assert loaded.keys == ()  # every key comes from an unset env var here
    assert set(loaded.skipped_key_envs) == {"HOLDBACK_GATEWAY_REALTIME_KEY", "HOLDBACK_GATEWAY_STANDARD_KEY",
                                            "HOLDBACK_GATEWAY_BATCH_KEY", "HOLDBACK_ADMIN_KEY"}
    # KV admission is on with the seed's values; callers without a key may only use batch.
    adm = cfg.admission
    assert adm.enabled and (adm.admissionWatermark, adm.batchPauseWatermark, adm.hardWatermark) == (0.82, 0.88, 0.92)
    assert (adm.interactiveReserve, adm.tenantMaxShare, adm.queueDeadlineMs, adm.maxNewTokensDefault) == (
        0.25, 0.15, 8000, 1024)
    assert (adm.kvPoolGiB, adm.blockTokens) == (52, 16)
    assert cfg.anonymous.objectives == ["batch"] and cfg.eviction.policy == "least-refill"
    # No reserve (eviction takes back what realtime needs), slots learned: the same as an empty file's.
    empty = parse_config("", "empty.yaml").config
    assert cfg.usageLimit == empty.usageLimit and cfg.engine == empty.engine
    assert (cfg.usageLimit.policy, cfg.usageLimit.threshold, cfg.engine.learnMaxNumSeqs) == ("static", 1.0, True)


def test_key_env_resolves_from_the_given_environment():
    loaded = load_config(None, env={"HOLDBACK_GATEWAY_BATCH_KEY": "bk"})
    assert [(k.key, k.tenant, sorted(k.objectives)) for k in loaded.keys] == [("bk", "batch", ["batch"])]


def test_empty_file_means_built_in_defaults():
    cfg = parse_config("", "empty.yaml").config
    assert cfg.usageLimit.policy == "static" and cfg.usageLimit.threshold == 1.0
    assert cfg.usageLimit.reserve().margin == 0.05 and cfg.engine.learnMaxNumSeqs is True
    assert cfg.flowControl.defaultRequestTTL == 60
    assert cfg.admission.enabled is True and cfg.admission.queueDeadlineMs == 8000


def test_band_settings_merge_over_default_band():
    cfg = parse_config("flowControl:\n  defaultRequestTTL: 30\n  bands:\n    - {priority: -10, maxRequests: 7, "
                       "ceiling: 0.4, ordering: edf}\n", "x").config
    b = cfg.band_settings(-10)
    assert (b.maxRequests, b.ttl, b.ceiling, b.ordering, b.fairness) == (7, 30, 0.4, "edf", "global-strict")
    assert cfg.band_settings(100).maxRequests == 5000


@pytest.mark.parametrize("text, needle", [
    ("saturation: {maxConcurency: 4}", "maxConcurency"),
    ("saturation: {maxConcurrency: 0}", "maxConcurrency"),
    ("usageLimit: {minCeiling: 0.9, maxCeiling: 0.5}", "minCeiling"),
    ("replicas: [localhost:8000]", "http://"),
    ("keys: [{tenant: a}]", "key_env"),
    ("keys: [{key: k, tenant: a, objectives: [gold]}]", "gold"),
    ("defaultObjective: gold", "gold"),
    ("- just\n- a list", "mapping"),
    ("replicas: [", "YAML"),
    ("usageLimit: {policy: static}\nusageLimit: {policy: adaptive-reserve}", "'usageLimit' twice.*line 1"),
    ("saturation:\n  maxConcurrency: 4\n  maxConcurrency: 8", "'maxConcurrency' twice.*line 2"),
    ("flowControl: {bands: [{maxRequests: 3}]}", "priority"),
    ("usageLimit: {policy: adaptive}", "'adaptive-reserve'"),
    ("usageLimit: {policy: static, adaptive: {margin: 0.2}}", "only applies to policy adaptive-reserve"),
    ("usageLimit: {policy: adaptive-reserve, adaptive: {protectedPriority: 101}}", "above every band"),
    ("usageLimit: {policy: adaptive-reserve, adaptive: {protectedPriority: -10}}", "leaves no band below it"),
    ("usageLimit: {policy: adaptive-reserve, adaptive: {halfLifeSeconds: 0}}", "adaptive.halfLifeSeconds"),
    ("usageLimit: {policy: adaptive-reserve, adaptive: {margin: 1}}", "adaptive.margin"),
    ("usageLimit: {policy: adaptive-reserve, adaptive: {peakWindow: 5}}", "peakWindow"),
    ("flowControl: {bands: [{priority: 1, fairness: fifo}]}",
     "unknown fairness policy 'fifo'; choose one of 'global-strict', 'round-robin'"),
    ("eviction: {policy: oldest-first}", "unknown eviction policy 'oldest-first'; choose one of 'none'"),
    ("picker: {policy: random}", "unknown picker policy 'random'"),
    ("saturation: {detector: vibes}", "unknown saturation detector policy 'vibes'"),
])
def test_bad_config_is_refused_with_a_message_naming_the_problem(text, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_config(text, "bad.yaml")


def test_a_merge_key_may_be_overridden_by_an_explicit_key():
    loaded = parse_config("saturation:\n  <<: {maxConcurrency: 4, kvCacheUtilThreshold: 0.9}\n"
                          "  maxConcurrency: 8\n", "merge.yaml")
    assert (loaded.config.saturation.maxConcurrency, loaded.config.saturation.kvCacheUtilThreshold) == (8, 0.9)


def test_digest_changes_with_content_and_replicas_flag_keeps_it():
    a = parse_config("replicas: [http://a:1]", "a")
    b = parse_config("replicas: [http://b:1]", "b")
    assert a.digest != b.digest
    c = with_replicas(a, ["http://c:1/"])
    assert c.config.replicas == ["http://c:1"] and c.digest == a.digest


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")


def test_a_policy_kind_implemented_apart_from_its_names_fails_at_import():
    from gateway.settings.names import POLICIES, implemented

    assert implemented("ordering", {"fcfs": 1, "edf": 2}) == {"fcfs": 1, "edf": 2}
    with pytest.raises(RuntimeError, match=r"ordering policies implemented \['edf', 'fcfs', 'lifo'\] differ"):
        implemented("ordering", {"fcfs": 1, "edf": 2, "lifo": 3})
    assert set(POLICIES) == {"fairness", "ordering", "saturation detector", "usage limit", "eviction", "picker"}
