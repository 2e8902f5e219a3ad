"""Ports for the servers we start that cannot report their own (adapters/ports.py)."""

import socket

from paged_backend.adapters.ports import ephemeral_range, free_port


def test_free_ports_are_outside_the_ephemeral_range_and_never_repeat():
    """A chosen port is bound seconds later (a compiled or tensor-parallel server; tritonserver): one from the
    ephemeral range could meanwhile become another socket's (a fresh-clone run lost a server's port that way), and
    two servers started side by side must not share one."""
    low, high = ephemeral_range()
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(0 < port < low or high < port < 65536 for port in ports), (low, high, sorted(ports)[:5])


def test_a_port_in_use_or_given_before_is_skipped(monkeypatch):
    import paged_backend.adapters.ports as ports

    given = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        busy = taken.getsockname()[1]
        fresh = next(p for p in range(10000, 11000) if p not in ports._GIVEN and p != busy and _bindable(p))
        drawn = iter([busy, given, fresh])
        monkeypatch.setattr(ports.random, "choice", lambda candidates: next(drawn))
        assert free_port() == fresh


def test_a_machine_whose_ephemeral_range_covers_every_port_still_gets_distinct_free_ports(monkeypatch):
    import paged_backend.adapters.ports as ports

    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    got = [free_port() for _ in range(50)]
    assert len(set(got)) == len(got) and all(1024 <= port <= 65535 for port in got)
    assert all(_bindable(port) for port in got)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
