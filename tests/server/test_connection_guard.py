"""ConnectionGuard's rules on stand-in connections: who is closed at the cap, when headers time out, and
that each condition is logged once per interval."""

from __future__ import annotations

import logging
from typing import Optional

from kvstrata.log_limit import IntervalLog
from kvstrata.server.connections import ConnectionGuard, default_max_connections


class FakeTransport:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class FakeConn:
    def __init__(self, header_since: Optional[float]):
        self.header_since = header_since
        self.transport = FakeTransport()


def test_at_the_cap_the_oldest_connection_reading_headers_goes_first():
    guard = ConnectionGuard(max_connections=2, header_read_timeout_s=10)
    busy, stalled, new = FakeConn(None), FakeConn(1.0), FakeConn(2.0)
    for conn in (busy, stalled, new):
        guard.opened(conn)
    assert stalled.transport.closed and not busy.transport.closed and not new.transport.closed
    assert list(guard.open) == [busy, new]
    newest = FakeConn(3.0)
    new.header_since = None                  # every open connection is a real request now
    guard.opened(newest)
    assert newest.transport.closed and list(guard.open) == [busy, new]


def test_headers_that_take_too_long_are_closed_and_logged_once(caplog):
    guard = ConnectionGuard(max_connections=100, header_read_timeout_s=1.0)
    late = [FakeConn(0.0) for _ in range(50)]
    fresh, busy = FakeConn(9.5), FakeConn(None)
    for conn in [*late, fresh, busy]:
        guard.opened(conn)
    with caplog.at_level(logging.WARNING, logger="kvstrata.server.connections"):
        assert guard.sweep(now=10.0) == 50
    assert all(c.transport.closed for c in late) and not fresh.transport.closed and not busy.transport.closed
    assert len(caplog.records) == 1 and guard.timed_out.total == 50


def test_default_cap_leaves_room_for_accept_bursts_and_own_files():
    assert default_max_connections(1024) == 448
    assert default_max_connections(512) == 192
    assert default_max_connections(65536) == 65536 - 8192
    assert default_max_connections(32) == 16


def test_interval_log_counts_what_it_held_back(caplog):
    log = IntervalLog(logging.getLogger("test.interval"), interval_s=3600)
    with caplog.at_level(logging.WARNING, logger="test.interval"):
        for i in range(1000):
            log.hit("failed %d", i)
    assert [r.getMessage() for r in caplog.records] == ["failed 0"] and log.total == 1000
    log._next_at = 0.0                       # the interval has passed
    with caplog.at_level(logging.WARNING, logger="test.interval"):
        log.hit("failed %d", 1000)
    assert caplog.records[-1].getMessage() == "failed 1000 (and 999 more in the last 3600 s)"
