"""Probes of what a listening port accepts: this machine's non-loopback address, and whether a port answers."""

from __future__ import annotations

import socket
from typing import Optional

import psutil


def outside_ipv4() -> Optional[str]:
    """One of this machine's IPv4 addresses that is not loopback (None if it has none)."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def answers(host: str, port: int) -> bool:
    """Whether a TCP connection to host:port is accepted."""
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False
