"""The one registry of policy names per kind: what a config may name, and what gateway/assembly.py builds.

The config's models check a name against its kind here (an unknown one is refused at load, naming the key and
the choices); each policy module maps the same names to its implementations with `implemented`, which fails at
import if the two lists differ, so a name cannot be valid in a config and unknown to the code or the other way
round. This module imports nothing of the gateway: the settings stand on it without a circle.
"""

from __future__ import annotations

from typing import Annotated, Mapping, TypeVar

from pydantic import AfterValidator

POLICIES: dict[str, tuple[str, ...]] = {
    "fairness": ("global-strict", "round-robin"),
    "ordering": ("fcfs", "edf"),
    "saturation detector": ("concurrency", "utilization"),
    "usage limit": ("priority-holdback", "static", "adaptive-reserve"),
    "eviction": ("none", "newest-first", "least-refill", "cost-ranked"),
    "picker": ("least-loaded", "kv-headroom", "prefix-affinity"),
}

T = TypeVar("T")


def _checked(kind: str):  # noqa: ANN202
    names = POLICIES[kind]

    def check(name: str) -> str:
        if name not in names:
            raise ValueError(f"unknown {kind} policy {name!r}; choose one of " + ", ".join(f"'{n}'" for n in names))
        return name
    return check


# The type of a config field naming a policy of each kind: a str checked against the registry.
FairnessName = Annotated[str, AfterValidator(_checked("fairness"))]
OrderingName = Annotated[str, AfterValidator(_checked("ordering"))]
DetectorName = Annotated[str, AfterValidator(_checked("saturation detector"))]
UsageLimitName = Annotated[str, AfterValidator(_checked("usage limit"))]
EvictionName = Annotated[str, AfterValidator(_checked("eviction"))]
PickerName = Annotated[str, AfterValidator(_checked("picker"))]


def implemented(kind: str, implementations: Mapping[str, T]) -> dict[str, T]:
    """`implementations` by name, which must be exactly the registry's names of `kind`."""
    if set(implementations) != set(POLICIES[kind]):
        raise RuntimeError(f"the {kind} policies implemented {sorted(implementations)} differ from the names a "
                           f"config may give {sorted(POLICIES[kind])} (gateway/settings/names.py)")
    return dict(implementations)
