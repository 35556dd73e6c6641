"""Router instance registry: heartbeats and polls into one table, TTL, mark_down, roles."""

import contextlib
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdserve.proto.pdserve.v1 import common_pb2, engine_pb2_grpc
from pdserve.router.channels import ChannelPool
from pdserve.router.registry import DEFAULT_BLOCK_SIZE, Registry, RegistryFull, StaticPoller


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def load(iid="d0", role="decode", address="127.0.0.1:5001", **kw):
    return common_pb2.Load(instance_id=iid, role=role, address=address, **kw)


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def reg(clock):
    return Registry(ttl_s=3.0, forget_after_s=30.0, clock=clock)


def test_observe_maps_load_to_view(reg):
    reg.observe(load(waiting_requests=2, waiting_tokens=300, running_requests=1,
                     free_blocks=10, total_blocks=40, connector="tcp", block_size=32))
    (inst,) = reg.live()
    v = inst.view
    assert (v.id, v.role, v.address) == ("d0", "decode", "127.0.0.1:5001")
    assert (v.queued_requests, v.queued_tokens, v.running_requests) == (2, 300, 1)
    assert v.kv_usage == pytest.approx(0.75)
    assert (inst.connector, inst.block_size) == ("tcp", 32)
    assert reg.block_size() == 32
    assert inst.to_load().waiting_tokens == 300


def test_a_full_registry_refuses_new_instances_until_one_is_forgotten(clock):
    reg = Registry(ttl_s=3.0, forget_after_s=30.0, clock=clock, max_instances=2)
    reg.observe(load("d0", address="127.0.0.1:5001"))
    reg.observe(load("d1", address="127.0.0.1:5002"))
    with pytest.raises(RegistryFull, match="2 instances"):
        reg.observe(load("evil", address="127.0.0.1:9"))
    reg.observe(load("p0", role="prefill", address="127.0.0.1:6000"), static=True)  # listed
    reg.observe(load("d0", address="127.0.0.1:5001", running_requests=3))  # known: served
    assert [i.id for i in reg.live()] == ["d0", "d1", "p0"]
    clock.t += 10.0  # quiet past ttl_s, not yet forgotten: still no room
    reg.observe(load("d0", address="127.0.0.1:5001"))
    with pytest.raises(RegistryFull):
        reg.observe(load("d2", address="127.0.0.1:5003"))
    reg.forget("p0")
    assert [i.id for i in reg.all()] == ["d0", "d1"]
    clock.t += 25.0  # d1 silent for 35 s: forgotten, its place free
    reg.observe(load("d2", address="127.0.0.1:5003"))
    with pytest.raises(RegistryFull):
        reg.observe(load("d3", address="127.0.0.1:5004"))
    assert [i.id for i in reg.all()] == ["d0", "d2"]


@pytest.mark.parametrize("role, live_as_prefill, live_as_decode", [
    ("prefill", True, False), ("decode", False, True), ("colocated", True, True)])
def test_roles(reg, role, live_as_prefill, live_as_decode):
    reg.observe(load(role=role))
    assert bool(reg.live("prefill")) == live_as_prefill
    assert bool(reg.live("decode")) == live_as_decode


@pytest.mark.parametrize("bad, field", [
    (load(address=""), "address"), (load(role="router"), "role"), (load(role=""), "role"),
    (load(running_requests=-1), "running_requests"),
    (load(waiting_requests=-5), "waiting_requests"),
    (load(waiting_tokens=-1), "waiting_tokens"), (load(free_blocks=-1), "free_blocks"),
    (load(total_blocks=-2), "total_blocks"), (load(prefix_hits=-1), "prefix_hits"),
    (load(spec_accepted_tokens=-3), "spec_accepted_tokens"),
    (load(kv_transfer_seconds=float("nan")), "kv_transfer_seconds"),
    (load(kv_transfer_seconds=-1.0), "kv_transfer_seconds"),
    # a channel is opened to every address routed to: HOST:PORT only
    (load(address="x" * 300 + ":1"), "address"), (load(address="127.0.0.1"), "address"),
    (load(address="127.0.0.1:99999"), "address"), (load(address=":50051"), "address"),
    (load(block_size=24), "block_size"), (load(block_size=4096), "block_size")])
def test_unusable_loads_are_rejected_naming_the_field(reg, bad, field):
    with pytest.raises(ValueError, match=field):
        reg.observe(bad)
    assert reg.all() == []


def test_unknown_id_is_keyed_by_address(reg):
    reg.observe(load(iid=""))
    assert [i.id for i in reg.live()] == ["127.0.0.1:5001"]


def test_ttl_lapses_and_heartbeat_revives(reg, clock):
    reg.observe(load())
    clock.t += 3.0
    assert len(reg.live()) == 1  # exactly ttl_s old: still live
    clock.t += 0.1
    assert reg.live() == [] and len(reg.all()) == 1
    reg.observe(load())
    assert len(reg.live()) == 1


def test_dynamic_instances_are_forgotten_static_ones_kept(reg, clock):
    reg.observe(load("dyn", address="127.0.0.1:1"))
    reg.observe(load("stat", address="127.0.0.1:2"), static=True)
    clock.t += 31
    reg.observe(load("other", address="127.0.0.1:3"))  # any observation sweeps
    assert [i.id for i in reg.all()] == ["other", "stat"]


def test_mark_down_until_a_later_answer(reg, clock):
    reg.observe(load())
    started_before = clock.t
    clock.t += 0.5
    assert reg.mark_down("d0")  # newly down
    assert not reg.mark_down("d0")  # already down
    assert reg.live() == []
    reg.observe(load(), seen_at=started_before)  # a poll sent before the failure
    assert reg.live() == []
    clock.t += 0.1
    reg.observe(load())
    assert [i.id for i in reg.live()] == ["d0"]
    assert not reg.mark_down("unknown")  # no-op


def test_static_and_heartbeat_share_one_entry(reg):
    reg.observe(load(address="localhost:5001"), address="127.0.0.1:5001", role="decode",
                static=True)
    reg.observe(load(waiting_requests=7, address="127.0.0.1:5001"))
    (inst,) = reg.all()
    assert inst.static and inst.view.queued_requests == 7


def test_a_heartbeat_neither_moves_nor_revives_an_instance_the_router_polls(reg, clock):
    reg.observe(load(), address="127.0.0.1:5001", role="decode", static=True)
    reg.mark_down("d0")  # the router cannot reach it
    clock.t += 1
    reg.observe(load(address="10.9.9.9:5001", role="prefill", running_requests=2))
    (inst,) = reg.all()
    assert inst.down_since is not None and reg.live() == []
    assert (inst.address, inst.view.role, inst.view.running_requests) == \
        ("127.0.0.1:5001", "decode", 2)
    reg.observe(load(), address="127.0.0.1:5001", role="decode", static=True)  # a poll answers
    assert [i.id for i in reg.live()] == ["d0"]


def test_live_is_sorted_and_block_size_defaults(reg):
    assert reg.block_size() == DEFAULT_BLOCK_SIZE
    for port, iid in enumerate(("p1", "d0", "p0"), start=5001):
        reg.observe(load(iid, role="prefill" if iid[0] == "p" else "decode",
                         address=f"127.0.0.1:{port}"))
    assert [i.id for i in reg.live("prefill")] == ["p0", "p1"]
    assert reg.block_size() == DEFAULT_BLOCK_SIZE  # none reported one


def test_a_forgotten_address_closes_its_channel_unless_another_instance_uses_it(clock):
    """Instances restart on new ports and under new ids: the router's channel to an address no
    instance has any more is closed when the last one there is forgotten."""
    channels = ChannelPool()
    reg = Registry(ttl_s=3.0, forget_after_s=30.0, clock=clock, on_forget=channels.discard)
    reg.observe(load("old", address="127.0.0.1:6001"))
    reg.observe(load("moved", address="127.0.0.1:6002"))
    for address in ("127.0.0.1:6001", "127.0.0.1:6002"):
        channels.get(address)
    clock.t += 20.0
    reg.observe(load("new", address="127.0.0.1:6001"))  # restarted on the same address
    clock.t += 20.0
    reg.observe(load("new", address="127.0.0.1:6001"))
    assert [i.id for i in reg.all()] == ["new"]
    assert channels.addresses() == {"127.0.0.1:6001"}
    channels.close()


def test_bad_config():
    with pytest.raises(ValueError, match="ttl_s"):
        Registry(ttl_s=0)


class _Decode(engine_pb2_grpc.DecodeServicer):
    instance_id = "dec-a"

    def GetLoad(self, request, context):
        return common_pb2.Load(instance_id=self.instance_id, role="decode", address="ignored:1",
                               free_blocks=5, total_blocks=8, block_size=16)


def test_static_poller_over_grpc(reg):
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    engine_pb2_grpc.add_DecodeServicer_to_server(_Decode(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    address = f"127.0.0.1:{port}"
    channels = ChannelPool()

    # A second target nobody listens on: its poll fails fast and registers nothing.
    dead = "127.0.0.1:1"
    poller = StaticPoller(reg, [(address, "decode"), (dead, "decode")], channels.stub,
                          poll_interval_s=0.1, timeout_s=1.0)
    try:
        poller.poll_once()
        (inst,) = reg.live("decode")
        assert (inst.id, inst.address, inst.static) == ("dec-a", address, True)
        server.stop(0).wait(2)
        poller.poll_once()  # connection refused: down at once, not after the TTL
        assert reg.live() == []
    finally:
        server.stop(0)
        channels.close()


def test_a_static_instance_restarted_with_a_new_id_replaces_its_entry(reg):
    servicer = _Decode()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    engine_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    channels = ChannelPool()
    poller = StaticPoller(reg, [(address, "decode")], channels.stub, poll_interval_s=0.1)
    try:
        for k in range(3):  # each restart picks a new id, as instances do by default
            servicer.instance_id = f"decode-{k}"
            poller.poll_once()
            assert [i.id for i in reg.all()] == [f"decode-{k}"]
        assert channels.addresses() == {address}  # the one channel stays open
    finally:
        server.stop(0)
        channels.close()


def test_static_poller_rejects_bad_role(reg):
    with pytest.raises(ValueError, match="role"):
        StaticPoller(reg, [("127.0.0.1:1", "router")], ChannelPool().stub)


class _SlowHandshakeProxy:
    """A TCP proxy to `port` whose server-to-client bytes can start late: a loaded
    instance that answers gRPC's handshake after `delay_s`."""

    def __init__(self, port: int):
        import socket
        import threading

        self.port, self.delay_s, self.accepted = port, 0.0, []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        import socket
        import threading

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.port))
            self.accepted.append(client)
            threading.Thread(target=_pipe, args=(client, server, 0.0), daemon=True).start()
            threading.Thread(target=_pipe, args=(server, client, self.delay_s),
                             daemon=True).start()

    def drop_connections(self):
        import socket

        for c in self.accepted:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)


def _pipe(src, dst, delay_s):
    import socket
    import time

    time.sleep(delay_s)
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    for s in (src, dst):
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)


def test_a_static_instance_slow_to_handshake_comes_back_after_a_failed_call():
    """A loaded instance that answers gRPC's handshake 1.5 s late, after one failed call
    marked it down, is live again after its next polls (its channel's connection attempts
    must be allowed that long)."""
    import time

    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    engine_pb2_grpc.add_DecodeServicer_to_server(_Decode(), server)
    proxy = _SlowHandshakeProxy(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    channels, reg = ChannelPool(), Registry(ttl_s=3.0)
    poller = StaticPoller(reg, [(proxy.address, "decode")], channels.stub, poll_interval_s=0.5)
    try:
        poller.poll_once()
        assert [i.id for i in reg.live()] == ["dec-a"]
        proxy.delay_s = 1.5
        proxy.drop_connections()
        reg.mark_down("dec-a")
        deadline = time.monotonic() + 8
        while not reg.live() and time.monotonic() < deadline:
            poller.poll_once()
            time.sleep(0.5)
        assert [i.id for i in reg.live()] == ["dec-a"]
    finally:
        server.stop(0)
        channels.close()
        proxy.listener.close()
