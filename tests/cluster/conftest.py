"""A small role group run by the real `kvstrata cluster up` (one per module), stopped by PID afterwards."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from kvstrata.bench.launcher import free_port
from kvstrata.cluster import control
from kvstrata.cluster.control import ControlRequest
from kvstrata.process import stop_group

TEST_SPEC = """
name: kvt
roles:
  - name: mooncake-master
    kind: mooncake-master
  - name: mooncake-store
    kind: mooncake-store
    dependencies: [mooncake-master]
    args: {segment-size: 64mb}
  - name: worker
    kind: worker
    replicas: 2
    dependencies: [mooncake-master, mooncake-store]
    args: {model-path: tiny, page-size: 16, max-total-tokens: 2048, enable-hierarchical-cache: true,
           hicache-ratio: 2, hicache-mem-layout: page_first, hicache-storage-backend: mooncake,
           log-level: warning}
    resources: {threads: 1}
  - name: router
    kind: router
    dependencies: [worker]
    args: {policy: round_robin, health-check-interval-secs: 1, log-level: warning}
"""


class RunningGroup:
    """A `kvstrata cluster up` subprocess and what tests need of it."""

    def __init__(self, root: Path, spec_text: str = TEST_SPEC):
        self.spec_path = root / "spec.yaml"
        self.spec_path.write_text(spec_text)
        self.run_dir = root / "run"
        self.router_port = free_port()
        self.log_path = root / "up.log"
        self.proc: subprocess.Popen | None = None
        self.pids_seen: set[int] = set()

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def cli(self, command: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """Run `kvstrata cluster COMMAND [ROLE] SPEC ARGS --run-dir D` (`logs` takes its role first)."""
        head = [command, args[0], str(self.spec_path), *args[1:]] if command == "logs" else \
            [command, str(self.spec_path), *args]
        return subprocess.run([sys.executable, "-m", "kvstrata.cli", "cluster", *head,
                               "--run-dir", str(self.run_dir)], capture_output=True, text=True, timeout=timeout)

    def start(self, timeout_s: float = 240) -> None:
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvstrata.cli", "cluster", "up", str(self.spec_path),
                                          "--run-dir", str(self.run_dir), "--router-port", str(self.router_port)],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while "is up" not in self.log():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"`cluster up` did not come up:\n{self.log()[-3000:]}")
            time.sleep(0.5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def status(self) -> dict:
        data = control.call(str(self.run_dir / "control.sock"), ControlRequest("status"), timeout_s=30).data
        self.pids_seen |= {m["pid"] for r in data["roles"] for m in r["members"] if m["pid"]}
        return data

    def member(self, name: str) -> dict:
        return next(m for r in self.status()["roles"] for m in r["members"] if m["name"] == name)

    def generate(self, text: str, max_new_tokens: int = 4) -> dict:
        r = requests.post(self.router_url + "/generate", timeout=120, json={
            "text": text, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}})
        r.raise_for_status()
        return r.json()

    def kill_everything(self) -> None:
        """Finaliser: whatever a failed test left behind, by PID."""
        state_file = self.run_dir / "state.json"
        if state_file.exists():
            self.pids_seen |= {m["pid"] for m in json.loads(state_file.read_text())["members"] if m["pid"]}
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                stop_group(self.proc.pid, signal.SIGKILL)
        for pid in self.pids_seen:
            stop_group(pid, signal.SIGKILL, grace_s=1)


@pytest.fixture(scope="module")
def group(mooncake_env, tmp_path_factory):
    """The test group, up; stopped (and anything left killed by PID) at the end of the module."""
    g = RunningGroup(tmp_path_factory.mktemp("cluster"))
    try:
        g.start()
        g.status()
        yield g
    finally:
        g.kill_everything()


def pid_alive(pid: int) -> bool:
    """Whether a process exists (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False

