"""Where the router computes an embedding: a prefill instance first (the one holding the
prompt's prefix, when one does), a decode instance only when no prefill instance is live."""

from pdserve.proto.pdserve.v1 import common_pb2
from pdserve.router.registry import Registry
from pdserve.router.routing import Planner, RouterConfig

PROMPT = list(range(100, 164))  # 4 blocks of 16


def observe(registry, iid, role, port):
    registry.observe(common_pb2.Load(instance_id=iid, role=role, address=f"127.0.0.1:{port}",
                                     free_blocks=100, total_blocks=100, block_size=16))


def test_prefill_first_then_decode():
    registry = Registry(ttl_s=3.0)
    for port, (iid, role) in enumerate((("d0", "decode"), ("p0", "prefill"),
                                         ("p1", "prefill")), start=5001):
        observe(registry, iid, role, port)
    held = {"p1": 4}  # p1 holds the prompt's whole prefix
    planner = Planner(RouterConfig(), registry, lambda hashes: held if len(hashes) == 4 else {})
    request = planner.routing_request(PROMPT)
    assert request.num_blocks == 4 and dict(request.prefix_matches) == held
    assert planner.pick_pooling(request).id == "p1"
    assert planner.pick_pooling(request, exclude=["p1"]).id == "p0"
    assert planner.pick_pooling(request, exclude=["p0", "p1"]).id == "d0"
    assert planner.pick_pooling(request, exclude=["p0", "p1", "d0"]) is None
    registry.mark_down("p1")
    registry.mark_down("p0")
    assert planner.pick_pooling(request).id == "d0"
