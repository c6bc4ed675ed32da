"""The network surface of real PD servers: a pickle, random bytes and forged messages sent to every port a
prefill or decode server listens on run nothing, are dropped and counted, and PD keeps serving; the
scheduler's IPC files are private to their user."""

from __future__ import annotations

import glob
import os
import socket
import stat
import time

import psutil
import zmq

from kvstrata.disagg.messages import KVTransferAbort
from kvstrata.disagg.wire import FrameCodec
from kvstrata.server.launch import IPC_PREFIX
from tests.capabilities import requires_outside_ipv4
from tests.disagg.conftest import SECRET, generate, greedy, state, wait_for
from tests.net_probe import answers, exploit_pickle, outside_ipv4


def listening_ports(server) -> set[int]:
    """Every TCP port the server's processes (HTTP frontend and scheduler) listen on."""
    root = psutil.Process(server.proc.pid)
    ports = set()
    for proc in (root, *root.children(recursive=True)):
        ports |= {c.laddr.port for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    return ports


def bootstrap_port(url: str) -> int:
    return int(state(url)["disaggregation"]["bootstrap_address"].rsplit(":", 1)[1])


def rejected(url: str) -> dict:
    return state(url)["disaggregation"]["rejected_messages"]


def push(port: int, frames: list[bytes]) -> None:
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        for frame in frames:
            sock.send(frame)
    finally:
        sock.close()


def raw_tcp(port: int, payloads: list[bytes]) -> None:
    for payload in payloads:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(payload)
                time.sleep(0.05)
        except OSError:
            pass            # the peer hung up on garbage: that is fine


def assert_pd_serves(pd) -> None:
    body = greedy("Still serving after the attack?", 8)
    via_pd, alone = generate(pd.router.url, body), generate(pd.colocated.url, body)
    assert via_pd.status_code == 200, via_pd.text
    assert via_pd.json()["output_ids"] == alone.json()["output_ids"]


def test_pickle_and_garbage_on_every_pd_port_run_nothing(pd, tmp_path):
    marker = tmp_path / "pwned"
    evil = exploit_pickle(str(marker))
    frames = [evil, os.urandom(512), b"", FrameCodec(SECRET).encode(KVTransferAbort(1, "x"))[:-1]]
    garbage = [evil, os.urandom(4096), b"\x00" * 64, b"\xff" * 64, b"GET / HTTP/1.1\r\n\r\n"]
    servers = (pd.prefill, pd.decode)
    ports = {server.url: listening_ports(server) for server in servers}
    for server in servers:
        # HTTP, the bootstrap socket, and the transfer engine's handshake and data ports
        assert server.port in ports[server.url] and len(ports[server.url]) >= 4
        for port in ports[server.url]:            # ZMQ frames (only the bootstrap socket speaks ZMTP) and raw bytes
            push(port, frames)
            raw_tcp(port, garbage)
    assert_pd_serves(pd)                          # both schedulers step (and read their sockets) meanwhile
    time.sleep(0.5)
    assert not marker.exists(), "a pickle sent to a PD port ran"
    for server in servers:
        assert bootstrap_port(server.url) in ports[server.url]
        wait_for(lambda url=server.url: rejected(url)["malformed"] >= 3, timeout_s=20,
                 what=f"{server.url} to count the dropped frames")
        assert server.proc.poll() is None
    assert not marker.exists()
    assert_pd_serves(pd)


def test_forged_or_replayed_messages_are_refused(pd):
    for server in (pd.prefill, pd.decode):
        port = bootstrap_port(server.url)
        before = rejected(server.url)
        genuine = FrameCodec(SECRET).encode(KVTransferAbort(2 ** 62, "probe"))
        push(port, [FrameCodec("not-the-secret").encode(KVTransferAbort(1, "forged")),
                    FrameCodec(None).encode(KVTransferAbort(1, "unsigned")), genuine, genuine])
        wait_for(lambda url=server.url, n=before["replayed"] + 1: rejected(url)["replayed"] == n, timeout_s=20,
                 what="the replay to be counted")
        after = rejected(server.url)
        assert after["unauthenticated"] == before["unauthenticated"] + 2
        assert after["malformed"] == before["malformed"]
    assert_pd_serves(pd)


def test_pd_sockets_bind_the_advertised_host_only(pd):
    for server in (pd.prefill, pd.decode):
        d = state(server.url)["disaggregation"]
        assert d["bootstrap_address"].startswith("tcp://127.0.0.1:")
        assert d["transfer_session"].startswith("127.0.0.1:")
        root = psutil.Process(server.proc.pid)
        zmq_port = bootstrap_port(server.url)
        for proc in (root, *root.children(recursive=True)):
            for c in proc.net_connections("tcp"):
                if c.status == psutil.CONN_LISTEN and c.laddr.port in (zmq_port, server.port):
                    assert c.laddr.ip == "127.0.0.1", c


@requires_outside_ipv4
def test_no_pd_server_port_answers_on_a_non_loopback_address(pd):
    """Servers bound to 127.0.0.1: HTTP, bootstrap and the transfer engine's ports refuse other interfaces
    (asked from this machine itself, at its own non-loopback address: nothing leaves the machine)."""
    outside = outside_ipv4()
    for server in (pd.prefill, pd.decode):
        ports = listening_ports(server)
        assert len(ports) >= 4
        assert [p for p in sorted(ports) if answers(outside, p)] == []
        assert all(answers("127.0.0.1", p) for p in ports)


def test_scheduler_ipc_directory_and_sockets_are_private(pd):
    for server in (pd.prefill, pd.decode):
        dirs = glob.glob(f"/tmp/{IPC_PREFIX}{server.proc.pid}-*")
        assert len(dirs) == 1, dirs
        assert stat.S_IMODE(os.stat(dirs[0]).st_mode) == 0o700
        files = sorted(os.listdir(dirs[0]))
        assert files == ["from-scheduler", "to-scheduler"]
        for name in files:
            st = os.stat(os.path.join(dirs[0], name))
            assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, (name, oct(st.st_mode))
