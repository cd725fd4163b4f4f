"""One policy everywhere: every gateway config the deployments ship runs gateway/default.yaml's policy.

`holdback up` runs the built-in config (gateway/default.yaml); Compose and the Kubernetes overlays mount files of
their own. Those may differ from the built-in config only where a deployment must: which replicas, their limits
(`engine`, `saturation`, `pools`) and the key sent to them (`upstream`). Anything else that differs (a reserve,
another victim order) is a cluster running another product than the one measured and documented.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.settings.loading import DEFAULT_CONFIG_PATH, parse_config
from tests.deploy.deploy_files import DEPLOY, K8S

# The sections a deployment sets for its own replicas.
DEPLOYMENT_SECTIONS = {"replicas", "pools", "engine", "saturation", "upstream"}
GATEWAY_CONFIGS = sorted(DEPLOY.rglob("gateway-config.yaml"))


def sections(text: str, source: str) -> dict:
    return parse_config(text, source, env={}).config.model_dump()


def differing(path: Path) -> dict[str, tuple[object, object]]:
    default = sections(DEFAULT_CONFIG_PATH.read_text(), str(DEFAULT_CONFIG_PATH))
    deployed = sections(path.read_text(), str(path))
    return {name: (default[name], deployed[name]) for name in default
            if name not in DEPLOYMENT_SECTIONS and default[name] != deployed[name]}


def test_the_deployments_ship_gateway_configs():
    assert {p.relative_to(DEPLOY).as_posix() for p in GATEWAY_CONFIGS} >= {
        "gateway-config.yaml", "k8s/base/gateway-config.yaml", "k8s/overlays/vllm/gateway-config.yaml"}


@pytest.mark.parametrize("path", GATEWAY_CONFIGS, ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_a_deployed_gateway_config_differs_from_the_default_only_where_a_deployment_must(path):
    assert differing(path) == {}, (
        f"{path.relative_to(DEPLOY.parent)} sets sections other than {sorted(DEPLOYMENT_SECTIONS)} "
        f"differently from gateway/default.yaml (default, deployed): {differing(path)}")


def test_the_check_sees_a_deployment_that_runs_another_policy(tmp_path):
    """What the k8s files did before: a 50% reserve and newest-first victims."""
    base = K8S / "base" / "gateway-config.yaml"
    other = tmp_path / "gateway-config.yaml"
    other.write_text(base.read_text() + "usageLimit: {policy: priority-holdback, minCeiling: 0.5}\n"
                     "eviction: {policy: newest-first}\n")
    assert set(differing(other)) == {"usageLimit", "eviction"}
