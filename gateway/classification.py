"""Classification: who is calling (gateway API key → tenant and allowed objectives) and what they ask for.

The objective header (`holdback.contract.OBJECTIVE_HEADER`, or its older alias) names an
objective from the config, which gives the priority. A missing header means the caller's default objective;
an unknown name means the config's `defaultObjective` (priority 0). Either way the caller must be allowed
that objective, so a batch key can never reach realtime or priority 0. The fairness id is the caller's
tenant; only a trusted relay's key (`relaysTenants`, the Batch API workers') names in the fairness header the
tenant it carries, and then that tenant's fairness share, KV quota and prefix-cache scope apply. Any other
caller's fairness header is ignored: a keyless client sending a new id per request would otherwise take a
share of its own each time, escape its KV quota or charge another tenant's. The TTL header (or its deprecated llm-d-prefixed alias) and
the deadline header bound how long the request may wait in a queue.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from multidict import CIMultiDictProxy

from gateway.cache_salt import private_salt
from gateway.settings import LoadedConfig
from holdback.contract import (
    AT_RISK_HEADER,
    DEADLINE_HEADER,
    FAIRNESS_HEADER,
    FAIRNESS_HEADER_ALIASES,
    OBJECTIVE_HEADER,
    OBJECTIVE_HEADER_ALIASES,
    TTL_HEADER,
    TTL_HEADER_ALIASES,
)

OBJECTIVE_HEADERS = (OBJECTIVE_HEADER, *OBJECTIVE_HEADER_ALIASES)
FAIRNESS_HEADERS = (FAIRNESS_HEADER, *FAIRNESS_HEADER_ALIASES)
TTL_HEADERS = (TTL_HEADER, *TTL_HEADER_ALIASES)


class ClassificationError(Exception):
    """The request cannot be classified; carries the HTTP status and an OpenAI-style error code."""

    def __init__(self, status: int, code: str, message: str, err_type: str):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.err_type = err_type


@dataclass(frozen=True)
class Caller:
    tenant: str
    objectives: frozenset[str]
    default_objective: str | None
    # The prefix-cache scope of this caller's requests; None for a key marked sharePublicPrompts.
    cache_salt: str | None = None
    # A trusted relay: the fairness header names the tenant (see the module doc); its permission version
    # goes into each relayed tenant's salt.
    relays_tenants: bool = False
    permission_version: int = 1


@dataclass(frozen=True)
class Classification:
    objective: str
    priority: int
    fairness_id: str  # the tenant whose share, KV quota and cache scope apply (a relay's carried tenant)
    tenant: str  # the tenant of the key that called
    # Seconds the request may wait in a queue from now (inf: no request-level limit) and its absolute
    # deadline as seconds from now (inf: none); the smaller of TTL and deadline bounds the wait.
    wait_limit: float
    deadline_in: float
    cache_salt: str | None = None
    # A trusted relay (the workers' key) says the request's batch is at risk of missing its window.
    at_risk: bool = False


class Classifier:
    def __init__(self, loaded: LoadedConfig):
        cfg = loaded.config
        self.priorities = {name: obj.priority for name, obj in cfg.objectives.items()}
        self.default_objective = cfg.defaultObjective
        self.keys = {k.key: Caller(k.tenant, k.objectives, k.default_objective,
                                   None if k.share_public_prompts else private_salt(k.tenant, k.permission_version),
                                   k.relays_tenants, k.permission_version)
                     for k in loaded.keys}
        self.admin_keys = loaded.admin_keys
        anon = cfg.anonymous
        self.anonymous = (Caller(anon.tenant, frozenset(anon.objectives), anon.defaultObjective,
                                 private_salt(anon.tenant, 1), anon.relaysTenants) if anon.enabled else None)

    def _token(self, authorization: str | None) -> str | None:
        """The bearer token; with keys configured, any other `Authorization` value is refused (401)."""
        if authorization is None:
            return None
        scheme, _, value = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
        if self.keys or self.admin_keys:
            raise ClassificationError(401, "invalid_authorization", "The Authorization header must be "
                                      "`Bearer KEY` with a key from the gateway config; got a "
                                      f"{scheme[:20]!r} header without a bearer token.", "authentication_error")
        return None

    def admin(self, authorization: str | None) -> None:
        """Admin routes: open while no key is configured, else only for a key from `adminKeys`."""
        if not self.keys and not self.admin_keys:
            return
        if not self.admin_keys:
            raise ClassificationError(401, "missing_api_key", "This gateway has API keys but no adminKeys, so its "
                                      "admin routes are closed; add an adminKeys entry to the gateway config.",
                                      "authentication_error")
        token = self._token(authorization)
        if token is None:
            raise ClassificationError(401, "missing_api_key", "Admin routes need an admin key: send "
                                      "`Authorization: Bearer KEY` with a key from the gateway's adminKeys.",
                                      "authentication_error")
        if token not in self.admin_keys:
            raise ClassificationError(403, "admin_key_required", "This key may not use the gateway's admin "
                                      "routes; use a key from the gateway's adminKeys.", "permission_error")

    def caller(self, authorization: str | None) -> Caller:
        token = self._token(authorization)
        if self.keys and token is not None:
            caller = self.keys.get(token)
            if caller is None:
                raise ClassificationError(401, "invalid_api_key", "The gateway API key is not valid; send a key "
                                          "from the gateway config as `Authorization: Bearer KEY`.",
                                          "authentication_error")
            return caller
        if self.anonymous is None:
            raise ClassificationError(401, "missing_api_key", "This gateway needs an API key: send "
                                      "`Authorization: Bearer KEY` with a key from the gateway config.",
                                      "authentication_error")
        return self.anonymous

    def _allowed(self, caller: Caller, objective: str) -> bool:
        return "*" in caller.objectives or objective in caller.objectives

    def classify(self, headers: CIMultiDictProxy[str]) -> Classification:
        caller = self.caller(headers.get("Authorization"))
        asked = headers.get(OBJECTIVE_HEADERS[0]) or headers.get(OBJECTIVE_HEADERS[1])
        if asked:
            objective = asked if asked in self.priorities else self.default_objective
        else:
            objective = caller.default_objective or self._first_allowed(caller)
        if not self._allowed(caller, objective):
            allowed = "any" if "*" in caller.objectives else ", ".join(sorted(caller.objectives)) or "none"
            what = f"objective {asked!r}" if asked and asked == objective else (
                f"unknown objective {asked!r} (served as {objective!r})" if asked else f"objective {objective!r}")
            raise ClassificationError(403, "objective_not_allowed", f"Tenant {caller.tenant!r} may not use "
                                      f"{what}; its key allows: {allowed}.", "permission_error")
        fairness, salt = caller.tenant, caller.cache_salt
        if caller.relays_tenants:
            relayed = headers.get(FAIRNESS_HEADERS[0]) or headers.get(FAIRNESS_HEADERS[1])
            if relayed:
                fairness = _relayed_tenant(relayed)
                salt = None if salt is None else private_salt(fairness, caller.permission_version)
        wait_limit = deadline_in = math.inf
        ttl_header = next((h for h in TTL_HEADERS if h in headers), None)
        if ttl_header is not None:
            wait_limit = _seconds(headers[ttl_header], ttl_header, "a number of seconds, e.g. 30")
        deadline = headers.get(DEADLINE_HEADER)
        if deadline is not None:
            deadline_in = _seconds(deadline, DEADLINE_HEADER, "unix time in seconds") - time.time()
            wait_limit = min(wait_limit, deadline_in)
        at_risk = caller.relays_tenants and headers.get(AT_RISK_HEADER, "").strip() == "1"
        return Classification(objective, self.priorities[objective], fairness, caller.tenant, wait_limit,
                              deadline_in, salt, at_risk)

    def _first_allowed(self, caller: Caller) -> str:
        if "*" in caller.objectives or self.default_objective in caller.objectives:
            return self.default_objective
        # The lowest-priority objective the caller may use: never escalate by omission.
        allowed = sorted((o for o in caller.objectives if o in self.priorities), key=lambda o: self.priorities[o])
        return allowed[0] if allowed else self.default_objective


def _seconds(raw: str, header: str, what: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ClassificationError(400, "invalid_header", f"Header {header} must be {what}; got {raw!r}.",
                                  "invalid_request_error") from None
    if math.isnan(value) or value < 0:
        raise ClassificationError(400, "invalid_header", f"Header {header} must be {what} (not negative); "
                                  f"got {raw!r}.", "invalid_request_error")
    return value


# A relayed tenant id labels metrics and /admin/state: bounded and printable.
MAX_TENANT_ID = 128


def _relayed_tenant(value: str) -> str:
    value = value.strip()
    if not value or len(value) > MAX_TENANT_ID or not value.isprintable():
        raise ClassificationError(400, "invalid_fairness_id", f"The fairness header must name a tenant in 1 to "
                                  f"{MAX_TENANT_ID} printable characters; got {value[:40]!r}"
                                  f"{'…' if len(value) > 40 else ''}.", "invalid_request_error")
    return value
