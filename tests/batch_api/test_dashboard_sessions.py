"""Dashboard sessions live in Redis as well as in the signed cookie: signing out ends the session on the
server (a copied cookie replayed afterwards is refused), a new admin key ends every session, and sign-in
is limited per client address, counted in Redis so that every API process shares the count.
"""

from __future__ import annotations

import re

import httpx

from tests.batch_api.conftest import serve
from tests.batch_api.test_admin_dashboard import signed_in

COOKIE = "holdback_dashboard"


def test_a_cookie_replayed_after_logout_is_refused(api):
    client, csrf = signed_in(api)
    stolen = client.cookies[COOKIE]
    assert httpx.get(api.url + "/dashboard", cookies={COOKIE: stolen}).status_code == 200
    assert client.post("/dashboard/logout", headers={"x-csrf-token": csrf}).status_code == 204
    for path in ("/dashboard", "/dashboard/queues"):
        r = httpx.get(api.url + path, cookies={COOKIE: stolen})
        assert r.status_code == 303 and r.headers["location"].startswith("/dashboard/login"), path
    r = httpx.get(api.url + "/dashboard/fragments/batches", cookies={COOKIE: stolen}, headers={"hx-request": "true"})
    assert r.status_code == 401
    # The login form no longer takes the replayed cookie for a session either.
    assert httpx.get(api.url + "/dashboard/login", cookies={COOKIE: stolen}).status_code == 200
    # Another session of the same operator is untouched by this sign-out.
    other, _ = signed_in(api)
    assert other.get("/dashboard").status_code == 200


def test_a_session_is_shared_by_api_processes_and_ended_by_a_new_admin_key(backend, start_api):
    first = start_api()
    second = start_api()  # another API process on the same database and Redis
    client, csrf = signed_in(first)
    token = client.cookies[COOKIE]
    assert httpx.get(second.url + "/dashboard", cookies={COOKIE: token}, timeout=30).status_code == 200
    # Signing out on one process ends the session on the other.
    assert client.post("/dashboard/logout", headers={"x-csrf-token": csrf}).status_code == 204
    assert httpx.get(second.url + "/dashboard", cookies={COOKIE: token}, timeout=30).status_code == 303

    client, _ = signed_in(first)
    token = client.cookies[COOKIE]
    rotated = serve(backend.settings(admin_key="hb-admin-rotated-key"))
    try:
        assert httpx.get(rotated.url + "/dashboard", cookies={COOKIE: token}, timeout=30).status_code == 303
    finally:
        rotated.stop()


def _login(api, key: str) -> httpx.Response:  # noqa: ANN001
    return httpx.post(api.url + "/dashboard/login", data={"admin_key": key, "next": "/dashboard"}, timeout=30)


def test_login_is_rate_limited_per_client_across_processes(start_api):
    first = start_api()
    second = start_api()
    for _ in range(5):
        assert _login(first, "wrong-guess").status_code == 401
    # The sixth try, even with the right key and on another API process, waits.
    for api in (first, second):
        r = _login(api, api.settings.admin_key)
        assert r.status_code == 429, r.text
        retry_after = int(r.headers["retry-after"])
        assert 1 <= retry_after <= 60
        assert "set-cookie" not in r.headers
        assert re.search(r"Too many failed sign-ins", r.text) and f"{retry_after} s" in r.text


def test_a_successful_sign_in_clears_the_failures_before_the_limit(api):
    for _ in range(4):
        assert _login(api, "wrong-guess").status_code == 401
    assert _login(api, api.settings.admin_key).status_code == 303
    # The count starts again: four more failures are still answered 401, not 429.
    for _ in range(4):
        assert _login(api, "wrong-guess").status_code == 401
