"""Local TCP ports for the processes kvstrata starts: servers, routers, Mooncake pieces, role-group members."""

from __future__ import annotations

import random
import socket
import threading

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
