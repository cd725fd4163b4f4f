"""The headers of an attempt: what every request to the gateway carries, and how an answer's headers are read.

Objective and fairness id go in llm-d's spelling and in the Gateway API Inference Extension's, so that every
gateway in front of the replicas (ours, llm-d's, the extension's endpoint picker) reads them.
"""

from __future__ import annotations

from collections.abc import Mapping

from holdback.contract import (
    AT_RISK_HEADER,
    BATCH_OBJECTIVE,
    DEADLINE_HEADER,
    FAIRNESS_HEADER,
    FAIRNESS_HEADER_ALIASES,
    OBJECTIVE_HEADER,
    OBJECTIVE_HEADER_ALIASES,
    REQUEST_ID_HEADER,
)


def request_headers(
    request_id: str,
    tenant_id: str,
    deadline: float | None,
    gateway_key: str | None = None,
    objective: str = BATCH_OBJECTIVE,
    *,
    at_risk: bool = False,
) -> dict[str, str]:
    """The headers of every attempt: objective, fairness id, the request id (stable across attempts), deadline,
    key; and whether its batch is at risk of missing its window."""
    headers = {"content-type": "application/json"}
    for name in (OBJECTIVE_HEADER, *OBJECTIVE_HEADER_ALIASES):
        headers[name] = objective
    for name in (FAIRNESS_HEADER, *FAIRNESS_HEADER_ALIASES):
        headers[name] = tenant_id
    headers[REQUEST_ID_HEADER] = request_id
    if deadline is not None:
        headers[DEADLINE_HEADER] = str(int(deadline))
    if at_risk:
        headers[AT_RISK_HEADER] = "1"
    if gateway_key:
        headers["authorization"] = f"Bearer {gateway_key}"
    return headers


def header(headers: Mapping[str, str], name: str) -> str | None:
    """One header of an answer, whatever its case."""
    value = headers.get(name)
    if value is None:
        # Plain dicts are case-sensitive; multidicts and httpx headers are not.
        lowered = name.lower()
        for key, v in headers.items():
            if key.lower() == lowered:
                return v
    return value
