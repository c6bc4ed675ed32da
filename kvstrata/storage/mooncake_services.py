"""A local Mooncake cluster on 127.0.0.1 for tests, demos and benchmarks: master, metadata, store service.

    mooncake_master              RPC on 127.0.0.1:<free port>, its metrics/admin port on 127.0.0.1 too
    metadata server              "http": Mooncake's Python HTTP metadata server on 127.0.0.1 (default);
                                 "master": the master's embedded one (this Mooncake build binds it to
                                 0.0.0.0 whatever the host flag says); "p2p": none (P2PHANDSHAKE)
    store service                a process holding a Mooncake client whose global segment is the
                                 cluster's memory, so data outlives the clients that wrote it

Every process runs in its own session and is stopped by killing its process group (PID = PGID), on
`stop()`, on a failed `start()`, and by `python -m kvstrata.storage.mooncake_services stop --workdir D`.
The master and the default metadata server listen on 127.0.0.1 only. Mooncake's transfer engine (in the
store service and in every client) listens on all interfaces for its handshake and data ports:
MC_TCP_BIND_ADDRESS=127.0.0.1 only sets the address it advertises, and this build has no setting that
narrows its listening sockets.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvstrata.process import alive, stop_group
from kvstrata.storage.mooncake_config import (
    MIB,
    P2P_HANDSHAKE,
    client_hostname,
    free_port,
    import_mooncake,
    parse_size,
    resolve_mooncake_config,
)

HOST = "127.0.0.1"
MOONCAKE_ENV = {"MC_LEGACY_RPC_PORT_BINDING": "1", "MC_TCP_BIND_ADDRESS": HOST}
METADATA_MODES = ("http", "master", "p2p")


def master_binary() -> str:
    """Path of the `mooncake_master` executable shipped in the mooncake package."""
    import mooncake

    path = Path(mooncake.__file__).parent / "mooncake_master"
    if not path.exists():
        raise FileNotFoundError(f"mooncake_master not found next to {mooncake.__file__}")
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)
    return str(path)


@dataclass
class MooncakeCluster:
    """Start, stop, kill and restart a one-machine Mooncake cluster bound to 127.0.0.1."""

    workdir: Path | None = None  # logs and state; default: a temp dir removed again by stop()
    metadata: str = "http"
    segment_bytes: int = 256 * MIB
    master_port: int = 0
    metrics_port: int = 0
    metadata_port: int = 0
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.metadata not in METADATA_MODES:
            raise ValueError(f"metadata must be one of {METADATA_MODES}, got {self.metadata!r}")
        self._owns_workdir = self.workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="kvstrata-mooncake-") if self.workdir is None else self.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ addresses
    @property
    def master_address(self) -> str:
        """host:port of the master's RPC service."""
        return f"{HOST}:{self.master_port}"

    @property
    def metadata_server(self) -> str:
        """What clients pass as their metadata server."""
        if self.metadata == "p2p":
            return P2P_HANDSHAKE
        return f"http://{HOST}:{self.metadata_port}/metadata"

    def client_config(self, **overrides) -> dict:
        """Extra config for a MooncakeBackend that uses this cluster's memory (contributing none)."""
        return {"master_server_address": self.master_address, "metadata_server": self.metadata_server,
                "protocol": "tcp", "local_hostname": HOST, "global_segment_size": 0,
                "local_buffer_size": 16 * MIB, **overrides}

    def env(self) -> dict[str, str]:
        """Environment variables that point an SGLang-style process (or kvstrata) at this cluster."""
        return {**MOONCAKE_ENV, "MOONCAKE_MASTER": self.master_address,
                "MOONCAKE_TE_META_DATA_SERVER": self.metadata_server, "MOONCAKE_PROTOCOL": "tcp",
                "MOONCAKE_LOCAL_HOSTNAME": HOST, "MOONCAKE_GLOBAL_SEGMENT_SIZE": "0"}

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout_s: float = 60.0) -> MooncakeCluster:
        """Start every service and wait until each is ready; on any failure stop what started and raise."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.master_port = self.master_port or free_port(HOST)
        self.metrics_port = self.metrics_port or free_port(HOST)
        try:
            if self.metadata == "http":
                self.metadata_port = self.metadata_port or free_port(HOST)
                self._spawn("metadata", [sys.executable, "-m", "mooncake.http_metadata_server",
                                         "--host", HOST, "--port", str(self.metadata_port),
                                         "--log-level", "WARNING"])
                _wait_port(self.metadata_port, self.processes["metadata"], timeout_s, self._log("metadata"))
            elif self.metadata == "master":
                self.metadata_port = self.metadata_port or free_port(HOST)
            self.start_master(timeout_s)
            self._start_store_service(timeout_s)
        except BaseException:
            self.stop(keep_workdir=True)  # keep the logs the error points at
            raise
        self._write_state()
        return self

    def start_master(self, timeout_s: float = 30.0) -> None:
        """(Re)start the master on its port and wait until it accepts connections."""
        args = [master_binary(), f"--rpc_port={self.master_port}", f"--rpc_address={HOST}",
                f"--metrics_host={HOST}", f"--metrics_port={self.metrics_port}"]
        if self.metadata == "master":
            args += ["--enable_http_metadata_server=true", f"--http_metadata_server_host={HOST}",
                     f"--http_metadata_server_port={self.metadata_port}"]
        self._spawn("master", args)
        _wait_port(self.master_port, self.processes["master"], timeout_s, self._log("master"))
        if self.metadata == "master":
            _wait_port(self.metadata_port, self.processes["master"], timeout_s, self._log("master"))

    def kill_master(self) -> None:
        """Kill the master abruptly (SIGKILL), as a crash would."""
        self._stop_process("master", sig=signal.SIGKILL)

    def kill_store(self) -> None:
        """Kill the store service (the process that lends the cluster its memory) abruptly (SIGKILL)."""
        self._stop_process("store", sig=signal.SIGKILL)

    def start_store(self, timeout_s: float = 60.0) -> None:
        """(Re)start the store service and wait until its segment is mounted."""
        self._start_store_service(timeout_s)

    def stop(self, keep_workdir: bool = False) -> None:
        """Stop every service (store service first), killing whatever does not exit in time."""
        for name in ("store", "master", "metadata"):
            self._stop_process(name)
        (self.workdir / "cluster.json").unlink(missing_ok=True)
        if self._owns_workdir and not keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> MooncakeCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ internals
    def _start_store_service(self, timeout_s: float) -> None:
        ready = self.workdir / "store.ready"
        ready.unlink(missing_ok=True)
        self._spawn("store", [sys.executable, "-m", "kvstrata.storage.mooncake_services", "serve-segment",
                              "--master", self.master_address, "--metadata", self.metadata_server,
                              "--segment-size", str(self.segment_bytes), "--ready-file", str(ready)])
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            _check_alive(self.processes["store"], self._log("store"))
            if time.monotonic() > deadline:
                raise TimeoutError(f"Mooncake store service not ready after {timeout_s:.0f} s; "
                                   f"see {self._log('store')}")
            time.sleep(0.05)

    def _spawn(self, name: str, args: list[str]) -> None:
        env = {**os.environ, **MOONCAKE_ENV}
        # The store service runs `-m kvstrata...`: make this checkout importable even if not installed.
        repo = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH", "")) if p)
        with open(self._log(name), "ab") as log:
            self.processes[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                    stdin=subprocess.DEVNULL, start_new_session=True)

    def _stop_process(self, name: str, sig: int = signal.SIGTERM) -> None:
        proc = self.processes.pop(name, None)
        if proc is not None:
            stop_group(proc.pid, sig)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass  # unkillable (stuck in the kernel): nothing more a harness can do

    def _log(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def _write_state(self) -> None:
        state = {"pids": {name: p.pid for name, p in self.processes.items()}, "env": self.env(),
                 "client_config": self.client_config()}
        (self.workdir / "cluster.json").write_text(json.dumps(state, indent=2))




def _wait_port(port: int, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        _check_alive(proc, log)
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {HOST}:{port} after {timeout_s:.0f} s; see {log}") from None
            time.sleep(0.05)


def _check_alive(proc: subprocess.Popen, log: Path) -> None:
    if proc.poll() is not None:
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise RuntimeError(f"{proc.args[0]} exited with code {proc.returncode}; log {log}:\n{tail}")


# ---------------------------------------------------------------------- store service process
def serve_segment(master: str, metadata: str, segment_bytes: int, ready_file: str, host: str = HOST) -> int:
    """Hold a Mooncake client whose global segment is the cluster's memory, until SIGTERM."""
    config = resolve_mooncake_config({"master_server_address": master, "metadata_server": metadata,
                                      "local_hostname": host, "global_segment_size": segment_bytes,
                                      "local_buffer_size": 16 * MIB})
    store = import_mooncake().MooncakeDistributedStore()
    rc = store.setup(client_hostname(config), config.metadata_server, config.global_segment_size,
                     config.local_buffer_size, config.protocol, config.device_name,
                     config.master_server_address)
    if rc != 0:
        print(f"store service setup failed: rc={rc}", flush=True)
        return 1
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(True))
    tmp = Path(ready_file + ".tmp")        # pid, then the segment name; renamed so readers see it whole
    tmp.write_text(f"{os.getpid()}\n{store.get_hostname()}\n")
    tmp.replace(ready_file)
    print(f"store service ready: {segment_bytes} bytes at {store.get_hostname()}", flush=True)
    while not stopping:
        time.sleep(0.05)
    started = time.monotonic()
    store.close()
    print(f"store service closed in {time.monotonic() - started:.2f} s", flush=True)
    return 0


# ---------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    """`start`, `stop` or `status` a local cluster kept in --workdir; `serve-segment` is internal."""
    parser = argparse.ArgumentParser(prog="mooncake_services", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("start", "stop", "status"):
        p = sub.add_parser(name)
        p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "kvstrata-mooncake"))
    sub.choices["start"].add_argument("--metadata", choices=METADATA_MODES, default="http")
    sub.choices["start"].add_argument("--segment-size", default="256mb", help="memory of the store service")
    seg = sub.add_parser("serve-segment")
    seg.add_argument("--master", required=True)
    seg.add_argument("--metadata", required=True)
    seg.add_argument("--segment-size", type=int, required=True)
    seg.add_argument("--ready-file", required=True)
    seg.add_argument("--local-hostname", default=HOST, help="address the store advertises (a pod IP on k8s)")
    args = parser.parse_args(argv)

    if args.command == "serve-segment":
        return serve_segment(args.master, args.metadata, args.segment_size, args.ready_file,
                             args.local_hostname)
    state_path = Path(args.workdir) / "cluster.json"
    if args.command == "start":
        if state_path.exists():
            print(f"a cluster is already recorded in {state_path}; stop it first", file=sys.stderr)
            return 1
        cluster = MooncakeCluster(Path(args.workdir), args.metadata, parse_size(args.segment_size)).start()
        for key, value in cluster.env().items():
            print(f"export {key}={value}")
        return 0
    if not state_path.exists():
        print(f"no cluster recorded in {state_path}", file=sys.stderr)
        return 1 if args.command == "status" else 0
    state = json.loads(state_path.read_text())
    if args.command == "status":
        for name, pid in state["pids"].items():
            print(f"{name}: pid {pid} {'running' if alive(pid) else 'gone'}")
        return 0
    for name in ("store", "master", "metadata"):
        if name in state["pids"]:
            stop_group(state["pids"][name])
    state_path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
