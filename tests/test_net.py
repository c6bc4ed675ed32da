"""free_port: ports outside the ephemeral range, bindable, never handed out twice by one process."""

from __future__ import annotations

import socket

from kvstrata.net import confined_listeners, free_port
from tests.capabilities import requires_outside_ipv4
from tests.net_probe import answers, outside_ipv4


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(20000 <= p < 32000 for p in ports)
    for port in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_bound_by_someone_else_is_skipped(monkeypatch):
    # A two-port range with one port held elsewhere: free_port must return the other one.
    import kvstrata.net as net

    for _ in range(100):   # a held port whose neighbour is free (the OS picks the held one)
        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        if port + 1 < 65536 and net._bindable("127.0.0.1", port + 1):
            break
        held.close()
    else:
        raise AssertionError("no ephemeral port with a free neighbour in 100 tries")
    with held:
        monkeypatch.setattr(net, "_PORT_RANGE", (port, port + 2))
        monkeypatch.setattr(net, "_given", set())
        assert net.free_port() == port + 1


@requires_outside_ipv4
def test_listeners_opened_on_every_interface_are_confined_to_loopback():
    with socket.socket() as free, socket.socket() as kept:
        with confined_listeners("127.0.0.1"):
            free.bind(("0.0.0.0", 0))
            free.listen()
        kept.bind(("0.0.0.0", 0))       # opened outside the block: left alone
        kept.listen()
        assert answers("127.0.0.1", free.getsockname()[1])
        assert not answers(outside_ipv4(), free.getsockname()[1])
        assert answers(outside_ipv4(), kept.getsockname()[1])
    with socket.socket() as public:
        with confined_listeners("10.1.2.3"):     # not loopback: nothing to confine to
            public.bind(("0.0.0.0", 0))
            public.listen()
        assert answers(outside_ipv4(), public.getsockname()[1])
