"""Policies read views only: no module of gateway/policies/ imports flow control's own (mutable) modules or the
replica pool, and gateway/flow/views.py imports nothing of ours, so a policy cannot reach a queue, a band, a
request or a replica to change it, and the band <-> fairness import circle cannot come back."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"
# What a policy may import of the gateway: the views, the config it is chosen by, and the other policies.
ALLOWED = ("gateway.flow.views", "gateway.settings", "gateway.policies")


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def _allowed(module: str) -> bool:
    return not module.startswith("gateway") or any(module == a or module.startswith(a + ".") for a in ALLOWED)


@pytest.mark.parametrize("path", sorted((GATEWAY / "policies").glob("*.py")), ids=lambda p: p.name)
def test_a_policy_imports_views_not_flow_controls_types(path: Path) -> None:
    # gateway.calibration is imported for a type only (a profile's block size), never to change anything.
    wrong = [f"{path.name}:{line} imports {module}" for line, module in _imports(path)
             if not _allowed(module) and module != "gateway.calibration"]
    assert not wrong, wrong


def test_the_views_import_nothing_of_ours() -> None:
    ours = [module for _line, module in _imports(GATEWAY / "flow" / "views.py")
            if module.split(".")[0] in ("gateway", "holdback", "model_sim")]
    assert not ours, ours
