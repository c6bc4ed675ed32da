"""ConnectionGuard: a header-read timeout and a connection cap, so slow or half-open clients cannot take
the server's file descriptors (slowloris: ~1,000 stalled connections used to exhaust a 1,024-file limit).

- A connection that is reading a request's headers (from its first byte, or from the first byte of its
  next request on a kept-alive connection) for longer than `--header-read-timeout` is closed. Idle
  kept-alive connections stay uvicorn's (`timeout_keep_alive`).
- At most `--max-connections` are open (default: the file limit less a reserve for the process's own
  files and one accept burst). A new connection beyond that closes the oldest one still reading its
  headers; if every open connection is a real request, the new one is closed instead.
- Each condition is logged once per interval (log_limit.IntervalLog), and so are accept() failures for lack
  of file descriptors, which asyncio would otherwise log with a traceback each time.

GuardedH11Protocol is uvicorn's h11 protocol plus the bookkeeping; it reads `self.conn` (the h11
connection) and `self.transport`, both set by uvicorn's H11Protocol.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any, Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvstrata.log_limit import IntervalLog

logger = logging.getLogger(__name__)

RESERVED_FDS = 64         # model files, ZMQ, logs, tokenizer threads
SWEEP_MIN_S = 0.1


def file_limit() -> int:
    """The process's soft open-file limit (RLIMIT_NOFILE)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


def accept_backlog(limit: int) -> int:
    """The listen backlog: asyncio accepts up to that many sockets before any protocol (and so the cap)
    sees one, so it must fit in the file limit next to the open connections."""
    return max(16, min(512, limit // 8))


def default_max_connections(limit: int) -> int:
    """The connection cap that keeps the open connections, the accept bursts in flight (asyncio accepts
    the next burst before the previous one reaches the protocols; measured: up to three) and the process's
    own files within `limit`."""
    return max(16, limit - max(4 * accept_backlog(limit) + RESERVED_FDS, limit // 8))


class ConnectionGuard:
    """The open HTTP connections, oldest first, and when each began reading its current headers."""

    def __init__(self, max_connections: int, header_read_timeout_s: float, log_interval_s: float = 10.0):
        self.max_connections = max_connections
        self.header_read_timeout_s = header_read_timeout_s
        self.open: dict[GuardedH11Protocol, None] = {}     # insertion order: oldest first
        self.timed_out = IntervalLog(logger, log_interval_s)
        self.over_cap = IntervalLog(logger, log_interval_s)
        self.accept_failed = IntervalLog(logger, log_interval_s, logging.ERROR)

    def opened(self, conn: GuardedH11Protocol) -> None:
        """Register a new connection; enforce the cap."""
        self.open[conn] = None
        if len(self.open) <= self.max_connections:
            return
        victim = next((c for c in self.open if c.header_since is not None and c is not conn), conn)
        self.over_cap.hit("%d connections open (--max-connections %d): closed the oldest still reading its "
                          "headers, or the new one if none", len(self.open), self.max_connections)
        self._close(victim)

    def closed(self, conn: GuardedH11Protocol) -> None:
        """Forget a connection (from connection_lost)."""
        self.open.pop(conn, None)

    def sweep(self, now: float) -> int:
        """Close the connections whose headers took longer than the timeout; returns how many."""
        late = [c for c in self.open if c.header_since is not None and now - c.header_since > self.header_read_timeout_s]
        for conn in late:
            self.timed_out.hit("closed a connection that sent no complete request headers within %g s "
                               "(--header-read-timeout); %d open", self.header_read_timeout_s, len(self.open))
            self._close(conn)
        return len(late)

    async def run(self) -> None:
        """Sweep until cancelled."""
        asyncio.get_running_loop().set_exception_handler(self._loop_exception)
        interval = max(SWEEP_MIN_S, min(1.0, self.header_read_timeout_s / 4))
        while True:
            await asyncio.sleep(interval)
            self.sweep(time.monotonic())

    def _close(self, conn: GuardedH11Protocol) -> None:
        self.open.pop(conn, None)
        conn.transport.close()

    def _loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if "out of system resource" in str(context.get("message", "")):   # accept() got EMFILE / ENFILE
            self.accept_failed.hit("accept() failed: %s (%d connections open)", context.get("exception"),
                                   len(self.open))
            return
        loop.default_exception_handler(context)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, registered with a ConnectionGuard (pass `guard=` through functools.partial)."""

    def __init__(self, *args: Any, guard: ConnectionGuard, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.guard = guard
        self.header_since: Optional[float] = None     # set while a request's headers are being read

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Start the header clock and register with the guard."""
        super().connection_made(transport)
        self.header_since = time.monotonic()
        self.guard.opened(self)

    def connection_lost(self, exc: Optional[Exception]) -> None:
        """Unregister."""
        self.guard.closed(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Feed h11; the header clock runs from a request's first byte until h11 has its headers."""
        if self.header_since is None and self.conn.their_state is h11.IDLE:
            self.header_since = time.monotonic()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self.header_since = None
