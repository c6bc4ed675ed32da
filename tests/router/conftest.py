"""Fixtures: two real tiny-model workers (shared by the whole session) and routers started per test.

Workers run in float32 so that greedy outputs do not depend on the batch a request lands in (bf16 does,
until the deterministic-inference work lands), which lets tests compare answers across workers.
Every process is started in its own session and stopped by PID, even when a test fails.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from kvstrata.bench.launcher import ServerProcess

WORKER_FLAGS = ["--max-total-tokens", "4096", "--random-seed", "0", "--log-level", "warning",
                "--dtype", "float32", "--num-threads", "1"]
ROUTER_FLAGS = ["--log-level", "warning", "--health-check-interval-secs", "0.5",
                "--worker-load-check-interval", "0.5"]


class Workers:
    """The session's worker processes; `restart(i)` brings one back on the same port."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs = [ServerProcess(WORKER_FLAGS, str(log_dir / f"worker{i}.log")) for i in range(2)]

    @property
    def urls(self) -> list[str]:
        """Base URLs, in order."""
        return [p.url for p in self.procs]

    def start_all(self) -> None:
        """Start every worker at once and wait until all are healthy."""
        with ThreadPoolExecutor(len(self.procs)) as pool:
            list(pool.map(lambda p: p.start(), self.procs))

    def restart(self, i: int) -> None:
        """Stop worker i if it runs, start a new one on the same port."""
        old = self.procs[i]
        old.stop()
        self.procs[i] = ServerProcess(WORKER_FLAGS, str(self.log_dir / f"worker{i}-restarted.log"),
                                      port=old.port)
        self.procs[i].start()

    def flush(self) -> None:
        """Empty every worker's prefix cache."""
        for url in self.urls:
            requests.post(url + "/flush_cache", timeout=60).raise_for_status()

    def stop_all(self) -> None:
        """Stop every worker by PID."""
        for p in self.procs:
            p.stop()


@pytest.fixture(scope="session")
def workers(tmp_path_factory) -> Iterator[Workers]:
    """Two workers for the whole session."""
    ws = Workers(tmp_path_factory.mktemp("router-workers"))
    try:
        ws.start_all()
        yield ws
    finally:
        ws.stop_all()


@contextlib.contextmanager
def run_router(worker_urls: list[str], log_path: Path, *flags: str) -> Iterator[ServerProcess]:
    """A router in front of `worker_urls`, stopped by PID on exit."""
    proc = ServerProcess(["--worker-urls", *worker_urls, *ROUTER_FLAGS, *flags], str(log_path),
                         module="kvstrata.router")
    with proc:
        yield proc


@pytest.fixture(scope="module")
def router(workers, tmp_path_factory) -> Iterator[ServerProcess]:
    """A tier_aware router over both workers, shared by a test module."""
    with run_router(workers.urls, tmp_path_factory.mktemp("router") / "router.log") as r:
        yield r


def wait_for(predicate, timeout_s: float = 30.0, what: str = "condition") -> None:
    """Poll `predicate` until true; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def list_workers(router: ServerProcess) -> dict[str, dict]:
    """/list_workers by URL."""
    r = requests.get(router.url + "/list_workers", timeout=10)
    r.raise_for_status()
    return {w["url"]: w for w in r.json()["workers"]}
