"""The circuit breaker behind remote backends: skip while down, one probe per backoff, backoff doubles."""

from kvstrata.storage.availability import Availability


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_down_skips_until_backoff_then_one_probe():
    clock = Clock()
    a = Availability("svc", backoff_s=1.0, backoff_max_s=4.0, clock=clock)
    assert a.allow() and a.up
    a.failed("boom")
    assert not a.up and not a.allow()
    clock.now += 1.0
    assert a.allow()          # the probe
    assert not a.allow()      # nobody else while it runs
    a.failed("still")         # backoff doubles to 2 s
    clock.now += 1.5
    assert not a.allow()
    clock.now += 0.5
    assert a.allow()
    a.succeeded()
    assert a.up and a.allow() and a.outages == 1


def test_backoff_is_capped_and_reset_after_recovery():
    clock = Clock()
    a = Availability("svc", backoff_s=1.0, backoff_max_s=3.0, clock=clock)
    a.failed("x")
    for _ in range(5):
        clock.now += 3.0
        assert a.allow()
        a.failed("x")
    clock.now += 3.0
    assert a.allow()
    a.succeeded()
    a.failed("again")
    assert a.outages == 2
    clock.now += 1.0
    assert a.allow()  # back to the first backoff


def test_unreachable_probe_fails_without_a_call():
    clock = Clock()
    reachable = [False]
    a = Availability("svc", backoff_s=1.0, backoff_max_s=8.0, probe=lambda: reachable[0], clock=clock)
    a.failed("down")
    clock.now += 1.0
    assert not a.allow()      # probe says unreachable: counts as a failed retry
    clock.now += 1.0
    assert not a.allow()      # backoff is now 2 s
    clock.now += 1.0
    reachable[0] = True
    assert a.allow()
    a.retry_now()
    a.succeeded()
    assert a.up
