"""BootstrapChannel: the ZMQ sockets of one side of the PD handshake.

Each side binds one PULL socket (the prefill's on --disaggregation-bootstrap-port, the decode's on a free
port it names in its requests) and keeps one PUSH socket per peer it talks to. Everything is
non-blocking: the scheduler polls the channel once per step.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import zmq

logger = logging.getLogger(__name__)


class BootstrapChannel:
    """Receive from anyone; send to a peer by its ZMQ address."""

    def __init__(self, host: str, port: Optional[int] = None):
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        if port is None:
            port = self._pull.bind_to_random_port(f"tcp://{host}")
        else:
            self._pull.bind(f"tcp://{host}:{port}")
        self.address = f"tcp://{host}:{port}"
        self._push: dict[str, zmq.Socket] = {}

    def send(self, address: str, msg: Any) -> bool:
        """Queue `msg` for the peer at `address`; False if its queue is full."""
        sock = self._push.get(address)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 10_000)
            sock.connect(address)
            self._push[address] = sock
        try:
            sock.send_pyobj(msg, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            logger.warning("bootstrap peer %s is not taking messages; dropped %s", address, type(msg).__name__)
            return False

    def receive(self) -> list[Any]:
        """Every message that has arrived (never blocks)."""
        out = []
        while True:
            try:
                out.append(self._pull.recv_pyobj(flags=zmq.NOBLOCK))
            except zmq.Again:
                return out
            except Exception:      # not one of our pickles: a stray client on the bootstrap port
                logger.exception("bad message on the bootstrap channel")

    def close(self) -> None:
        """Close every socket."""
        for sock in self._push.values():
            sock.close(0)
        self._pull.close(0)
        self._ctx.term()
