"""Which prefill instance a decode instance can take KV from: the same connector kind and the
same block size (a handle in other blocks is refused by D, and the client got that error)."""

import pytest

from pdserve.proto.pdserve.v1 import common_pb2
from pdserve.router.registry import Registry
from pdserve.router.routing import Planner, RouterConfig

PROMPT = list(range(100, 164))  # 64 uncached tokens


def planner(prefill_blocks: int, prefill_connector: str = "shm") -> Planner:
    registry = Registry(ttl_s=3.0)
    for port, (iid, role, blocks, connector) in enumerate((
            ("d0", "decode", 16, "shm"), ("p0", "prefill", prefill_blocks, prefill_connector)),
            start=5001):
        registry.observe(common_pb2.Load(
            instance_id=iid, role=role, address=f"127.0.0.1:{port}", free_blocks=100,
            total_blocks=100, block_size=blocks, connector=connector))
    return Planner(RouterConfig(disagg_threshold=16), registry)


@pytest.mark.parametrize("blocks, connector, paired", [
    (16, "shm", True), (32, "shm", False), (16, "tcp", False), (0, "shm", True)])
def test_prefill_is_paired_only_with_a_decode_that_can_read_its_handle(blocks, connector,
                                                                       paired):
    p = planner(blocks, connector)
    plan = p.plan(PROMPT, 1)
    assert plan.decode.id == "d0"
    found = p.pick_prefill(plan.request, plan.decode)
    assert (found is not None and found.id == "p0") is paired
