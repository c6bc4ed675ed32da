"""Pytest fixtures (a plugin loaded by tests/conftest.py): a real Mooncake cluster (master, metadata server,
127.0.0.1, started once per session, plus a private one for tests that kill its services.

Mooncake tests skip only when the package cannot be imported (the reason is printed in the report
header and on every skip); with KVSTRATA_REQUIRE_MOONCAKE=1 or where everything must run (CI=true,
KVSTRATA_REQUIRE_ALL=1: tests/capabilities.py) they fail instead of skipping.
"""

from __future__ import annotations

import os

import pytest

from kvstrata.storage.errors import StorageError
from kvstrata.storage.mooncake_config import MIB, import_mooncake
from kvstrata.storage.mooncake_services import MOONCAKE_ENV, MooncakeCluster
from tests.capabilities import REQUIRE_ALL


def _mooncake_unavailable() -> str | None:
    try:
        import_mooncake()
    except StorageError as e:
        return str(e)
    return None


MOONCAKE_MISSING = _mooncake_unavailable()


def pytest_report_header(config) -> str:
    if MOONCAKE_MISSING:
        return f"mooncake: NOT AVAILABLE, mooncake tests will be skipped: {MOONCAKE_MISSING}"
    return "mooncake: available"


@pytest.fixture(scope="session")
def mooncake_env():
    """The Mooncake client settings of this process: bind to 127.0.0.1 (restored afterwards)."""
    if MOONCAKE_MISSING:
        message = f"MOONCAKE UNAVAILABLE: {MOONCAKE_MISSING}"
        if os.environ.get("KVSTRATA_REQUIRE_MOONCAKE") == "1" or REQUIRE_ALL:
            pytest.fail(message)
        pytest.skip(message)
    saved = {key: os.environ.get(key) for key in MOONCAKE_ENV}
    os.environ.update(MOONCAKE_ENV)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def mooncake_cluster(mooncake_env, tmp_path_factory):
    """A shared cluster with 128 MiB of store memory; tests use their own keys and never stop it."""
    with MooncakeCluster(workdir=tmp_path_factory.mktemp("mooncake"), segment_bytes=128 * MIB) as cluster:
        yield cluster


@pytest.fixture
def own_mooncake_cluster(mooncake_env, tmp_path):
    """A private cluster for one test that kills or restarts its services."""
    with MooncakeCluster(workdir=tmp_path / "mooncake", segment_bytes=32 * MIB) as cluster:
        yield cluster
