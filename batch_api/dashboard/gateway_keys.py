"""What the dashboard knows of the gateway's own API keys (realtime, standard, batch), for the Keys page: never a
secret, only its prefix and a fingerprint, where it comes from, and whether the gateway accepts it.

The gateway keeps its keys in its own config, out of the Batch API's reach. This server knows the ones
`holdback up` made (its data dir's local-keys.json, which `holdback up` hands the gateway through
$HOLDBACK_GATEWAY_*_KEY) and the workers' key (HOLDBACK_GATEWAY_KEY); it asks the gateway about each.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
from dataclasses import dataclass, field

import httpx
from starlette.concurrency import run_in_threadpool

from batch_api.dashboard.gateway_view import TIMEOUT
from holdback.cli.up import LOCAL_KEYS
from holdback.settings import Settings

PREFIX_CHARS = 8  # as much of a key as the tenant keys' list shows


@dataclass(frozen=True)
class KeyRole:
    """One of the gateway keys `holdback up` makes, with what the shipped gateway/default.yaml grants it."""

    name: str
    stored_as: str  # its name in local-keys.json
    env: str  # the variable `holdback up` passes it in, which default.yaml's `key_env` reads
    objectives: tuple[str, ...]
    default_objective: str | None
    relays_tenants: bool
    used_by: str


ROLES = (
    KeyRole("realtime", "realtime", "HOLDBACK_GATEWAY_REALTIME_KEY", ("realtime", "standard", "batch"), "realtime",
            False, "realtime clients: the highest priority, never evicted"),
    KeyRole("standard", "standard", "HOLDBACK_GATEWAY_STANDARD_KEY", ("standard", "batch"), None, False,
            "interactive clients that can wait for realtime"),
    KeyRole("batch", "batch_gateway", "HOLDBACK_GATEWAY_BATCH_KEY", ("batch",), None, True,
            "the Batch API's workers: the lowest priority, each request in its batch's tenant"),
)
BATCH_ROLE = ROLES[-1]


@dataclass
class GatewayKey:
    name: str
    prefix: str
    fingerprint: str
    sources: list[str]
    role: KeyRole | None = None
    accepted: bool | None = None  # None: not asked (the gateway did not answer)
    refusal: str = ""
    secret: str = field(default="", repr=False)  # to ask the gateway with; never rendered


@dataclass
class GatewayKeys:
    keys: list[GatewayKey]
    local_keys: str = ""  # the local-keys.json this server looks at
    problem: str | None = None  # it could not be read
    gateway_error: str | None = None  # the gateway could not be asked
    open_gateway: bool = False  # the gateway accepted a made-up key: it has no keys configured


def fingerprint(secret: str) -> str:
    """What `printf %s KEY | sha256sum` starts with: enough to tell two keys apart, nothing to rebuild one."""
    return hashlib.sha256(secret.encode()).hexdigest()[:12]


def known_keys(settings: Settings) -> GatewayKeys:
    """The gateway keys this server can know: local-keys.json's, then the workers' HOLDBACK_GATEWAY_KEY."""
    path = settings.data_dir.resolve() / LOCAL_KEYS
    found = GatewayKeys([], local_keys=str(path))
    stored: dict = {}
    try:
        stored = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError) as exc:
        found.problem = f"{path} could not be read ({type(exc).__name__}); its keys are not listed"
    for role in ROLES:
        secret = stored.get(role.stored_as) if isinstance(stored, dict) else None
        if isinstance(secret, str) and secret:
            found.keys.append(_key(role.name, secret, [f'{LOCAL_KEYS} "{role.stored_as}" → ${role.env}'], role))
    workers = settings.gateway_key
    if workers:
        source = "HOLDBACK_GATEWAY_KEY: the workers send it"
        same = next((k for k in found.keys if k.secret == workers), None)
        if same is not None:
            same.sources.append(source)
        else:
            found.keys.append(_key("workers", workers, [source], BATCH_ROLE))
    return found


async def gateway_keys(settings: Settings) -> GatewayKeys:
    found = await run_in_threadpool(known_keys, settings)
    await ask_gateway(found, settings.gateway_url)
    return found


async def ask_gateway(found: GatewayKeys, gateway_url: str, client: httpx.AsyncClient | None = None) -> None:
    """Whether the gateway accepts each key: its GET /v1/models refuses a key it does not know with 401. A
    made-up key asked alongside tells a gateway that checks keys from one that accepts anything."""
    if not found.keys:
        return
    own = client is None
    client = client or httpx.AsyncClient(timeout=TIMEOUT)
    url = gateway_url.rstrip("/") + "/v1/models"

    async def status(secret: str) -> tuple[int, str]:
        r = await client.get(url, headers={"Authorization": f"Bearer {secret}"}, timeout=TIMEOUT)
        code = ""
        if r.status_code in (401, 403):
            try:
                code = str((r.json().get("error") or {}).get("code") or "")
            except (ValueError, AttributeError):
                code = ""
        return r.status_code, code

    try:
        answers = await asyncio.gather(*(status(k.secret) for k in found.keys),
                                       status("hb-made-up-" + secrets.token_urlsafe(12)))
    except httpx.HTTPError as exc:
        found.gateway_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return
    finally:
        if own:
            await client.aclose()
    for key, (code, reason) in zip(found.keys, answers):
        key.accepted = code not in (401, 403)
        key.refusal = "" if key.accepted else f"{code} {reason}".strip()
    found.open_gateway = answers[-1][0] not in (401, 403)


def _key(name: str, secret: str, sources: list[str], role: KeyRole | None) -> GatewayKey:
    return GatewayKey(name, secret[:PREFIX_CHARS], fingerprint(secret), sources, role, secret=secret)
