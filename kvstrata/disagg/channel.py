"""BootstrapChannel: the ZMQ sockets of one side of the PD handshake.

Each side binds one PULL socket on its PD host (`common.pd_host`: the address it advertises; the
prefill's on --disaggregation-bootstrap-port, the decode's on a free port it names in its requests) and
keeps one PUSH socket per peer it talks to. Everything is non-blocking: the scheduler polls the channel
once per step.

Anyone who reaches the port can send bytes; only signed, typed, valid, fresh frames (wire.FrameCodec)
come out of `receive()`. Every other frame is dropped and counted by reason (`rejected`, shown in
/server_info), with one warning line per REJECT_LOG_INTERVAL_S at most.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import zmq

from kvstrata.disagg.messages import PDMessage
from kvstrata.disagg.wire import MAX_FRAME_BYTES, REJECT_REASONS, FrameCodec, FrameRejected

logger = logging.getLogger(__name__)

REJECT_LOG_INTERVAL_S = 10.0


class BootstrapChannel:
    """Receive signed messages from peers; send to a peer by its ZMQ address."""

    def __init__(self, host: str, port: Optional[int] = None, secret: Optional[str] = None):
        self._codec = FrameCodec(secret)
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        if port is None:
            port = self._pull.bind_to_random_port(f"tcp://{host}")
        else:
            self._pull.bind(f"tcp://{host}:{port}")
        self.address = f"tcp://{host}:{port}"
        self._push: dict[str, zmq.Socket] = {}
        self.rejected = dict.fromkeys(REJECT_REASONS, 0)
        self._logged_at = float("-inf")
        self._unlogged = 0

    def send(self, address: str, msg: PDMessage) -> bool:
        """Queue `msg` for the peer at `address`; False if its queue is full."""
        sock = self._push.get(address)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 10_000)
            sock.connect(address)
            self._push[address] = sock
        try:
            sock.send(self._codec.encode(msg), flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            logger.warning("bootstrap peer %s is not taking messages; dropped %s", address, type(msg).__name__)
            return False

    def receive(self) -> list[PDMessage]:
        """Every admitted message that has arrived (never blocks)."""
        out = []
        while True:
            try:
                frame = self._pull.recv(flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return out
            try:
                out.append(self._codec.decode(frame))
            except FrameRejected as e:
                self._reject(e)

    def pending(self) -> bool:
        """Whether a frame waits to be received (an idle scheduler still drains and counts strays)."""
        return bool(self._pull.poll(0))

    def close(self) -> None:
        """Close every socket."""
        for sock in self._push.values():
            sock.close(0)
        self._pull.close(0)
        self._ctx.term()

    def _reject(self, e: FrameRejected) -> None:
        self.rejected[e.reason] += 1
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at >= REJECT_LOG_INTERVAL_S:
            logger.warning("dropped %d message(s) on the PD bootstrap channel %s (latest: %s); totals %s",
                           self._unlogged, self.address, e, self.rejected)
            self._logged_at, self._unlogged = now, 0
