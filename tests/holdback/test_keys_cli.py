"""`holdback keys` works on the server's database: it says which one, refuses to create one that does not
exist unless asked, lists keys without their secrets and revokes them (a revoked key answers 401)."""

from __future__ import annotations

import re

import pytest

from holdback.cli import keys as keys_cli
from tests.batch_api.conftest import serve


@pytest.fixture
def in_dir(tmp_path, monkeypatch):
    """Run as from a directory with no platform: no DATABASE_URL, data dir ./data under tmp_path."""
    monkeypatch.chdir(tmp_path)
    for var in ("DATABASE_URL", "HOLDBACK_DATA_DIR"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def test_create_elsewhere_refuses_to_make_a_database_the_server_never_reads(in_dir, capsys):
    assert keys_cli.main(["create", "--tenant", "acme"]) == 2
    err = capsys.readouterr().err
    assert f"no database at {in_dir / 'data' / 'holdback.db'}" in err and "--create" in err
    assert not (in_dir / "data" / "holdback.db").exists(), "nothing is created without --create"
    assert keys_cli.main(["list"]) == 2


def test_create_with_create_starts_a_database_and_says_which(in_dir, capsys):
    assert keys_cli.main(["create", "--tenant", "acme", "--create"]) == 0
    out, err = capsys.readouterr()
    assert out.strip().startswith("hb-") and f"database: sqlite:///{in_dir / 'data' / 'holdback.db'}" in err
    assert keys_cli.main(["list"]) == 0  # exists now: no --create needed
    assert "acme" in capsys.readouterr().out


def test_list_and_revoke_on_the_servers_database_and_the_key_answers_401(backend, monkeypatch, capsys):
    for var, value in backend.env.items():
        monkeypatch.setenv(var, value)
    api = serve(backend.settings())
    try:
        assert keys_cli.main(["create", "--tenant", "acme"]) == 0
        secret = capsys.readouterr().out.strip()
        with api.http(secret) as c:
            assert c.get("/v1/batches").status_code == 200
        assert keys_cli.main(["list", "--tenant", "acme"]) == 0
        out, err = capsys.readouterr()
        assert "database: " in err and ("sqlite" if backend.kind == "embedded" else "postgresql") in err
        (row,) = [line for line in out.splitlines() if " acme " in line]
        assert secret not in out and secret[:8] in row and row.rstrip().endswith("-"), "listed, not revoked"
        key_id = row.split()[0]

        assert keys_cli.main(["revoke", key_id]) == 0
        assert f"revoked {key_id}" in capsys.readouterr().out
        with api.http(secret) as c:
            r = c.get("/v1/batches")
        assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
        assert keys_cli.main(["list", "--tenant", "acme"]) == 0
        assert not capsys.readouterr().out.splitlines()[1].rstrip().endswith("-"), "shows when it was revoked"
        assert keys_cli.main(["revoke", "key_nope"]) == 1
        assert "no key with id 'key_nope'" in capsys.readouterr().err
    finally:
        api.stop()


def test_the_keys_page_lists_keys_and_revokes_with_csrf_and_a_confirmation(backend):
    from tests.batch_api.test_admin_dashboard import signed_in

    api = serve(backend.settings())
    try:
        secret = api.create_key("globex")
        client, csrf = signed_in(api)
        page = client.get("/dashboard/keys")
        assert page.status_code == 200 and 'href="/dashboard/keys"' in page.text
        assert secret[:8] in page.text and secret not in page.text, "the prefix, never the secret"
        key_id = re.search(r'data-key="(key_[0-9a-f]+)"', page.text).group(1)
        assert f'hx-post="/dashboard/keys/{key_id}/revoke"' in page.text and "hx-confirm=\"Revoke key" in page.text

        assert client.post(f"/dashboard/keys/{key_id}/revoke").status_code == 403, "no CSRF token, no revoke"
        with api.http(secret) as c:
            assert c.get("/v1/batches").status_code == 200
        r = client.post(f"/dashboard/keys/{key_id}/revoke", headers={"x-csrf-token": csrf})
        assert r.status_code == 200 and "Revoked key" in r.text and r.headers["hx-trigger"] == "refresh"
        with api.http(secret) as c:
            assert c.get("/v1/batches").status_code == 401
        again = client.post(f"/dashboard/keys/{key_id}/revoke", headers={"x-csrf-token": csrf})
        assert "already revoked" in again.text
        gone = client.post("/dashboard/keys/key_nope/revoke", headers={"x-csrf-token": csrf})
        assert gone.status_code == 404 and "No key key_nope" in gone.text
        fragment = client.get("/dashboard/fragments/keys").text
        assert "badge-revoked" in fragment and f'hx-post="/dashboard/keys/{key_id}/revoke"' not in fragment
    finally:
        api.stop()
