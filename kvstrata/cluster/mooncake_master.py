"""The mooncake-master member: Mooncake's HTTP metadata server and `mooncake_master`, as one process.

    python -m kvstrata.cluster.mooncake_master --host H --rpc-port P --metadata-port M --metrics-port X [--flag=v ...]

The metadata server runs as Mooncake's Python HTTP server rather than the master's embedded one, which
this Mooncake build binds to 0.0.0.0 whatever its host flag says. Both children share this process's
group, so stopping the group stops all three; if either child exits, this process exits non-zero (the
launcher or Kubernetes then restarts the member). Extra `--name=value` flags go to `mooncake_master`.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time

from kvstrata.storage.mooncake_services import master_binary


def master_args(ns: argparse.Namespace, extra: list[str]) -> list[str]:
    """The `mooncake_master` command line."""
    return [master_binary(), f"--rpc_port={ns.rpc_port}", f"--rpc_address={ns.host}",
            f"--metrics_host={ns.host}", f"--metrics_port={ns.metrics_port}", *extra]


def main(argv: list[str] | None = None) -> int:
    """Run both services until SIGTERM/SIGINT or until one of them exits."""
    parser = argparse.ArgumentParser(prog="kvstrata.cluster.mooncake_master", description=__doc__.splitlines()[0])
    parser.add_argument("--host", required=True)
    parser.add_argument("--rpc-port", type=int, required=True)
    parser.add_argument("--metadata-port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    ns, extra = parser.parse_known_args(argv)
    children = [
        subprocess.Popen([sys.executable, "-m", "mooncake.http_metadata_server", "--host", ns.host,
                          "--port", str(ns.metadata_port), "--log-level", "WARNING"]),
        subprocess.Popen(master_args(ns, extra)),
    ]
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _: stopping.append(signum))
    signal.signal(signal.SIGINT, lambda signum, _: stopping.append(signum))
    code = 0
    while not stopping:
        exited = [c for c in children if c.poll() is not None]
        if exited:
            print(f"{exited[0].args[0]} exited with code {exited[0].returncode}", flush=True)
            code = 1
            break
        time.sleep(0.1)
    for child in children:
        if child.poll() is None:
            child.terminate()
    for child in children:
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    return code


if __name__ == "__main__":
    sys.exit(main())
