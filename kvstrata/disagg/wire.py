"""Signed frames of the PD bootstrap channel: what goes on the wire, and what is let back in.

    frame = MAGIC (4 bytes) | mac (32 bytes) | body
    body  = msgpack [sent_at (wall clock, s), nonce (16 random bytes), message (messages.PDMessage)]
    mac   = HMAC-SHA256(secret, MAGIC | body)

The MAC is checked (hmac.compare_digest) before a byte of the body is parsed; then msgspec decodes the body
into the typed message, checking every field's type and bounds, and `message_problem` its cross-field
rules. A frame older or newer than REPLAY_WINDOW_S, or whose nonce was seen inside that window, is a
replay. Without a secret (loopback only, see ServerArgs) the key is empty: frames are still typed and
checked, but any local process could forge one.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections import deque
from typing import Annotated, Optional

import msgspec
from msgspec import Meta, Struct

from kvstrata.disagg.messages import PDMessage, message_problem

MAGIC = b"KVP1"
MAC_BYTES = hashlib.sha256().digest_size
NONCE_BYTES = 16
REPLAY_WINDOW_S = 120.0          # also the clock skew tolerated between two PD servers
MAX_FRAME_BYTES = 64 << 20       # a 4 Mi-token prompt's slot list fits; ZMQ drops a peer that sends more


class Envelope(Struct, array_like=True):
    """The signed body: when and with which nonce the message was sent."""

    sent_at: float
    nonce: Annotated[bytes, Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]
    message: PDMessage


class FrameRejected(ValueError):
    """A frame that is dropped; `reason` is its counter's name."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


REJECT_REASONS = ("unauthenticated", "malformed", "invalid", "stale", "replayed")


class FrameCodec:
    """Encode outgoing messages and admit incoming frames for one side, with one shared secret."""

    def __init__(self, secret: Optional[str], window_s: float = REPLAY_WINDOW_S):
        self._key = (secret or "").encode()
        self._window_s = window_s
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Envelope)
        self._seen: set[bytes] = set()             # nonces inside the window
        self._expiry: deque[tuple[float, bytes]] = deque()   # (monotonic time it leaves the window, nonce)

    def encode(self, msg: PDMessage) -> bytes:
        """A signed frame carrying `msg`."""
        body = self._encoder.encode(Envelope(time.time(), os.urandom(NONCE_BYTES), msg))
        return MAGIC + self._mac(body) + body

    def decode(self, frame: bytes) -> PDMessage:
        """The message a frame carries; FrameRejected if it is not authentic, well-formed, valid and fresh."""
        head = len(MAGIC) + MAC_BYTES
        if len(frame) <= head or not frame.startswith(MAGIC):
            raise FrameRejected("malformed", f"not a PD frame ({len(frame)} bytes)")
        if not hmac.compare_digest(frame[len(MAGIC):head], self._mac(frame[head:])):
            raise FrameRejected("unauthenticated", "wrong or missing --disaggregation-secret")
        try:
            env = self._decoder.decode(frame[head:])
        except msgspec.DecodeError as e:   # ValidationError included: a field of the wrong type or size
            raise FrameRejected("invalid", str(e)) from None
        problem = message_problem(env.message)
        if problem is not None:
            raise FrameRejected("invalid", problem)
        self._check_fresh(env)
        return env.message

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self._key, MAGIC + body, hashlib.sha256).digest()

    def _check_fresh(self, env: Envelope) -> None:
        age = time.time() - env.sent_at
        if not -self._window_s <= age <= self._window_s:     # NaN fails this too
            raise FrameRejected("stale", f"sent {age:.0f} s ago (window {self._window_s:g} s)")
        now = time.monotonic()
        while self._expiry and self._expiry[0][0] <= now:
            self._seen.discard(self._expiry.popleft()[1])
        if env.nonce in self._seen:
            raise FrameRejected("replayed", "a nonce seen before")
        self._seen.add(env.nonce)
        self._expiry.append((now + 2 * self._window_s, env.nonce))
