"""The Keys page's gateway keys (issue #49): the realtime, standard and batch keys `holdback up` made and the
workers' key, each with its objectives, where it comes from, a prefix and a fingerprint (never the secret), and
whether the gateway accepts it, asked of a real `holdback gateway` on its shipped config.
"""

from __future__ import annotations

import hashlib
import html
import re

import yaml

from batch_api.dashboard.gateway_keys import ROLES
from holdback.cli.up import local_keys
from holdback.db import make_engine, make_sessionmaker
from tests.batch_api.test_admin_dashboard import signed_in
from tests.support import REPO, Processes, free_port, wait_http


def rows(page: str) -> dict[str, str]:
    """Each gateway key's table row by its name, its text unescaped."""
    return {name: html.unescape(row) for name, row in re.findall(r'<tr data-gateway-key="([^"]+)">(.*?)</tr>', page, re.S)}


def test_the_keys_page_lists_the_gateway_keys_holdback_up_made_and_whether_the_gateway_takes_them(
        start_api, backend, tmp_path):
    engine = make_engine(backend.database_url)
    keys = local_keys(backend.settings(), make_sessionmaker(engine))  # local-keys.json, as `holdback up` makes it
    engine.dispose()
    # The shipped config; the standard key's variable is left unset, so the gateway skips that entry.
    env = {"HOLDBACK_GATEWAY_REALTIME_KEY": keys["realtime"], "HOLDBACK_GATEWAY_BATCH_KEY": keys["batch_gateway"],
           "HOLDBACK_ADMIN_KEY": backend.admin_key, "HOLDBACK_GATEWAY_STANDARD_KEY": ""}
    with Processes(env=env, log_dir=tmp_path / "logs") as procs:
        port = free_port()
        gateway = procs.start("gateway", "--port", str(port), name="gateway")
        wait_http(f"http://127.0.0.1:{port}/health", proc=gateway)
        api = start_api(gateway_url=f"http://127.0.0.1:{port}", gateway_key=keys["batch_gateway"])
        client, _ = signed_in(api)
        page = client.get("/dashboard/keys").text

    assert 'data-testid="gateway-keys"' in page and 'data-testid="gateway-open"' not in page
    shown = rows(page)
    assert list(shown) == ["realtime", "standard", "batch"], "the workers' key is the batch key: one row"
    for name, stored in (("realtime", "realtime"), ("standard", "standard"), ("batch", "batch_gateway")):
        secret = keys[stored]
        assert secret not in page, f"the {name} key's secret is on the page"
        assert hashlib.sha256(secret.encode()).hexdigest()[:12] in shown[name]
        assert f"{secret[:8]}…" in shown[name] and f'"{stored}"' in shown[name]
    assert "realtime, standard, batch" in shown["realtime"] and "default realtime" in shown["realtime"]
    assert "$HOLDBACK_GATEWAY_BATCH_KEY" in shown["batch"] and "HOLDBACK_GATEWAY_KEY" in shown["batch"]
    assert "badge-accepted" in shown["realtime"] and "badge-accepted" in shown["batch"]
    assert "badge-refused" in shown["standard"] and "401 invalid_api_key" in shown["standard"]


def test_without_local_keys_the_page_lists_the_workers_key_and_says_what_it_cannot_know(start_api):
    page_of = lambda api: signed_in(api)[0].get("/dashboard/keys").text  # noqa: E731
    none = page_of(start_api(gateway_url="http://127.0.0.1:9", gateway_key=None))
    assert "This server knows no gateway key" in none and 'data-testid="gateway-keys-unasked"' not in none

    page = page_of(start_api(gateway_url="http://127.0.0.1:9", gateway_key="hb-workers-own-key-0123456789"))
    shown = rows(page)
    assert list(shown) == ["workers"] and "hb-worke…" in shown["workers"]
    assert "hb-workers-own-key-0123456789" not in page
    assert "HOLDBACK_GATEWAY_KEY" in shown["workers"] and "not asked" in shown["workers"]
    assert 'data-testid="gateway-keys-unasked"' in page, "the gateway is down: said, not guessed"
    assert "cannot read" in page and "gateway/default.yaml" in page


def test_an_open_gateway_is_said_to_accept_any_key(start_api, tmp_path):
    with Processes(log_dir=tmp_path / "logs") as procs:
        port = free_port()
        config = tmp_path / "open.yaml"
        config.write_text("keys: []\n")
        gateway = procs.start("gateway", "--port", str(port), "--config", str(config), name="gateway")
        wait_http(f"http://127.0.0.1:{port}/health", proc=gateway)
        api = start_api(gateway_url=f"http://127.0.0.1:{port}", gateway_key="hb-any-key-at-all")
        page = signed_in(api)[0].get("/dashboard/keys").text
    assert 'data-testid="gateway-open"' in page and "badge-accepted" in rows(page)["workers"]


def test_the_roles_are_what_the_shipped_gateway_config_grants():
    shipped = yaml.safe_load((REPO / "gateway" / "default.yaml").read_text())["keys"]
    by_env = {entry["key_env"]: entry for entry in shipped}
    assert set(by_env) == {role.env for role in ROLES}
    for role in ROLES:
        entry = by_env[role.env]
        assert (tuple(entry["objectives"]), entry.get("defaultObjective"), entry.get("relaysTenants", False)) == \
            (role.objectives, role.default_objective, role.relays_tenants), role.name
