"""deploy/compose.yaml read by a real Compose implementation, `config` (no daemon needed): with the keys of
deploy/compose.env.example filled in it renders, the gateway gets its mounted config and vLLM's key; with them
left empty it refuses, naming each key to set. The gateway is two flow controls and two relays behind HAProxy
(tests/deploy/test_gateway_fleet.py checks that shape in the file as written).

The tool is Docker's Compose v2 (`docker compose`, or a v2 `docker-compose`) when present, else Debian's
docker-compose 1.29 (`apt-get install docker-compose`, as .ci/run does). 1.29 predates the Compose Spec's
top-level `name` (it refuses the file for that key alone), so it reads the file without that one line and is
given the same project name with `-p`; everything else it checks as Compose v2 would (schema, anchors and merges,
`${VAR:?message}`, depends_on conditions).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support import REPO

DEPLOY = REPO / "deploy"
GATEWAY_CONFIG = "/etc/holdback/gateway.yaml"


def _compose_tool() -> tuple[list[str], bool] | None:
    """The Compose command and whether it reads the top-level `name` (v2 does); None when there is none."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"], True
    legacy = shutil.which("docker-compose")
    if legacy:
        version = subprocess.run([legacy, "version", "--short"], capture_output=True, text=True).stdout.strip()
        return [legacy], not version.startswith("1.")
    return None


TOOL = _compose_tool()
pytestmark = pytest.mark.skipif(TOOL is None, reason="needs `docker compose` or `docker-compose` on PATH (Debian: "
                                "apt-get install docker-compose; .ci/run installs it)")


def _example_env(filled: bool) -> dict[str, str]:
    """compose.env.example's variables, each required one set to a value of its own name when `filled`."""
    env = {}
    for line in (DEPLOY / "compose.env.example").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, value = line.split("=", 1)
            env[name.strip()] = value or (f"value-of-{name.strip().lower()}" if filled else "")
    return env


def _config(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`<compose> -f deploy/compose.yaml --env-file ENV config`, from an empty folder with no variables of ours."""
    command, reads_name = TOOL
    compose_file = DEPLOY / "compose.yaml"
    if not reads_name:
        doc = compose_file.read_text()
        assert re.search(r"^name: holdback$", doc, re.M), "the file names its project; update this test's reading"
        compose_file = tmp_path / "compose.yaml"
        compose_file.write_text(re.sub(r"^name: holdback\n", "", doc, flags=re.M))
        command = [*command, "-p", "holdback"]
    env_file = tmp_path / "compose.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    return subprocess.run([*command, "-f", str(compose_file), "--project-directory", str(DEPLOY), "--env-file",
                           str(env_file), "config"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path)})


def _mounts(service: dict) -> dict[str, tuple[str, bool]]:
    """target -> (source, read-only) of a rendered service's volumes, in either syntax a tool prints."""
    mounts = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target, *mode = volume.split(":")
            mounts[target] = (source, "ro" in mode[0].split(",") if mode else False)
        else:
            mounts[volume["target"]] = (volume["source"], bool(volume.get("read_only")))
    return mounts


def test_the_filled_in_example_renders_and_the_gateway_gets_its_config_and_the_upstream_key(tmp_path):
    env = _example_env(filled=True)
    done = _config(tmp_path, env)
    assert done.returncode == 0, done.stderr
    rendered = yaml.safe_load(done.stdout)
    # The flow controls read the gateway's config and keys; the relays get only the channel secret.
    for name in ("flow-control-1", "flow-control-2"):
        control = rendered["services"][name]
        source, read_only = _mounts(control)[GATEWAY_CONFIG]
        assert Path(source) == DEPLOY / "gateway-config.yaml" and Path(source).is_file() and read_only, control
        command = control["command"]
        assert command[command.index("--config") + 1] == GATEWAY_CONFIG, command
        environment = control["environment"]
        assert environment["HOLDBACK_GATEWAY_UPSTREAM_API_KEY"] == env["HOLDBACK_GATEWAY_UPSTREAM_API_KEY"]
        assert environment["HOLDBACK_GATEWAY_BATCH_KEY"] == env["HOLDBACK_GATEWAY_BATCH_KEY"]
        assert environment["HOLDBACK_GATEWAY_CHANNEL_SECRET"] == env["HOLDBACK_GATEWAY_CHANNEL_SECRET"]
    for name in ("relay-1", "relay-2"):
        assert rendered["services"][name]["environment"] == {
            "HOLDBACK_GATEWAY_CHANNEL_SECRET": env["HOLDBACK_GATEWAY_CHANNEL_SECRET"]}, name
    # The workers and processors send with the gateway's batch key, to the load balancer in front of the relays.
    for name in ("processor-1", "worker-1"):
        variables = rendered["services"][name]["environment"]
        assert variables["HOLDBACK_GATEWAY_KEY"] == env["HOLDBACK_GATEWAY_BATCH_KEY"], name
        assert variables["HOLDBACK_GATEWAY_URL"] == "http://gateway:8200", name
    balancer = rendered["services"]["gateway"]
    source, read_only = _mounts(balancer)["/usr/local/etc/haproxy/haproxy.cfg"]
    assert Path(source) == DEPLOY / "haproxy.cfg" and read_only, balancer
    assert "8200" in json.dumps(balancer.get("ports")), balancer


def test_the_example_as_shipped_is_refused_naming_a_key_to_set(tmp_path):
    done = _config(tmp_path, _example_env(filled=False))
    assert done.returncode != 0, done.stdout
    assert re.search(r"set (POSTGRES_PASSWORD|HOLDBACK_[A-Z_]+_(KEY|SECRET)) in deploy/\.env", done.stderr), done.stderr
