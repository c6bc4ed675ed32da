"""The Mooncake test harness itself: services bound to 127.0.0.1, stopped by PID even when start fails."""

import psutil
import pytest

from kvstrata.storage.mooncake_services import MooncakeCluster, main

pytestmark = pytest.mark.mooncake


def _listening_ports(pid: int) -> set[tuple[str, int]]:
    proc = psutil.Process(pid)
    return {(c.laddr.ip, c.laddr.port) for c in proc.net_connections(kind="tcp") if c.status == "LISTEN"}


def test_control_ports_bind_loopback_only(mooncake_cluster):
    master = _listening_ports(mooncake_cluster.processes["master"].pid)
    assert ("127.0.0.1", mooncake_cluster.master_port) in master
    assert all(ip == "127.0.0.1" for ip, _ in master)
    metadata = _listening_ports(mooncake_cluster.processes["metadata"].pid)
    assert metadata == {("127.0.0.1", mooncake_cluster.metadata_port)}


def test_failed_start_stops_what_it_started(mooncake_env, tmp_path):
    cluster = MooncakeCluster(workdir=tmp_path / "c")
    with pytest.raises(TimeoutError):
        cluster.start(timeout_s=0.0)
    assert cluster.processes == {}
    leftovers = [p for p in psutil.process_iter(["cmdline"])
                 if str(cluster.metadata_port) in " ".join(p.info["cmdline"] or [])]
    assert leftovers == []


def test_cli_start_status_stop(mooncake_env, tmp_path, capsys):
    workdir = str(tmp_path / "cli")
    assert main(["start", "--workdir", workdir, "--metadata", "p2p", "--segment-size", "16mb"]) == 0
    try:
        exports = capsys.readouterr().out
        assert "export MOONCAKE_MASTER=127.0.0.1:" in exports
        assert main(["status", "--workdir", workdir]) == 0
        assert capsys.readouterr().out.count("running") == 2  # master and store service (p2p: no metadata)
    finally:
        assert main(["stop", "--workdir", workdir]) == 0
    assert main(["status", "--workdir", workdir]) == 1
