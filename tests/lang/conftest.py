"""Fixtures for the lang tests: one live server (tiny model, API key) and one in-process engine.

Both are package-scoped: started once for tests/lang and stopped (the server by PID, SIGTERM then
SIGKILL) after its last test, even when a test fails.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import kvstrata.lang as sgl
from kvstrata.bench.launcher import ServerProcess
from tests.server.conftest import server_env

API_KEY = "lang-test-key"
START_TIMEOUT_S = 180.0
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="package")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a `python -m kvstrata.launch_server` on the tiny model (requires API_KEY)."""
    flags = ["--model-path", "tiny", "--max-total-tokens", "8192", "--random-seed", "0", "--log-level", "warning",
             "--api-key", API_KEY, "--enable-deterministic-inference"]
    log_path = tmp_path_factory.mktemp("lang-server") / "server.log"
    with ServerProcess(flags, str(log_path), env=server_env()).start(START_TIMEOUT_S) as server:
        yield server.url


@pytest.fixture(scope="package")
def http_backend(server_url: str) -> Iterator[sgl.RuntimeEndpoint]:
    """RuntimeEndpoint on the live server."""
    backend = sgl.RuntimeEndpoint(server_url, api_key=API_KEY, timeout=120)
    yield backend
    backend.close()


@pytest.fixture(scope="package")
def engine_backend() -> Iterator[sgl.EngineBackend]:
    """EngineBackend owning an in-process engine with the server's settings."""
    backend = sgl.EngineBackend(model_path="tiny", max_total_tokens=8192, random_seed=0,
                                enable_deterministic_inference=True)
    yield backend
    backend.close()


@pytest.fixture(params=["http", "engine"])
def backend(request: pytest.FixtureRequest) -> sgl.Backend:
    """Each test that takes `backend` runs against the server and against the in-process engine."""
    return request.getfixturevalue(f"{request.param}_backend")
