"""Every repository path the README and the docs name exists: a reader who follows one finds the file.

A path is a `backticked` token whose first part is a top-level entry of the repository (`deploy/k8s/...`,
`gateway/default.yaml`, `tests/...::test_name`). Tokens with wildcards, placeholders or elisions are patterns,
not paths, and are left alone.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOKEN = re.compile(r"`([^`\s]+)`")
# Paths that a run or the user creates, never in a checkout; each with what creates it.
CREATED_LATER = {
    "data/local-keys.json": "`holdback up` writes the keys it made there on its first start",
    "deploy/.env": "the user copies deploy/compose.env.example to it",
}


def documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(REPO.glob("*/README.md"))]


def named_paths(text: str) -> set[str]:
    tops = {p.name for p in REPO.iterdir() if not p.name.startswith(".")}
    paths = set()
    for token in TOKEN.findall(text):
        if "..." in token or any(c in token for c in "*{}<>$…"):
            continue
        path = re.sub(r":\d+$", "", token.split("::")[0].split("#")[0].rstrip(".,:;)"))
        if "/" not in path:
            continue
        if path.split("/")[0] in tops:
            paths.add(path)
    return paths


def test_the_check_reads_paths_as_a_reader_would():
    text = ("see `deploy/k8s/base/gateway.yaml`, `tests/e2e/test_up.py::test_up_completes`, `gateway/README.md#eviction`"
            ", `docs/study/*/logs/`, `bench/...`, `http://host:8000/v1`, `holdback up`")
    assert named_paths(text) == {"deploy/k8s/base/gateway.yaml", "tests/e2e/test_up.py", "gateway/README.md"}


def test_every_path_the_readme_and_docs_name_exists():
    missing = {}
    for doc in documents():
        gone = sorted(p for p in named_paths(doc.read_text()) if p not in CREATED_LATER and not (REPO / p).exists())
        if gone:
            missing[doc.relative_to(REPO).as_posix()] = gone
    assert missing == {}, f"documents name files that are not in the repository: {missing}"
