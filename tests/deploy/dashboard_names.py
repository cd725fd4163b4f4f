"""The metric names a PromQL expression reads, and the names a component's `/metrics` page exports, so the
Grafana dashboard and the alert rules can be checked against what the running components really serve."""

from __future__ import annotations

import json
import re

import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.deploy_files import DEPLOY

DASHBOARD = DEPLOY / "k8s" / "base" / "grafana-dashboard.json"
RULES = DEPLOY / "k8s" / "base" / "prometheusrule.yaml"

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or",
             "unless", "inf", "nan"}
_NAME = re.compile(r"(?<![\w:.])[a-zA-Z_:][a-zA-Z0-9_:]*")  # not the unit of a duration or number
# Exposition names of each family type: a counter `x` is served as `x_total` (and `x_created`), and so on.
_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
             "summary": ("", "_count", "_sum", "_created"), "gauge": ("",), "info": ("_info",),
             "stateset": ("",), "gaugehistogram": ("_bucket", "_gcount", "_gsum"), "unknown": ("",)}


def promql_metric_names(expr: str) -> set[str]:
    """Every metric name `expr` selects: identifiers that are not functions, keywords, label names in
    matchers or in by/without/on/ignoring/group_* lists, durations, strings or numbers."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings (label values) first: they may hold anything
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in _NAME.finditer(text):
        word = match.group()
        if text[match.end():].lstrip().startswith("("):
            continue  # a function (or an aggregation with its clause after the argument)
        if word.lower() in _KEYWORDS or word.startswith("$"):
            continue
        names.add(word)
    return names


def exported_names(metrics_text: str) -> set[str]:
    """Every sample name a `/metrics` page can serve, including families that have no labelled child yet."""
    names = set()
    for family in text_string_to_metric_families(metrics_text):
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]


def rule_expressions() -> list[str]:
    rules = yaml.safe_load(RULES.read_text())
    return [r["expr"] for group in rules["spec"]["groups"] for r in group["rules"]]


def unknown_names(exprs: list[str], exported: set[str]) -> dict[str, list[str]]:
    """Metric name → the expressions reading it, for every name no component exports."""
    missing: dict[str, list[str]] = {}
    for expr in exprs:
        for name in sorted(promql_metric_names(expr) - exported):
            missing.setdefault(name, []).append(expr)
    return missing
