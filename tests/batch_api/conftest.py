"""Fixtures for the API tests: the real app served by uvicorn on a free port, real HTTP.

Each test gets its own server on its own backend (see tests/conftest.py). The server runs in a
background thread so a test can pick the settings it needs (small upload limits, a dead Redis);
tests/batch_api/test_cli.py starts it the operator's way, as a `holdback api` subprocess.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Iterator

import httpx
import pytest
import uvicorn
from openai import OpenAI

from batch_api.app import create_app
from holdback.settings import Settings
from tests.support import free_port


@dataclass
class ApiServer:
    settings: Settings
    port: int
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def http(self, key: str | None = None) -> httpx.Client:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def openai(self, key: str) -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0)

    def create_key(self, tenant: str) -> str:
        r = httpx.post(
            f"{self.url}/admin/keys",
            json={"tenant": tenant},
            headers={"authorization": f"Bearer {self.settings.admin_key}"},
            timeout=30,  # a loaded machine can take more than httpx's default 5 s for a fresh process's first call
        )
        assert r.status_code == 201, r.text
        return r.json()["key"]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def serve(settings: Settings) -> ApiServer:
    port = free_port()
    config = uvicorn.Config(
        create_app(settings), host="127.0.0.1", port=port, log_config=None, access_log=False, lifespan="on",
        proxy_headers=False,  # as `holdback api` runs it (batch_api/cli.py)
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"api-{port}", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the API server thread exited during start-up; see the log above")
        thread.join(0.02)
    return ApiServer(settings, port, server, thread)


@pytest.fixture
def start_api(backend) -> Iterator[Callable[..., ApiServer]]:  # noqa: ANN001
    """Start an API server on this test's backend; keyword arguments override settings."""
    servers: list[ApiServer] = []

    def start(**overrides) -> ApiServer:
        server = serve(backend.settings(**overrides))
        servers.append(server)
        return server

    yield start
    for server in reversed(servers):
        server.stop()


@pytest.fixture
def api(start_api) -> ApiServer:  # noqa: ANN001
    return start_api()
