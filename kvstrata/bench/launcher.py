"""Start a kvstrata server subprocess for a benchmark, wait until it is healthy, stop it by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import requests

from kvstrata.net import free_port  # noqa: F401  (re-exported for the benchmarks and tests)

STOP_TIMEOUT_S = 20.0


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time; the message ends with its log tail."""


class ServerProcess:
    """`python -m kvstrata.launch_server --host H --port P [args]` as a subprocess (its own session);
    `module="kvstrata.router"` runs a router the same way.

    Use as a context manager: the server is stopped (SIGTERM, then SIGKILL after a timeout) on exit, even
    when the body raises. Its stdout/stderr go to `log_path`.
    """

    def __init__(self, server_args: list[str], log_path: str, host: str = "127.0.0.1",
                 port: Optional[int] = None, env: Optional[dict] = None, module: str = "kvstrata.launch_server"):
        self.host = host
        self.port = port or free_port(host)
        self.cmd = [sys.executable, "-m", module, "--host", host, "--port", str(self.port),
                    *server_args]
        self.log_path = Path(log_path)
        self.env = {**os.environ, **(env or {})}
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        """Base URL of the server."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 300.0) -> ServerProcess:
        """Launch and wait until GET /health answers 200; raises ServerStartError (after stopping it)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        try:
            self._wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self, timeout_s: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise ServerStartError(f"the server exited with code {self.proc.returncode} during start-up:\n"
                                       f"{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass                 # not listening yet
            if time.monotonic() > deadline:
                raise ServerStartError(f"the server was not healthy after {timeout_s:g} s:\n{self.log_tail()}")
            time.sleep(0.25)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> Optional[int]:
        """SIGTERM by PID, SIGKILL if it has not exited within `timeout_s`; returns the exit code."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout_s)
        return proc.returncode

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the server's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> ServerProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
