"""What the deployment files name, read the way the deploy tests check it (no tests here).

Kubernetes manifests are rendered with `kubectl kustomize` when kubectl is installed; otherwise the base's
resource files are read directly (overlays need kustomize). Compose is plain YAML with merge keys.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import yaml

from bench.lib import forkserver
from tests.support import REPO

DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
PACKAGES = ("holdback", "batch_api", "batch_processor", "async_processor", "gateway", "model_sim")


def kustomize(directory: Path) -> list[dict]:
    """The rendered resources of a kustomization directory (needs kubectl)."""
    out = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def base_files() -> list[dict]:
    """The base's resources as written (what kustomize would render, less its labels, namespace and the hash
    suffix of generated ConfigMaps' names)."""
    kustomization = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    docs: list[dict] = []
    for name in kustomization["resources"]:
        docs += [doc for doc in yaml.safe_load_all((K8S / "base" / name).read_text()) if doc]
    for generator in kustomization.get("configMapGenerator", []):
        data = {}
        for entry in generator.get("files", []):
            key, _, path = entry.rpartition("=") if "=" in entry else (Path(entry).name, "", entry)
            data[key] = (K8S / "base" / path).read_text()
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generator["name"]}, "data": data})
    return docs


def config_map(docs: list[dict], name: str) -> dict:
    """The ConfigMap called `name` (a generated one's as kustomize renders it, with the hash suffix it also writes
    into the volumes that name it)."""
    found = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == name]
    assert len(found) == 1, f"no single ConfigMap {name!r} among {[d['metadata']['name'] for d in docs]}"
    return found[0]


def deployment(docs: list[dict], name: str, kind: str = "Deployment") -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"no single {kind} {name!r}"
    return found[0]


# The gateway as it runs on Kubernetes: relays (a Deployment) and flow controls contending for the lease (a
# StatefulSet, so each has a name relays can list); the flow controls read the gateway's config.
GATEWAY_RELAYS = "holdback-gateway-relay"
GATEWAY_FLOW_CONTROL = "holdback-gateway-flow-control"


def flow_control(docs: list[dict]) -> dict:
    return deployment(docs, GATEWAY_FLOW_CONTROL, "StatefulSet")


def mounted_file(docs: list[dict], pod: dict, path: str) -> str:
    """The text of the file at `path` in a pod: the key of the ConfigMap mounted at its directory."""
    directory, _, key = path.rpartition("/")
    container = pod["containers"][0]
    mounts = [m for m in container.get("volumeMounts", []) if m["mountPath"].rstrip("/") == directory]
    assert len(mounts) == 1, f"nothing is mounted at {directory} for {path}"
    volume = next(v for v in pod["volumes"] if v["name"] == mounts[0]["name"])
    assert "configMap" in volume, f"{directory} is not a ConfigMap volume: {volume}"
    data = config_map(docs, volume["configMap"]["name"]).get("data", {})
    assert key in data, f"ConfigMap {volume['configMap']['name']} has no key {key!r} for {path}"
    return data[key]


def gateway_config_text(docs: list[dict]) -> str:
    """The gateway's config file as its flow controls see it: the file their --config names."""
    pod = flow_control(docs)["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert "--config" in args, f"the gateway runs without --config: {args}"
    return mounted_file(docs, pod, args[args.index("--config") + 1])


def gateway_config_envs(text: str) -> set[str]:
    """The variables a gateway config reads its keys from (`key_env`, `apiKey_env`, anywhere in it)."""
    found: set[str] = set()

    def walk(value: object) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                if k in ("key_env", "apiKey_env", "apiKeyEnv") and isinstance(v, str):
                    found.add(v)
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    walk(yaml.safe_load(text))
    return found


def have_kubectl() -> bool:
    return shutil.which("kubectl") is not None


@dataclass(frozen=True)
class Invocation:
    """One `holdback ...` command line a deployment file runs, and where."""

    where: str
    args: tuple[str, ...]


def k8s_invocations(docs: list[dict]) -> list[Invocation]:
    found = []
    for doc in docs:
        spec = doc.get("spec", {})
        pod = spec.get("template", {}).get("spec") or spec.get("jobTemplate", {}).get("spec", {}).get(
            "template", {}).get("spec")
        for container in (pod or {}).get("containers", []):
            if container.get("image", "").split(":")[0].endswith("holdback"):
                found.append(Invocation(f"{doc['kind']}/{doc['metadata']['name']}/{container['name']}",
                                        tuple(container.get("args", []))))
    return found


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def compose_invocations(doc: dict) -> list[Invocation]:
    return [Invocation(f"compose/{name}", tuple(svc["command"])) for name, svc in doc["services"].items()
            if "holdback" in str(svc.get("image", "")) and "command" in svc]


@lru_cache(maxsize=None)
def cli_help(words: tuple[str, ...]) -> str | None:
    """`holdback WORDS --help`, or None when that is not a command."""
    out = forkserver.run([sys.executable, "-m", "holdback.cli", *words, "--help"], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    return out.stdout if out.returncode == 0 else None


def command_words(args: tuple[str, ...]) -> tuple[str, ...]:
    """The longest run of leading non-flag words that `holdback` accepts as a command (`db upgrade`, `api`)."""
    words: list[str] = []
    for arg in args:
        if arg.startswith("-") or cli_help((*words, arg)) is None:
            break
        words.append(arg)
    return tuple(words)


def flags(args: tuple[str, ...]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", a)]


def settings_env_names() -> set[str]:
    """Every environment variable a pydantic-settings class in holdback's packages reads.

    Found by reading the source (classes deriving from BaseSettings), so settings another change adds
    are known without editing this test."""
    from pydantic_settings import BaseSettings
    import importlib

    names: set[str] = set()
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            text = path.read_text()
            if "BaseSettings" not in text:
                continue
            module = importlib.import_module(".".join(path.relative_to(REPO).with_suffix("").parts))
            for obj in vars(module).values():
                if isinstance(obj, type) and issubclass(obj, BaseSettings) and obj is not BaseSettings:
                    prefix = obj.model_config.get("env_prefix", "")
                    for name, info in obj.model_fields.items():
                        alias = info.validation_alias
                        names.add(alias.upper() if isinstance(alias, str) else f"{prefix}{name}".upper())
    return names


def gateway_key_envs() -> set[str]:
    config = yaml.safe_load((REPO / "gateway" / "default.yaml").read_text())
    return {entry["key_env"] for entry in config.get("keys", []) if "key_env" in entry}


def cli_env_names() -> set[str]:
    """Variables a CLI reads as a flag default (`os.environ.get("HOLDBACK_...")` in an argparse default)."""
    names: set[str] = set()
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                        and node.args and isinstance(node.args[0], ast.Constant)
                        and str(node.args[0].value).startswith("HOLDBACK_")):
                    names.add(node.args[0].value)
    return names

