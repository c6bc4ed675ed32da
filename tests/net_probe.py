"""Probes of what a listening port accepts: this machine's non-loopback address, whether a port answers, and
a pickle that shows whether anything unpickles what it is sent."""

from __future__ import annotations

import os
import pickle
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


class _Exploit:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def exploit_pickle(marker: str) -> bytes:
    """A pickle whose loading creates the file `marker`: send it, then check that `marker` does not exist."""
    return pickle.dumps(_Exploit(marker))
