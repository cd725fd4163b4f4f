"""The base and every Kubernetes overlay render with `kubectl kustomize`, and what each renders fits the way it runs
beside llm-d (docs/llm-d.md): where holdback's gateway schedules (the base, overlays/vllm) it is there, alone, and
nothing tells llm-d anything; where llm-d schedules (overlays/llm-d) there is no holdback gateway, every holdback
component that calls a gateway is pointed at llm-d's, and llm-d gets the objectives it reads."""

from __future__ import annotations

from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from prometheus_client import generate_latest

from async_processor.metrics import WorkerMetrics
from batch_processor.metrics import ProcessorMetrics
from holdback import contract
from holdback.settings import Settings
from tests.deploy.dashboard_names import exported_names, promql_metric_names
from tests.deploy.deploy_files import (
    GATEWAY_RELAYS, K8S, REPO, config_map, deployment, flow_control, have_kubectl, kustomize,
)

OVERLAYS = sorted(p.parent.relative_to(K8S).as_posix() for p in (K8S / "overlays").glob("*/kustomization.yaml"))
# Who schedules the vLLM pods in each rendering: one scheduler, never both (docs/llm-d.md).
SCHEDULER = {"base": "holdback", "overlays/vllm": "holdback", "overlays/llm-d": "llm-d"}
HOLDBACK_SCHEDULES = [name for name, who in SCHEDULER.items() if who == "holdback"]
LLM_D_GROUPS = ("llm-d.ai/", "inference.networking.k8s.io/", "inference.networking.x-k8s.io/")
CUSTOM_GROUPS = ("monitoring.coreos.com/", *LLM_D_GROUPS)
# The components that send to a gateway (HOLDBACK_GATEWAY_URL): the workers, the processor's model check and its
# sync mode, and the API's dashboard.
CALLERS = ("holdback-worker", "holdback-processor", "holdback-api")


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    if not have_kubectl():
        pytest.skip("kubectl is not installed, and only `kubectl kustomize` renders the overlays: install kubectl "
                    "to run these checks")
    return {name: kustomize(K8S / name) for name in ["base", *OVERLAYS]}


def _named(docs: list[dict], kind: str, prefix: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(prefix)]


def _secret(docs: list[dict], name: str) -> dict:
    return next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == name)


def _gateway_url_each_caller_reads(docs: list[dict]) -> dict[str, str]:
    """The gateway URL as each caller's container gets it: the variable holdback's Settings reads it from."""
    variable = f"{Settings.model_config['env_prefix']}gateway_url".upper()
    found = {}
    for name in CALLERS:
        container = deployment(docs, name)["spec"]["template"]["spec"]["containers"][0]
        assert not any(a.startswith("--gateway-url") for a in container.get("args", [])), name
        assert variable not in {e["name"] for e in container.get("env", [])}, name
        maps = [s["configMapRef"]["name"] for s in container.get("envFrom", []) if "configMapRef" in s]
        env = {k: v for m in maps for k, v in config_map(docs, m)["data"].items()}
        assert variable in env, f"{name} gets no {variable}"
        found[name] = env[variable]
    return found


def test_every_overlay_is_one_of_the_documented_ways():
    assert set(OVERLAYS) == set(SCHEDULER) - {"base"}, \
        "a new overlay: say who schedules its vLLM pods, in SCHEDULER and in docs/llm-d.md"
    doc = (REPO / "docs" / "llm-d.md").read_text()
    for overlay in OVERLAYS:
        assert f"`deploy/k8s/{overlay}`" in doc, f"docs/llm-d.md does not name deploy/k8s/{overlay}"


@pytest.mark.parametrize("name", ["base", *OVERLAYS])
def test_every_rendering_is_well_formed_and_validates(rendered, name):
    docs = rendered[name]
    keys = [(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys)), f"{name} renders an object twice"
    builtin = [d for d in docs if not d["apiVersion"].startswith(CUSTOM_GROUPS)]
    assert {"Deployment", "Service", "Job", "ConfigMap", "Secret"} <= {d["kind"] for d in builtin}
    version = kubernetes_validate.latest_version()
    for doc in builtin:
        kubernetes_validate.validate(doc, version, strict=True)
    assert not [d for d in docs if d["kind"] == "EndpointPickerConfig"], "the Endpoint Picker's config is llm-d's"


@pytest.mark.parametrize("name", HOLDBACK_SCHEDULES)
def test_where_holdbacks_gateway_schedules_it_is_there_alone(rendered, name):
    # Its relays and flow controls (their shape: tests/deploy/test_gateway_fleet.py), one client-facing Service.
    docs = rendered[name]
    assert deployment(docs, GATEWAY_RELAYS) and flow_control(docs)
    (service,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "holdback-gateway"]
    port = service["spec"]["ports"][0]["port"]
    for caller, url in _gateway_url_each_caller_reads(docs).items():
        assert urlsplit(url).hostname == "holdback-gateway" and urlsplit(url).port == port, (caller, url)
    assert _named(docs, "ConfigMap", "holdback-gateway"), "the gateway's config"
    assert [d for d in docs if d["apiVersion"].startswith(LLM_D_GROUPS)] == [], \
        f"{name}: llm-d is not in this path, so nothing here is llm-d's"
    keys = set(_secret(docs, "holdback-secrets")["stringData"])
    assert {"HOLDBACK_GATEWAY_REALTIME_KEY", "HOLDBACK_GATEWAY_BATCH_KEY", "HOLDBACK_GATEWAY_KEY"} <= keys


def test_where_llm_d_schedules_holdback_runs_no_gateway_and_sends_to_llm_ds(rendered):
    docs = rendered["overlays/llm-d"]
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for kind in ("Deployment", "StatefulSet", "Service", "ConfigMap", "Secret", "PodDisruptionBudget"):
        for prefix in ("holdback-gateway", "holdback-sim"):
            assert not _named(docs, kind, prefix), f"{kind} {prefix} is rendered where llm-d schedules"
    commands = {c["args"][0] for d in docs if d["kind"] in ("Deployment", "Job")
                for c in d["spec"]["template"]["spec"]["containers"]}
    assert commands == {"api", "processor", "worker", "db"}, commands
    assert {("Deployment", "holdback-worker"), ("Deployment", "holdback-processor")} <= names
    # Every caller reads one URL: the llm-d gateway's Service, in another namespace than holdback's.
    urls = set(_gateway_url_each_caller_reads(docs).values())
    assert len(urls) == 1, urls
    url = urlsplit(urls.pop())
    own_namespace = deployment(docs, "holdback-worker")["metadata"]["namespace"]
    host = url.hostname.split(".")
    assert url.scheme == "http" and host[2:] in (["svc"], ["svc", "cluster", "local"]), url.geturl()
    assert host[1] != own_namespace and host[0] not in {d["metadata"]["name"] for d in docs}, url.geturl()
    # No holdback gateway keys; the workers' key is what llm-d passes on to vLLM.
    keys = set(_secret(docs, "holdback-secrets")["stringData"])
    assert "HOLDBACK_GATEWAY_KEY" in keys and not {k for k in keys if k.endswith(("_REALTIME_KEY", "_STANDARD_KEY",
                                                                                  "_BATCH_KEY", "_UPSTREAM_API_KEY"))}


def test_where_llm_d_schedules_it_gets_the_objectives_in_its_pools_namespace(rendered):
    docs = rendered["overlays/llm-d"]
    objectives = [d for d in docs if d["kind"] == "InferenceObjective"]
    default = yaml.safe_load((REPO / "gateway" / "default.yaml").read_text())["objectives"]
    assert {d["metadata"]["name"]: d["spec"]["priority"] for d in objectives} == {
        n: o["priority"] for n, o in default.items()}
    assert {d["metadata"]["name"] for d in objectives} == {
        contract.REALTIME_OBJECTIVE, contract.STANDARD_OBJECTIVE, contract.BATCH_OBJECTIVE}
    # llm-d watches objectives in its InferencePool's namespace only: never holdback's, one pool for all.
    holdback_namespace = deployment(docs, "holdback-worker")["metadata"]["namespace"]
    namespaces = {d["metadata"].get("namespace") for d in objectives}
    assert len(namespaces) == 1 and None not in namespaces and holdback_namespace not in namespaces, namespaces
    assert len({d["spec"]["poolRef"]["name"] for d in objectives}) == 1


def test_where_llm_d_schedules_the_alerts_read_only_what_holdbacks_components_export(rendered):
    docs = rendered["overlays/llm-d"]
    exported = set()
    for registry in (WorkerMetrics("w").registry, ProcessorMetrics().registry):
        exported |= exported_names(generate_latest(registry).decode())
    rules = {r["alert"]: r["expr"] for d in docs if d["kind"] == "PrometheusRule"
             for g in d["spec"]["groups"] for r in g["rules"]}
    assert {"HoldbackBatchStuck", "HoldbackFailedRows", "HoldbackEvictionStorm"} <= set(rules)
    for alert, expr in rules.items():
        unknown = promql_metric_names(expr) - exported
        assert not unknown, f"{alert} reads {sorted(unknown)}, which no component of overlays/llm-d exports"
    assert "holdback_worker_evictions_total" in promql_metric_names(rules["HoldbackEvictionStorm"])
