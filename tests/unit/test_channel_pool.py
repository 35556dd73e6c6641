"""The gRPC channel pool of routers and instances: cached by address, bounded where callers
name the addresses (a decode instance's Release calls go where KV handles say), and safe
against grpc's crash when a stub is built over a closed channel."""

import sys
import threading

import grpc
import pytest

from pdserve.proto.pdserve.v1 import engine_pb2, engine_pb2_grpc
from pdserve.router.channels import ChannelPool


def test_a_bounded_pool_closes_the_least_recently_used_channel(monkeypatch):
    from pdserve.router import channels

    monkeypatch.setattr(channels, "CLOSE_AFTER_S", 0.0)  # closes at the next use of the pool
    pool = ChannelPool(max_channels=2)
    try:
        a = pool.get("127.0.0.1:1")
        stub_b = pool.prefill("127.0.0.1:2")
        assert pool.get("127.0.0.1:1") is a  # cached; now more recently used than b's
        pool.decode("127.0.0.1:3")
        assert pool.addresses() == {"127.0.0.1:1", "127.0.0.1:3"}
        pool.get("127.0.0.1:3")
        with pytest.raises(ValueError, match="closed"):  # b's channel was closed
            stub_b.Release(engine_pb2.ReleaseRequest(request_id="r"), timeout=1)
        pool.prefill("127.0.0.1:2")  # a fresh channel, closing a
        assert pool.addresses() == {"127.0.0.1:3", "127.0.0.1:2"}
    finally:
        pool.close()


def test_an_unbounded_pool_keeps_every_channel():
    pool = ChannelPool()
    try:
        channels = [pool.get(f"127.0.0.1:{port}") for port in range(1, 80)]
        assert len(pool.addresses()) == 79
        assert all(isinstance(ch, grpc.Channel) for ch in channels)
    finally:
        pool.close()


def test_stubs_built_while_other_threads_discard_and_evict_never_crash():
    """grpc ends the process (SIGSEGV) when a stub is built over a closed channel; the
    pool builds stubs and closes channels under one lock, so a route picked just before its
    instance was forgotten, or a Release racing an eviction, gets an error at worst."""
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as they can: the race shows
    pool = ChannelPool(max_channels=3)
    addresses = [f"127.0.0.1:{port}" for port in range(1, 7)]
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            for address in addresses:
                pool.discard(address)

    threads = [threading.Thread(target=churn) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for k in range(3000):
            stub = pool.stub(addresses[k % len(addresses)], ("prefill", "decode")[k % 2])
            assert isinstance(stub, (engine_pb2_grpc.PrefillStub, engine_pb2_grpc.DecodeStub))
    finally:
        stop.set()
        for t in threads:
            t.join()
        pool.close()
        sys.setswitchinterval(switch)


def test_a_call_under_way_on_an_evicted_channel_finishes():
    """A decode instance's Release to one prefill instance is not cut off because Releases
    to 64 other addresses followed (the lease would stay held until it expires)."""
    from concurrent.futures import ThreadPoolExecutor

    class SlowRelease(engine_pb2_grpc.PrefillServicer):
        def Release(self, request, context):
            threading.Event().wait(0.5)
            return engine_pb2.ReleaseResponse(released=True)

    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    engine_pb2_grpc.add_PrefillServicer_to_server(SlowRelease(), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    pool = ChannelPool(max_channels=1)
    try:
        call = pool.prefill(address).Release.future(engine_pb2.ReleaseRequest(request_id="r"),
                                                    timeout=5)
        pool.prefill("127.0.0.1:1")  # evicts the channel the call is on
        assert address not in pool.addresses()
        assert call.result().released
    finally:
        pool.close()
        server.stop(0)
