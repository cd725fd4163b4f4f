"""The gateway's deployed shape (gateway/README.md, "A leader among flow controls"): relays any number of which serve
clients behind a load balancer, and flow controls that elect a leader through the platform's Redis.

Kubernetes (the base and overlays/vllm, rendered with `kubectl kustomize` when kubectl is there): the relays are a
Deployment of 3 rolled with nothing unavailable, under a disruption budget, ready only with a leader connection and
given longer to stop than their drain takes; flow control is 2 pods with the lease in REDIS_URL, each with a name
the relays list; the channel secret comes from a Secret as a file. Compose: 2 relays, 2 flow controls on Compose's
Redis, and HAProxy balancing over the relays by their /readyz. What each command line passes is checked against the
CLI by test_deploy_files.py."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from gateway.relays.channel import SILENT_HEARTBEATS
from gateway.relays.uplink import BACKOFF_CAP
from gateway.settings import parse_config
from tests.deploy.deploy_files import (
    DEPLOY, GATEWAY_FLOW_CONTROL, GATEWAY_RELAYS, K8S, base_files, cli_help, compose, config_map, deployment,
    flow_control, gateway_config_text, have_kubectl, kustomize,
)

CHANNEL_SECRET = "holdback-gateway-channel"
SECRET_FLAG = "--channel-secret-file"


@pytest.fixture(scope="module", params=["base", "overlays/vllm"])
def docs(request) -> list[dict]:  # noqa: ANN001
    if have_kubectl():
        return kustomize(K8S / request.param)
    if request.param != "base":
        pytest.skip("rendering an overlay needs kustomize (`kubectl kustomize`); kubectl is not installed")
    return base_files()


def _arg(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} is not passed: {args}"
    return args[args.index(flag) + 1]


def _pod(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def _one(docs: list[dict], kind: str, selecting: dict) -> dict:
    """The one object of `kind` whose selector is `selecting` (a Service's, or a budget's matchLabels)."""
    found = [d for d in docs if d["kind"] == kind
             and (d["spec"]["selector"].get("matchLabels", d["spec"]["selector"]) == selecting)]
    assert len(found) == 1, f"{len(found)} {kind}s select {selecting}"
    return found[0]


def _secret_file(docs: list[dict], pod: dict, args: list[str]) -> None:
    """The channel secret is the file --channel-secret-file names, from the Secret, never a variable."""
    path = _arg(args, SECRET_FLAG)
    directory, _, key = path.rpartition("/")
    container = pod["containers"][0]
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == directory]
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"].startswith(CHANNEL_SECRET) and mount.get("readOnly"), volume
    [secret] = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].startswith(CHANNEL_SECRET)]
    assert key in secret.get("stringData", secret.get("data", {})), secret
    assert "HOLDBACK_GATEWAY_CHANNEL_SECRET" not in {e["name"] for e in container.get("env", [])}
    for d in docs:  # set in both, the secret is refused at start
        if d["kind"] == "Secret" and not d["metadata"]["name"].startswith(CHANNEL_SECRET):
            assert "HOLDBACK_GATEWAY_CHANNEL_SECRET" not in d.get("stringData", {}), d["metadata"]["name"]


def _drain_seconds() -> float:
    """How long a relay may take to stop: its drain grace and deadline (their defaults in `holdback gateway
    --help`; 5 s and 30 s until the CLI names them) and 2 s to cut what still runs."""
    help_text = re.sub(r"\s+", " ", cli_help(("gateway",)) or "")
    grace = re.search(r"--drain-grace SECONDS .*?\(default ([\d.]+)", help_text)
    deadline = re.search(r"--drain-seconds SECONDS .*?\(default ([\d.]+)", help_text)
    return (float(grace.group(1)) if grace else 5.0) + (float(deadline.group(1)) if deadline else 30.0) + 2.0


@pytest.mark.e2e  # runs `holdback gateway --help` as a child process
def test_relays_are_a_deployment_of_three_rolled_with_none_unavailable_and_ready_only_with_a_leader(docs):
    relays = deployment(docs, GATEWAY_RELAYS)
    spec, pod = relays["spec"], _pod(relays)
    assert spec["replicas"] == 3
    assert spec["strategy"]["type"] == "RollingUpdate" and spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    labels = spec["selector"]["matchLabels"]
    budget = _one(docs, "PodDisruptionBudget", labels)
    assert budget["spec"].get("maxUnavailable") == 1 or budget["spec"].get("minAvailable") == spec["replicas"] - 1
    [container] = pod["containers"]
    args = container["args"]
    assert args[:3] == ["gateway", "--role", "relay"] and _arg(args, "--host") == "0.0.0.0"
    port = int(_arg(args, "--port"))
    # Ready only while it has a leader connection (the relay's /readyz), and unready first when asked to stop:
    # no preStop hook delays the SIGTERM, and the pod is given longer than the relay's drain.
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert "lifecycle" not in container
    assert pod["terminationGracePeriodSeconds"] > _drain_seconds()
    # Clients and the workers reach the relays through the Service every caller's HOLDBACK_GATEWAY_URL names.
    service = _one(docs, "Service", labels)
    assert service["metadata"]["name"] == "holdback-gateway" and service.get("spec", {}).get("clusterIP") != "None"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    [exposed] = service["spec"]["ports"]
    assert ports[exposed["targetPort"]] == port
    url = config_map(docs, "holdback-config")["data"]["HOLDBACK_GATEWAY_URL"]
    assert url == f"http://holdback-gateway:{exposed['port']}", url
    # A relay takes its config, keys included, from the leader: no holdback-secrets (HOLDBACK_GATEWAY_* variables
    # are read as flags, which a relay refuses), no --config.
    assert not [s for s in container.get("envFrom", []) if "secretRef" in s], container["envFrom"]
    assert "--config" not in args and "--replicas" not in args
    _secret_file(docs, pod, args)


def test_flow_control_is_two_pods_leading_by_the_lease_in_the_platforms_redis_each_listed_by_every_relay(docs):
    control = flow_control(docs)
    pod = _pod(control)
    assert control["spec"]["replicas"] == 2
    [container] = pod["containers"]
    args = container["args"]
    assert args[:3] == ["gateway", "--role", "flow-control"]
    # The lease is in the Redis every holdback component uses: REDIS_URL of holdback-config, expanded by Kubernetes.
    assert _arg(args, "--lease-redis") == "$(REDIS_URL)"
    maps = [s["configMapRef"]["name"] for s in container["envFrom"] if "configMapRef" in s]
    assert any("REDIS_URL" in config_map(docs, m)["data"] for m in maps), maps
    listen_host, listen_port = _arg(args, "--relays-listen").rsplit(":", 1)
    assert listen_host == "0.0.0.0"
    # Both accept relays (a standby turns them away in its greeting): probed on the channel port.
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("livenessProbe", "readinessProbe"):
        assert ports[container[probe]["tcpSocket"]["port"]] == int(listen_port), probe
    # One name per flow control under the headless Service, every one listed by the relays, in order.
    service = _one(docs, "Service", control["spec"]["selector"]["matchLabels"])
    name = service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None" and control["spec"]["serviceName"] == name == GATEWAY_FLOW_CONTROL
    [channel] = service["spec"]["ports"]
    assert ports[channel["targetPort"]] == int(listen_port) == channel["port"]
    relay_args = _pod(deployment(docs, GATEWAY_RELAYS))["containers"][0]["args"]
    listed = _arg(relay_args, "--flow-control").split(",")
    assert listed == [f"{GATEWAY_FLOW_CONTROL}-{i}.{name}:{channel['port']}" for i in range(2)], listed
    budget = _one(docs, "PodDisruptionBudget", control["spec"]["selector"]["matchLabels"])
    assert budget["spec"].get("maxUnavailable") == 1
    # Rolled one at a time, the next stopped only after the new leader's takeover window has passed.
    heartbeat = parse_config(gateway_config_text(docs), "deployed", env={}).config.flowControl.heartbeatSeconds
    takeover = SILENT_HEARTBEATS * heartbeat + BACKOFF_CAP + 1
    assert control["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    assert control["spec"]["minReadySeconds"] > takeover, (control["spec"].get("minReadySeconds"), takeover)
    _secret_file(docs, pod, args)


def test_relays_and_flow_controls_share_one_channel_secret_placeholder_an_operator_must_replace(docs):
    files = {_arg(_pod(w)["containers"][0]["args"], SECRET_FLAG) for w in (deployment(docs, GATEWAY_RELAYS),
                                                                            flow_control(docs))}
    assert len(files) == 1, files
    names = {v["secret"]["secretName"] for w in (deployment(docs, GATEWAY_RELAYS), flow_control(docs))
             for v in _pod(w)["volumes"] if "secret" in v}
    assert len(names) == 1, names


# ---- Compose ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def services() -> dict:
    return compose()["services"]


def _gateway_role(services: dict, role: str) -> dict[str, list[str]]:
    return {name: s["command"] for name, s in services.items()
            if s.get("command", [None])[:3] == ["gateway", "--role", role]}


def test_compose_runs_two_relays_and_two_flow_controls_leading_by_the_lease_in_its_redis(services):
    controls, relays = _gateway_role(services, "flow-control"), _gateway_role(services, "relay")
    assert len(controls) == 2 and len(relays) == 2, (controls, relays)
    assert not [n for n, s in services.items() if s.get("command", [None])[0] == "gateway"
                and n not in controls and n not in relays], "every gateway process is a relay or a flow control"
    redis_url = "redis://redis:6379/0"
    assert services["redis"]["image"].startswith("redis")
    listed = []
    for name, command in controls.items():
        assert _arg(command, "--lease-redis") == redis_url, name
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy", name
        listed.append(f"{services[name].get('hostname', name)}:{_arg(command, '--relays-listen').rsplit(':', 1)[1]}")
    names = {_arg(command, "--lease-name") for command in controls.values()}
    assert len(names) == 1, f"the flow controls of one gateway share one lease: {names}"
    for name, command in relays.items():
        assert _arg(command, "--flow-control").split(",") == listed, name
        # Only the channel secret: a relay reads any other HOLDBACK_GATEWAY_* variable as a flag it refuses.
        assert set(services[name]["environment"]) == {"HOLDBACK_GATEWAY_CHANNEL_SECRET"}, name
        grace = int(services[name]["stop_grace_period"].rstrip("s"))
        assert grace > 37, f"{name}: stop_grace_period {grace}s is not above the relay's drain"
    for name in controls:
        assert "HOLDBACK_GATEWAY_CHANNEL_SECRET" in services[name]["environment"], name


def test_compose_puts_haproxy_in_front_of_the_relays_checking_their_readiness(services):
    relays = _gateway_role(services, "relay")
    balancer = services["gateway"]
    assert "haproxy" in balancer["image"]
    [config] = [v.split(":")[0] for v in balancer["volumes"] if v.split(":")[1].endswith("haproxy.cfg")]
    text = (DEPLOY / config).read_text()
    ports = {_arg(command, "--port") for command in relays.values()}
    servers = re.findall(r"^\s*server\s+\S+\s+(\S+):(\d+)", text, re.M)
    assert sorted(servers) == sorted((services[n].get("hostname", n), p) for n, p in
                                     ((n, _arg(c, "--port")) for n, c in relays.items())), servers
    assert re.search(r"^\s*option httpchk GET /readyz$", text, re.M) and "http-check expect status 200" in text
    assert re.search(r"^\s*default-server .*\bcheck\b", text, re.M)
    assert re.search(r"^\s*bind :(\d+)$", text, re.M).group(1) in " ".join(balancer["ports"]), balancer["ports"]
    assert "on-marked-down shutdown-sessions" not in text, "a relay that drains keeps its streams"
    assert len(ports) == 1


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="needs haproxy on PATH (Debian: apt-get install haproxy)")
def test_the_haproxy_config_is_valid_for_haproxy():
    done = subprocess.run(["haproxy", "-c", "-f", str(DEPLOY / "haproxy.cfg")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
