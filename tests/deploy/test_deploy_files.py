"""deploy/: the Kubernetes manifests validate against the Kubernetes schemas (offline), the Compose file is
well formed, and every command, flag, environment variable, probe path, objective and metric they name
exists in the code, so a renamed flag or setting fails here rather than in a rollout."""

from __future__ import annotations

import re
import shlex

import kubernetes_validate
import pytest
import yaml
from fastapi.testclient import TestClient

from batch_api.app import create_app
from gateway.settings import parse_config
from gateway.settings.keys import UPSTREAM_KEY_ENV
from holdback.settings import Settings
from tests.deploy.deploy_files import (
    DEPLOY, K8S, REPO, Invocation, base_files, cli_env_names, cli_help, command_words, compose, compose_invocations,
    deployment, flags, flow_control, gateway_config_envs, gateway_config_text, gateway_key_envs, have_kubectl,
    k8s_invocations, kustomize, settings_env_names,
)

K8S_VERSION = kubernetes_validate.latest_version()
CUSTOM_GROUPS = ("monitoring.coreos.com/", "inference.networking.x-k8s.io/", "llm-d.ai/")


@pytest.fixture(scope="module", params=["base", "overlays/vllm"])
def manifests(request) -> tuple[str, list[dict]]:  # noqa: ANN001
    if have_kubectl():
        return request.param, kustomize(K8S / request.param)
    if request.param != "base":
        pytest.skip("rendering an overlay needs kustomize (`kubectl kustomize`); kubectl is not installed")
    return request.param, base_files()


@pytest.fixture(scope="module")
def compose_doc() -> dict:
    return compose()


def _containers(docs: list[dict]):  # noqa: ANN202
    for doc in docs:
        pod = doc.get("spec", {}).get("template", {}).get("spec")
        for container in (pod or {}).get("containers", []):
            yield doc, pod, container


def _known_env(docs: list[dict] | None = None) -> set[str]:
    # A variable a command's --help names (e.g. an env default of a flag) counts as known too, and so does one the
    # deployed gateway config reads a key from (that config is checked to parse as the gateway's).
    helped = {v for command in ("api", "processor", "worker", "gateway", "sim")
              for v in re.findall(r"\bHOLDBACK_[A-Z0-9_]+[A-Z0-9]", cli_help((command,)) or "")}
    deployed = gateway_config_envs(gateway_config_text(docs)) if docs is not None else set()
    # The gateway reads vLLM's --api-key from UPSTREAM_KEY_ENV unless its config names another variable.
    return settings_env_names() | gateway_key_envs() | cli_env_names() | helped | deployed | {UPSTREAM_KEY_ENV}


def test_builtin_kinds_validate_against_the_kubernetes_schemas(manifests) -> None:  # noqa: ANN001
    _, docs = manifests
    builtin = [d for d in docs if not d["apiVersion"].startswith(CUSTOM_GROUPS)]
    assert {"Deployment", "Service", "Job", "ConfigMap", "Secret"} <= {d["kind"] for d in builtin}
    for doc in builtin:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_custom_resources_are_well_formed_and_point_at_what_exists(manifests) -> None:  # noqa: ANN001
    name, docs = manifests
    kinds = {d["kind"] for d in docs}
    assert {"ServiceMonitor", "PrometheusRule"} <= kinds
    service_ports = {p["name"] for d in docs if d["kind"] == "Service" for p in d["spec"]["ports"]}
    for monitor in (d for d in docs if d["kind"] == "ServiceMonitor"):
        assert monitor["spec"]["selector"]["matchLabels"]
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in service_ports, endpoint
    alerts = {r["alert"]: r for d in docs if d["kind"] == "PrometheusRule"
              for g in d["spec"]["groups"] for r in g["rules"]}
    assert {"HoldbackBatchStuck", "HoldbackFailedRows", "HoldbackEvictionStorm", "HoldbackReplicaDown"} <= set(alerts)
    for rule in alerts.values():
        assert rule["expr"].strip() and rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]
    if name == "overlays/vllm":
        assert "holdback-sim" not in {d["metadata"]["name"] for d in docs}
        assert "InferenceObjective" not in kinds, "llm-d is not in this overlay's path (overlays/llm-d has them)"


# Current llm-d reads only llm-d.ai/v1alpha2 objectives (and ignores the old group when its own CRD is there);
# older llm-d (the llm-d-inference-scheduler releases) reads the old group. Both files are overlays/llm-d's.
OBJECTIVE_FILES = {"inference-objectives.yaml": "llm-d.ai/v1alpha2",
                   "inference-objectives-legacy.yaml": "inference.networking.x-k8s.io/v1alpha2"}


@pytest.mark.parametrize("file,api_version", sorted(OBJECTIVE_FILES.items()))
def test_objectives_match_the_gateway_config_in_the_group_llm_d_reads(file: str, api_version: str) -> None:
    config = yaml.safe_load((REPO / "gateway" / "default.yaml").read_text())
    docs = [d for d in yaml.safe_load_all((K8S / "overlays" / "llm-d" / file).read_text()) if d]
    assert {d["apiVersion"] for d in docs} == {api_version}
    assert all(d["spec"]["poolRef"]["name"] == "vllm" for d in docs)
    objectives = {d["metadata"]["name"]: d["spec"]["priority"] for d in docs}
    assert objectives == {name: o["priority"] for name, o in config["objectives"].items()}


def test_the_overlay_ships_the_objectives_current_llm_d_reads() -> None:
    overlay = yaml.safe_load((K8S / "overlays" / "llm-d" / "kustomization.yaml").read_text())
    assert "inference-objectives.yaml" in overlay["resources"]
    assert "inference-objectives-legacy.yaml" not in overlay["resources"], "one group at a time"


def test_no_objective_is_rendered_where_holdbacks_gateway_schedules(manifests) -> None:  # noqa: ANN001
    # The base and overlays/vllm need no CRD and tell llm-d nothing; tests/deploy/test_overlays.py checks
    # overlays/llm-d's rendered objectives.
    _, docs = manifests
    assert [d for d in docs if d["kind"] == "InferenceObjective"] == []


def _secret_env(docs: list[dict]) -> dict[str, str]:
    names = set()
    for doc in docs:
        if doc["kind"] == "Secret":
            names |= set(doc.get("stringData", {})) | set(doc.get("data", {}))
    return {n: f"{n.lower()}-from-the-secret" for n in names}


def test_the_gateways_config_map_is_its_config_and_sizes_it_from_the_replicas(manifests) -> None:  # noqa: ANN001
    name, docs = manifests
    text = gateway_config_text(docs)
    # The gateway's own parser, with the variables the pod gets from holdback-secrets: every key resolves.
    loaded = parse_config(text, f"{name}: ConfigMap holdback-gateway", env=_secret_env(docs))
    config = loaded.config
    assert loaded.skipped_key_envs == (), f"key variables the Secret does not set: {loaded.skipped_key_envs}"
    assert {k.tenant for k in loaded.keys} == {"realtime", "standard", "batch"} and loaded.admin_keys
    assert {n: o.priority for n, o in config.objectives.items()} == {"realtime": 100, "standard": 0, "batch": -10}
    assert len(config.replicas) >= 2
    # Sized from the replicas: the slots the gateway counts per replica are the slots each replica runs.
    assert config.engine.maxNumSeqs == config.saturation.maxConcurrency
    args = flow_control(docs)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--replicas" not in args, "the replicas are the config's, not a flag's"
    if name == "base":
        sim = deployment(docs, "holdback-sim")["spec"]["template"]["spec"]["containers"][0]["args"]
        assert int(sim[sim.index("--max-num-seqs") + 1]) == config.engine.maxNumSeqs
        ports = {p["port"] for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "holdback-sim"
                 for p in d["spec"]["ports"]}
        assert config.replicas == [f"http://holdback-sim:{port}" for port in sorted(ports)]
    else:
        assert loaded.upstream_api_key == "holdback_gateway_upstream_api_key-from-the-secret", \
            "vLLM's --api-key reaches the gateway"
        assert config.engine.schedulingPolicy == "priority"


def test_the_config_map_check_refuses_a_config_the_gateway_would_refuse(manifests) -> None:  # noqa: ANN001
    _, docs = manifests
    text = gateway_config_text(docs).replace("maxConcurrency:", "maxConcurency:")
    with pytest.raises(ValueError, match="maxConcurency"):
        parse_config(text, "edited", env=_secret_env(docs))


def test_every_deployment_has_probes_and_runs_as_non_root(manifests) -> None:  # noqa: ANN001
    _, docs = manifests
    for doc, pod, container in _containers(docs):
        if doc["kind"] in ("Deployment", "StatefulSet"):
            assert container.get("livenessProbe") and container.get("readinessProbe"), doc["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0


def test_probe_paths_are_served_by_the_command_they_probe(manifests) -> None:  # noqa: ANN001
    _, docs = manifests
    # Asked without start-up (no database, no Redis): a path that exists answers anything but 404.
    api = TestClient(create_app(Settings(database_url="sqlite://")), raise_server_exceptions=False)
    aiohttp_source = {pkg: "\n".join(p.read_text() for p in (REPO / pkg).rglob("*.py")) for pkg in ("gateway", "model_sim")}
    checked = 0
    for doc, _pod, container in _containers(docs):
        args = container.get("args", [])
        for kind in ("livenessProbe", "readinessProbe", "startupProbe"):
            probe = container.get(kind)
            if not probe or "httpGet" not in probe:
                continue
            path, command = probe["httpGet"]["path"], args[0]
            if command == "api":
                assert api.get(path).status_code != 404, (doc["metadata"]["name"], path)
            elif command in ("gateway", "sim"):
                package = "gateway" if command == "gateway" else "model_sim"
                assert f'add_get("{path}"' in aiohttp_source[package], (command, path)
            else:  # processor and worker answer on their metrics port, which must be switched on and reachable
                assert "--metrics-port" in args and path in ("/healthz", "/readyz"), (command, args)
                assert args[args.index("--metrics-host") + 1] == "0.0.0.0", (command, args)
                assert path in (REPO / "holdback" / "probes.py").read_text()
            checked += 1
    assert checked >= 8


def _check_invocation(invocation: Invocation) -> None:
    words = command_words(invocation.args)
    assert words, f"{invocation.where}: {invocation.args[:1]} is not a holdback command"
    help_text = cli_help(words)
    for flag in flags(invocation.args):
        assert re.search(rf"(^|[\s,\[]){re.escape(flag)}([\s,=\]]|$)", help_text, re.M), (
            f"{invocation.where}: `holdback {' '.join(words)}` has no option {flag}")


@pytest.mark.e2e  # runs `holdback ... --help` as a child process
def test_every_command_and_flag_exists_in_the_cli(manifests, compose_doc) -> None:  # noqa: ANN001
    invocations = k8s_invocations(manifests[1]) + compose_invocations(compose_doc)
    assert {i.args[0] for i in invocations} >= {"api", "processor", "worker", "gateway", "db"}
    for invocation in invocations:
        _check_invocation(invocation)


@pytest.mark.e2e  # runs `holdback ... --help` as a child process
def test_the_flag_check_catches_a_renamed_flag() -> None:
    with pytest.raises(AssertionError, match="has no option --metric-port"):
        _check_invocation(Invocation("example", ("processor", "--metric-port", "9100")))
    with pytest.raises(AssertionError, match="is not a holdback command"):
        _check_invocation(Invocation("example", ("proccessor",)))


@pytest.mark.e2e  # runs `holdback ... --help` as a child process
def test_every_environment_variable_is_a_setting(manifests, compose_doc) -> None:  # noqa: ANN001
    _, docs = manifests
    known = _known_env(docs)
    assert {"DATABASE_URL", "REDIS_URL", "HOLDBACK_FILES_URL", "HOLDBACK_S3_ENDPOINT_URL"} <= known
    named = set()
    # Secrets given to containers as variables (the gateway's channel secret is a mounted file instead).
    as_env = {source["secretRef"]["name"] for _d, _p, container in _containers(docs)
              for source in container.get("envFrom", []) if "secretRef" in source}
    for doc in docs:
        if doc["kind"] == "ConfigMap" and doc["metadata"]["name"].startswith("holdback-config"):
            named |= set(doc["data"])
        if doc["kind"] == "Secret" and doc["metadata"]["name"] in as_env:
            named |= set(doc.get("stringData", {})) | set(doc.get("data", {}))
    for name, service in compose_doc["services"].items():
        if "holdback" in str(service.get("image", "")):
            named |= set(service.get("environment", {}))
    assert named, "no environment variables found"
    # HOLDBACK_REPLICAS feeds the gateway's --replicas (expanded by Kubernetes and Compose) and `holdback up`.
    assert named - known == set(), f"not settings of any holdback component: {sorted(named - known)}"


def test_compose_file_is_well_formed(compose_doc) -> None:  # noqa: ANN001
    services = compose_doc["services"]
    commands = {name: s.get("command", [None])[0] for name, s in services.items()}
    count = {c: sum(1 for v in commands.values() if v == c) for c in ("api", "processor", "worker", "gateway", "sim")}
    assert count == {"api": 2, "processor": 2, "worker": 2, "gateway": 4, "sim": 1}  # 2 relays, 2 flow controls
    assert {"postgres", "redis", "migrate"} <= set(services) and commands["migrate"] == "db"
    host_ports = [p.split(":")[0] for s in services.values() for p in s.get("ports", [])]
    assert len(host_ports) == len(set(host_ports)), host_ports
    for name, service in services.items():
        assert "image" in service, name
        for dependency, condition in service.get("depends_on", {}).items():
            assert dependency in services, (name, dependency)
            assert condition["condition"] in ("service_started", "service_healthy", "service_completed_successfully")
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):  # a file of this folder, mounted as it is (the gateway's config)
                assert (DEPLOY / source).is_file(), (name, volume)
            else:
                assert source in compose_doc["volumes"], (name, volume)
        if commands[name] in ("api", "processor", "worker"):
            assert service["depends_on"]["migrate"]["condition"] == "service_completed_successfully", name
    text = (DEPLOY / "compose.yaml").read_text()
    example = {line.split("=", 1)[0] for line in (DEPLOY / "compose.env.example").read_text().splitlines()
               if "=" in line and not line.startswith("#")}
    for variable, rest in re.findall(r"\$\{([A-Z_][A-Z0-9_]*)(:?[-?][^}]*)?\}", text):
        assert rest or variable in example, f"${{{variable}}} has no default and is not in compose.env.example"
    assert not re.search(r"\$\{[^A-Z]", text), "malformed ${...} interpolation"


def test_containerfile_is_slim_non_root_and_caches_dependencies() -> None:
    lines = [line.strip() for line in (DEPLOY / "Containerfile").read_text().splitlines()
             if line.strip() and not line.strip().startswith("#")]
    assert re.fullmatch(r"FROM python:3\.\d+-slim( AS \w+)?", lines[0]), lines[0]
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    first_source_copy = next(i for i, line in enumerate(lines) if line.startswith("COPY holdback"))
    dependency_install = next(i for i, line in enumerate(lines) if "pip install -r" in line)
    assert lines.index("COPY pyproject.toml ./") < dependency_install < first_source_copy
    copied = {line.split()[1] for line in lines if line.startswith("COPY ")}
    pyproject = (REPO / "pyproject.toml").read_text()
    packages = re.search(r'include = \[([^\]]*)\]', pyproject).group(1)
    for package in re.findall(r'"(\w+)\*"', packages):
        assert package in copied, f"the image does not copy the package {package}"
    assert lines[-2] == 'ENTRYPOINT ["holdback"]'


@pytest.mark.e2e  # runs `holdback ... --help` as a child process
def test_the_readme_scaling_out_commands_exist_in_the_cli() -> None:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Scaling out"):]
    section = section[:section.index("\n## ", 1)]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    commands = []
    for line in "\n".join(blocks).replace("\\\n", " ").splitlines():
        words = shlex.split(line.split("#", 1)[0])
        if "holdback" in words:
            commands.append(tuple(words[words.index("holdback") + 1:]))
    assert len(commands) >= 6
    for args in commands:
        _check_invocation(Invocation("README Scaling out", args))
    for variable in set(re.findall(r"\b((?:HOLDBACK|DATABASE|REDIS)_[A-Z0-9_]+)=", section)):
        assert variable in _known_env(), variable
