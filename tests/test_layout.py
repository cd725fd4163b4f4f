"""The walls between components, as the design's layout table states them, checked on every import.

A component imports only the shared library `holdback/` (the gateway and the simulator only its contract, logs,
tracing, probes and env flags: they run without the database); `holdback/` imports none of the components except
from `holdback/cli/`, the umbrella command that starts them; `bench/` uses only public interfaces outside
`bench/micro/`; and no module takes another module's `_private` name. A crossing put back fails here, naming
the file, the line and the rule. Two more rules of the layout: a class name means one class across the components
(the simulator's copies of vLLM's own names aside), and no file grows past its size limit (450 lines outside
`tests/`, 800 in it); each failure names the class or the file.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
COMPONENTS = ("holdback", "batch_api", "batch_processor", "async_processor", "gateway", "model_sim", "bench",
              "migrations")
# What the gateway and the simulator may take from the shared library: never the database, models or broker.
THIN = ("holdback.contract", "holdback.logs", "holdback.tracing", "holdback.probes", "holdback.env_flags",
        "holdback.sim_tokenizer")  # the simulator's tokenizer: pure, so the gateway can count its prompts
# Outside bench/micro/, a benchmark drives holdback as a user does: HTTP and the CLI, and the contract's names.
# progress: the CLI's progress lines; listeners: the CLI's free-port picker, which the tests use too.
BENCH_PUBLIC = ("holdback.contract", "holdback.progress", "holdback.cli.listeners")


@dataclass(frozen=True)
class Crossing:
    path: str
    line: int
    imported: str
    rule: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} imports {self.imported}: {self.rule}"


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _rule(path: str, imported: str) -> str | None:
    """Why `path` may not import `imported` (a module of ours), or None when it may."""
    parts = Path(path).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    own, target = parts[0], imported.split(".")[0]
    if target == own and own != "holdback":
        return None
    if own == "holdback":
        if parts[:2] == ("holdback", "cli"):
            return None  # the umbrella command starts every component
        return None if target == "holdback" else "holdback/ is the shared library: it imports no component"
    if own == "gateway":
        return None if _within(imported, THIN + ("holdback.settings",)) else \
            "the gateway takes only the contract, logs, tracing, probes, env flags and settings from holdback"
    if own == "model_sim":
        return None if _within(imported, THIN) else \
            "the simulator takes only the contract, logs, tracing, probes and env flags from holdback"
    if own == "bench":
        if parts[:2] == ("bench", "micro"):
            return None  # the only benchmarks allowed to touch internals
        return None if _within(imported, BENCH_PUBLIC) else \
            "outside bench/micro/ a benchmark uses public interfaces only (HTTP, the CLI, holdback.contract)"
    if own in ("batch_api", "batch_processor", "async_processor", "migrations"):
        return None if target == "holdback" else f"{own}/ imports only holdback/, never another component"
    return None


def _is_module(dotted: str) -> bool:
    base = REPO.joinpath(*dotted.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _module_of(path: str) -> str:
    parts = list(Path(path).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def crossings(path: str, source: str) -> list[Crossing]:
    """Every import in `source` (the file at repo-relative `path`) that breaks a wall or takes a private name."""
    out: list[Crossing] = []
    here = _module_of(path)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from holdback import tracing` takes the module holdback.tracing: judge that, not the package.
            targets = [(f"{node.module}.{alias.name}", None) if _is_module(f"{node.module}.{alias.name}")
                       else (node.module, alias.name) for alias in node.names]
        else:
            continue
        for module, name in dict.fromkeys(targets):
            if module.split(".")[0] not in COMPONENTS:
                continue  # the standard library and third parties
            rule = _rule(path, module)
            if rule:
                out.append(Crossing(path, node.lineno, module, rule))
            if name and name.startswith("_") and not name.startswith("__") and module != here:
                out.append(Crossing(path, node.lineno, f"{module}.{name}",
                                    "a private name stays in its module: make it public or move it"))
    return list(dict.fromkeys(out))  # `from x import a, b` is one crossing of x


def _sources() -> list[Path]:
    return sorted(p for c in COMPONENTS for p in (REPO / c).rglob("*.py"))


def test_no_component_crosses_a_wall() -> None:
    found = [c for p in _sources() for c in crossings(str(p.relative_to(REPO)), p.read_text())]
    assert not found, "imports that cross the layout's walls:\n" + "\n".join(map(str, found))


# The crossings the layout step removed: each must still be caught if it comes back.
TODAYS_CROSSINGS = [
    ("batch_processor/sync_dispatch.py", "from async_processor.attempt import AttemptRunner\n"),
    ("gateway/tokenization.py", "from model_sim.tokenizer import SimTokenizer\n"),
    ("gateway/flow/controller.py", "from holdback.db import make_engine\n"),
    ("model_sim/server.py", "from holdback.models import RequestRow\n"),
    ("bench/kv_admission.py", "from gateway.flow_control import FlowController\n"),
    ("bench/heartbeat_cost.py", "from async_processor.worker import AsyncWorker\n"),
    ("bench/drills.py", "from bench.study import _admin_state\n"),
    ("holdback/results.py", "from batch_processor.finalize import finalize\n"),
    ("batch_api/admin.py", "from batch_processor.jobqueue import JobQueue\n"),
    ("async_processor/worker.py", "from holdback.attempts.runner import _lane\n"),
]


@pytest.mark.parametrize("path,source", TODAYS_CROSSINGS, ids=[p for p, _ in TODAYS_CROSSINGS])
def test_a_crossing_put_back_is_caught(path: str, source: str) -> None:
    assert crossings(path, source), f"{path}: {source.strip()} was not caught"


def test_a_submodule_taken_from_its_package_is_judged_as_itself() -> None:
    assert not crossings("gateway/log.py", "from holdback import logs, tracing\n")
    assert crossings("gateway/app.py", "from holdback import db\n")


@pytest.mark.parametrize("path,source", [
    ("holdback/cli/up.py", "from gateway.cli import main\n"),
    ("bench/micro/kv_admission.py", "from gateway.flow.controller import FlowController\n"),
    ("gateway/proxy.py", "from holdback.contract import DROP_REASON_HEADER\n"),
    ("batch_processor/ingest.py", "from holdback.models import RequestRow\n"),
    ("holdback/attempts/runner.py", "from holdback.attempts.lanes import Lane\n"),
    ("bench/study.py", "from bench.lib.stacks import Stack\n"),
])
def test_what_the_walls_allow_passes(path: str, source: str) -> None:
    assert not crossings(path, source)


# --- one class per name ------------------------------------------------------------------------------------

# The simulator answers as vLLM does and is read beside vLLM's source, so it keeps vLLM's own class names even where
# one is also ours: name -> the model_sim/ file whose class mirrors vLLM's. Only that file's class is let off; two
# classes of the name anywhere else still fail.
VLLM_MIRRORS = {
    "RequestStatus": "model_sim/request.py",  # vllm/v1/request.py's RequestStatus (ours: holdback/models.py)
}


def duplicate_classes(sources: dict[str, str]) -> dict[str, list[str]]:
    """Each class name defined more than once in `sources` (repo-relative path -> text), with its `path:line`s;
    nested classes count, and a class in `VLLM_MIRRORS` is let off in its model_sim/ file."""
    places: dict[str, list[str]] = {}
    for path, source in sorted(sources.items()):
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and VLLM_MIRRORS.get(node.name) != path:
                places.setdefault(node.name, []).append(f"{path}:{node.lineno}")
    return {name: where for name, where in sorted(places.items()) if len(where) > 1}


def test_a_class_name_means_one_class() -> None:
    found = duplicate_classes({str(p.relative_to(REPO)): p.read_text() for p in _sources()})
    assert not found, ("class names defined more than once outside tests (give each its own name, or merge them "
                       "where they are one thing):\n" + "\n".join(f"  {name}: {', '.join(where)}"
                                                              for name, where in found.items()))


def test_a_class_name_put_back_is_caught_and_a_vllm_mirror_is_not() -> None:
    twice = {"holdback/results.py": "class Usage:\n    pass\n", "batch_api/schemas.py": "class Usage:\n    pass\n"}
    assert duplicate_classes(twice) == {"Usage": ["batch_api/schemas.py:1", "holdback/results.py:1"]}
    nested = {"gateway/a.py": "class A:\n    class Config:\n        pass\n",
              "gateway/b.py": "class Config:\n    pass\n"}
    assert list(duplicate_classes(nested)) == ["Config"]
    mirror = {"holdback/models.py": "class RequestStatus:\n    pass\n",
              "model_sim/request.py": "class RequestStatus:\n    pass\n"}
    assert duplicate_classes(mirror) == {}
    elsewhere = {**mirror, "gateway/flow/request.py": "class RequestStatus:\n    pass\n"}
    assert list(duplicate_classes(elsewhere)) == ["RequestStatus"], "the mirror lets off its own file only"


# --- file sizes ---------------------------------------------------------------------------------------------

MAX_LINES = 450  # a module past this holds more than one concern: split it by concern, not by trimming lines
MAX_TEST_LINES = 800


def line_limit(path: str) -> int:
    return MAX_TEST_LINES if Path(path).parts[0] == "tests" else MAX_LINES


def _python_files() -> list[Path]:
    """Every Python file of the repository, tests too; not the virtualenv, caches or other hidden folders."""
    return sorted(p for p in REPO.rglob("*.py")
                  if not any(part.startswith(".") or part == "node_modules" for part in p.relative_to(REPO).parts))


def test_no_file_is_over_its_line_limit() -> None:
    long = []
    for p in _python_files():
        path = str(p.relative_to(REPO))
        if (n := len(p.read_text().splitlines())) > line_limit(path):
            long.append(f"  {path}: {n} lines (the limit is {line_limit(path)})")
    assert not long, "files over their line limit (split them by concern):\n" + "\n".join(long)


def test_the_line_limits_tell_tests_from_the_rest() -> None:
    assert line_limit("tests/gateway/test_proxy.py") == MAX_TEST_LINES
    assert line_limit("gateway/proxy.py") == line_limit("examples/submit.py") == MAX_LINES
    assert len(_python_files()) > 300 and all(".venv" not in p.parts for p in _python_files())
