"""Local TCP ports for the processes kvstrata starts: servers, routers, Mooncake pieces, role-group members;
and confining the listening sockets that native code opens on every interface to loopback."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import random
import socket
import threading
from collections.abc import Iterator

import psutil

logger = logging.getLogger(__name__)

# Below Linux's default ephemeral range (32768-60999): a port chosen here cannot be taken by some process's
# outgoing connection between the moment it is chosen and the moment its server binds it.
_PORT_RANGE = (20000, 32000)
_rng = random.Random()           # seeded from the OS: never in step with another process's choices
_given: set[int] = set()
_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, outside the ephemeral range, not handed out before by this process."""
    with _lock:
        for _ in range(200):
            port = _rng.randrange(*_PORT_RANGE)
            if port not in _given and _bindable(host, port):
                _given.add(port)
                return port
    with socket.socket() as s:    # the range is crowded: let the OS choose
        s.bind((host, 0))
        return s.getsockname()[1]


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def is_ip_literal(host: str) -> bool:
    """Whether `host` is an IPv4 or IPv6 address (not a name)."""
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback interface only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@contextlib.contextmanager
def confined_listeners(host: str) -> Iterator[None]:
    """Confine to the loopback interface the TCP sockets that start listening inside the block, when `host`
    (the address they should have bound) is a loopback address.

    Mooncake's transfer engine binds its handshake and data ports to every interface, whatever hostname it
    is given, and has no setting to narrow them. SO_BINDTODEVICE on a listening socket keeps it from
    accepting connections that arrive on any other interface. For a non-loopback host there is no such
    fix (peers on the same machine come in through loopback): the network must keep strangers out there
    (the RBG render's NetworkPolicy; a firewall).
    """
    before = _listening_fds() if is_loopback(host) else None
    yield
    if before is None:
        return
    device = _loopback_device()
    for fd in _listening_fds() - before:
        sock = socket.socket(fileno=os.dup(fd))      # a duplicate: closing it leaves the owner's socket open
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, device.encode())
        except OSError as e:
            logger.warning("could not confine listening port %d to %s (%s): it accepts connections on every "
                           "interface", sock.getsockname()[1], device, e)
        finally:
            sock.close()


def _listening_fds() -> set[int]:
    return {c.fd for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN}


def _loopback_device() -> str:
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and is_loopback(a.address) for a in addrs):
            return name
    return "lo"
