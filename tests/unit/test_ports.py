"""Picking ports for servers started a moment later: below the kernel's ephemeral range (where
no outgoing connection or bind to port 0 can take them first), free, never handed out twice."""

import socket

from pdserve import ports


def test_picked_ports_are_free_distinct_and_below_the_ephemeral_range():
    start = ports._ephemeral_start()
    picked = [ports.pick_free_port("127.0.0.1") for _ in range(50)]
    assert len(set(picked)) == len(picked)
    assert all(ports.PICK_FROM <= p < start for p in picked)
    for port in picked[:5]:  # a server can listen there
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen()


def test_a_port_in_use_is_not_picked(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        # Only the busy port and one other are candidates: the other one is picked.
        choices = iter([taken, taken, taken + 1 if taken < 65535 else taken - 1])
        monkeypatch.setattr(ports.random.SystemRandom, "randrange",
                            lambda self, a, b: next(choices))
        monkeypatch.setattr(ports, "_ephemeral_start", lambda: ports.PICK_FROM + 1000)
        monkeypatch.setattr(ports, "_picked", set())
        assert ports.pick_free_port("127.0.0.1") != taken


def test_no_room_below_the_range_falls_back_to_the_system_pick(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_start", lambda: ports.PICK_FROM + 10)
    port = ports.pick_free_port("127.0.0.1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
