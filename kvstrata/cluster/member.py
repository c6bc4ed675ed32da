"""One local member: its process (own session, log file, CPU affinity), readiness probe and stop by PID."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import requests

from kvstrata.cluster.plan import MemberCommand
from kvstrata.cluster.spec import RoleSpec, parse_cpu_list
from kvstrata.process import stop_group

REPO_ROOT = str(Path(__file__).resolve().parents[2])
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_S = 60.0           # ready this long after a restart: the backoff starts over


class MemberError(RuntimeError):
    """A member exited or did not become ready; the message ends with its log tail."""


@dataclass
class Member:
    """A member's command, process and bookkeeping. `state` is one of
    starting | ready | restarting (waiting for its backoff or its dependencies) | upgrading | stopped."""

    role: RoleSpec
    cmd: MemberCommand
    log_path: Path
    proc: Optional[subprocess.Popen] = None
    state: str = "stopped"
    restarts: int = 0
    backoff_s: float = BACKOFF_FIRST_S
    restart_at: float = 0.0
    ready_since: float = 0.0
    history: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        """role-index."""
        return self.cmd.name

    @property
    def pid(self) -> Optional[int]:
        """PID of the running process (also its process group), if any."""
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    @property
    def url(self) -> Optional[str]:
        """Base URL of an HTTP member."""
        port = self.cmd.ports.get("http")
        return f"http://127.0.0.1:{port}" if port else None

    # ------------------------------------------------------------------ process
    def spawn(self) -> None:
        """Start the process in its own session, appending to its log."""
        if self.cmd.probe.kind == "file":
            Path(self.cmd.probe.path).unlink(missing_ok=True)
        env = child_env(self.cmd.env | self.cmd.secret_env)
        program = sys.executable if self.cmd.program == "python" else self.cmd.program
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"--- {time.strftime('%H:%M:%S')} start: {program} {' '.join(self.cmd.args)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen([program, *self.cmd.args], stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        if self.role.resources.cpu_cores:
            os.sched_setaffinity(self.proc.pid, parse_cpu_list(self.role.resources.cpu_cores))
        self.state = "starting"

    def exited(self) -> bool:
        """Whether a process was started and has exited."""
        return self.proc is not None and self.proc.poll() is not None

    def stop(self, grace_s: Optional[float] = None) -> None:
        """SIGTERM the process group, SIGKILL after `grace_s` (default: long enough to drain and to write
        an L2 snapshot); reap it."""
        if grace_s is None:
            grace_s = self.cmd.stop_grace_s
        proc = self.proc
        if proc is not None:
            stop_group(proc.pid, grace_s=grace_s)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.state = "stopped"

    # ------------------------------------------------------------------ readiness
    def healthy(self) -> bool:
        """Running and its probe passes."""
        return self.pid is not None and probe_ok(self.cmd)

    def wait_ready(self, timeout_s: Optional[float] = None) -> None:
        """Block until the probe passes; MemberError if the process exits or time runs out."""
        timeout_s = self.role.readiness.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while not probe_ok(self.cmd):
            if self.exited():
                raise MemberError(f"{self.name} exited with code {self.proc.returncode} before it was ready; "
                                  f"log {self.log_path}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise MemberError(f"{self.name} not ready after {timeout_s:g} s; log {self.log_path}:\n"
                                  f"{self.log_tail()}")
            time.sleep(self.role.readiness.period_s)
        self.mark_ready()

    def mark_ready(self) -> None:
        """Record that the member became ready."""
        self.state = "ready"
        self.ready_since = time.monotonic()

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the member's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def status(self) -> dict:
        """What `kvstrata cluster status` shows of this member."""
        return {"name": self.name, "role": self.role.name, "kind": self.role.kind, "index": self.cmd.index,
                "pid": self.pid, "ports": dict(self.cmd.ports), "state": self.state,
                "healthy": self.healthy(), "restarts": self.restarts, "log": str(self.log_path)}


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment plus `extra`, with this checkout importable (`-m kvstrata...`)."""
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH", "")) if p)
    return env


def probe_ok(cmd: MemberCommand) -> bool:
    """Run the member's readiness probe once."""
    probe = cmd.probe
    if probe.kind == "file":
        return os.path.exists(probe.path)
    if probe.kind == "tcp":
        return all(_port_open(cmd.ports[name]) for name in probe.ports)
    try:
        url = f"http://127.0.0.1:{cmd.ports[probe.ports[0]]}{probe.path}"
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False
