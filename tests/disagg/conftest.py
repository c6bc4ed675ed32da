"""Fixtures: a real PD deployment on 127.0.0.1 — a prefill server, a decode server, a PD router — and one
co-located server as the reference, all shared by the session.

Servers run the tiny model in float32 with --enable-deterministic-inference (greedy outputs are compared
across batch shapes and servers), with small pools, and talk through the real Mooncake transfer engine
over TCP (MC_LEGACY_RPC_PORT_BINDING=1, MC_TCP_BIND_ADDRESS=127.0.0.1 from the mooncake_env fixture).
Every process runs in its own session and is stopped by PID, even when a test fails.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import pytest
import requests

from kvstrata.args import DISAGGREGATION_SECRET_ENV
from kvstrata.bench.launcher import ServerProcess, free_port
from kvstrata.disagg.shard import FAULT_DELAY_ENV

TIMEOUT_S = 5.0       # --disaggregation-bootstrap-timeout of every PD server here
SECRET = "pd-test-secret-0123456789abcdef"   # the group's --disaggregation-secret
SECRET_ENV = {DISAGGREGATION_SECRET_ENV: SECRET}
SERVER_FLAGS = ["--max-total-tokens", "2048", "--page-size", "4", "--random-seed", "0", "--log-level", "warning",
                "--dtype", "float32", "--enable-deterministic-inference", "--num-threads", "1",
                "--max-running-requests", "48"]
ROUTER_FLAGS = ["--log-level", "warning", "--health-check-interval-secs", "0.5",
                "--worker-load-check-interval", "0.5"]


def pd_flags(mode: str, bootstrap_port: Optional[int] = None, secret: Optional[str] = None) -> list[str]:
    """Server flags of one PD role (`secret`: as a flag; the fixtures give it by environment otherwise)."""
    flags = [*SERVER_FLAGS, "--disaggregation-mode", mode, "--disaggregation-transfer-backend", "mooncake",
             "--disaggregation-bootstrap-timeout", str(TIMEOUT_S)]
    if secret is not None:
        flags += ["--disaggregation-secret", secret]
    if bootstrap_port is not None:
        flags += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    return flags


class Deployment:
    """The session's processes."""

    def __init__(self, log_dir: Path):
        self.bootstrap_port = free_port()
        # The secret reaches the prefill as a flag and the decode by environment: both ways are exercised.
        self.prefill = ServerProcess(pd_flags("prefill", self.bootstrap_port, SECRET), str(log_dir / "prefill.log"))
        self.decode = ServerProcess(pd_flags("decode"), str(log_dir / "decode.log"), env=SECRET_ENV)
        self.colocated = ServerProcess(SERVER_FLAGS, str(log_dir / "colocated.log"))
        # A prefill whose every write waits 30 s first, so that a test can kill it mid-transfer.
        self.doomed_port = free_port()
        self.doomed_prefill = ServerProcess(pd_flags("prefill", self.doomed_port), str(log_dir / "doomed.log"),
                                            env={FAULT_DELAY_ENV: "30", **SECRET_ENV})
        self.router = ServerProcess(["--pd-disaggregation", "--prefill", self.prefill.url, str(self.bootstrap_port),
                                     "--decode", self.decode.url, *ROUTER_FLAGS], str(log_dir / "router.log"),
                                    module="kvstrata.router")

    def start(self) -> None:
        """Start the servers at once, then the router."""
        servers = [self.prefill, self.decode, self.colocated, self.doomed_prefill]
        with ThreadPoolExecutor(len(servers)) as pool:
            list(pool.map(lambda p: p.start(), servers))
        self.router.start()
        wait_for(lambda: len(requests.get(self.router.url + "/list_workers", timeout=5).json()["urls"]) == 2
                 and all(w["healthy"] for w in requests.get(self.router.url + "/list_workers",
                                                            timeout=5).json()["workers"]), what="router ready")

    def stop(self) -> None:
        """Stop every process by PID."""
        for p in (self.router, self.prefill, self.decode, self.colocated, self.doomed_prefill):
            p.stop()


@pytest.fixture(scope="session")
def pd(mooncake_env, tmp_path_factory) -> Iterator[Deployment]:
    """Prefill + decode + PD router + a co-located reference server."""
    d = Deployment(tmp_path_factory.mktemp("pd"))
    try:
        d.start()
        yield d
    finally:
        d.stop()


def state(url: str) -> dict:
    """The scheduler's internal state of the server at `url`."""
    r = requests.get(url + "/server_info", timeout=30)
    r.raise_for_status()
    return r.json()["internal_states"][0]


def wait_idle(url: str, timeout_s: float = 30.0) -> dict:
    """Poll until nothing runs, waits or is handed off on the server; returns that state (integrity checked)."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = state(url)
        if "integrity_ok" in s:
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} still busy after {timeout_s} s: {s}")
        time.sleep(0.1)


def wait_for(predicate, timeout_s: float = 60.0, what: str = "condition") -> None:
    """Poll `predicate` until true; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(requests.RequestException):
            if predicate():
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def generate(url: str, body: dict, timeout: float = 120.0) -> requests.Response:
    """POST /generate."""
    return requests.post(url + "/generate", json=body, timeout=timeout)


def greedy(text: str, max_new_tokens: int = 12, **extra) -> dict:
    """A greedy /generate body."""
    return {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}, **extra}
