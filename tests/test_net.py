"""free_port: ports outside the ephemeral range, bindable, never handed out twice by one process."""

from __future__ import annotations

import socket

from kvstrata.net import free_port


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
