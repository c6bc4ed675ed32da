"""Slow and half-open clients: a header-read timeout and a connection cap keep /health answering, and
the log bounded, under 1,000 stalled connections (real server with a lowered open-file limit)."""

from __future__ import annotations

import resource
import socket
import time

import requests

from tests.server.conftest import launch_server, stop_server

FILE_LIMIT = 512          # the server's: 1,000 stalled connections are about twice what it can hold
HEADER_TIMEOUT_S = 1.0


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def _health_s(url: str) -> float:
    t0 = time.monotonic()
    assert requests.get(url + "/health", timeout=1).status_code == 200
    return time.monotonic() - t0


def _request(sock: socket.socket) -> bytes:
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    return sock.recv(4096)


def test_stalled_connections_are_closed_and_health_keeps_answering(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (FILE_LIMIT, hard))     # inherited by the server
    try:
        handle = launch_server(tmp_path, "--header-read-timeout", str(HEADER_TIMEOUT_S))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    stalled: list[socket.socket] = []
    try:
        # A kept-alive connection idle between requests is not a slow header.
        with _connect(handle.url) as kept:
            assert _request(kept).startswith(b"HTTP/1.1 200")
            time.sleep(HEADER_TIMEOUT_S * 1.5)
            assert _request(kept).startswith(b"HTTP/1.1 200")
        # A request line that never ends is cut off after the header timeout.
        with _connect(handle.url) as slow:
            slow.sendall(b"GET /hea")
            t0 = time.monotonic()
            assert slow.recv(1) == b""
            assert HEADER_TIMEOUT_S * 0.9 < time.monotonic() - t0 < HEADER_TIMEOUT_S + 2
        lines_before = len(handle.log().splitlines())
        for _ in range(1000):
            sock = _connect(handle.url)
            sock.sendall(b"GET /generate HT")          # a partial request line, then nothing
            stalled.append(sock)
        assert max(_health_s(handle.url) for _ in range(5)) < 1.0
        time.sleep(HEADER_TIMEOUT_S * 2)
        assert _health_s(handle.url) < 1.0
        added = handle.log().splitlines()[lines_before:]
        assert len(added) < 20, "\n".join(added[:40])
        assert "Too many open files" not in handle.log()
    finally:
        for sock in stalled:
            sock.close()
        stop_server(handle)
