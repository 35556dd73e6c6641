"""The disaggregation rule's load condition: a prompt goes through P only while D already runs
`disagg_min_running` requests, counted from D's load report or the router's own open requests,
whichever is larger."""

import pytest

from pdserve.cluster import SHARED_CORES_DISAGG_MIN_RUNNING, ClusterSpec
from pdserve.cluster_cli import default_min_running
from pdserve.proto.pdserve.v1 import common_pb2
from pdserve.router.open_requests import OpenRequests
from pdserve.router.registry import Registry
from pdserve.router.routing import Planner, RouterConfig
from pdserve.router.scorers import should_disaggregate

PROMPT = list(range(100, 164))  # 64 uncached tokens


@pytest.mark.parametrize("uncached, threshold, running, min_running, want", [
    (64, 16, 0, 0, True), (64, 16, 2, 3, False), (64, 16, 3, 3, True), (8, 16, 9, 3, False),
])
def test_should_disaggregate_by_load(uncached, threshold, running, min_running, want):
    assert should_disaggregate(uncached, threshold, running, min_running) is want


def test_should_disaggregate_rejects_negative_min_running():
    with pytest.raises(ValueError, match="min_running"):
        should_disaggregate(64, 16, 0, -1)


def planner_with_decode(running: int, waiting: int = 0) -> Planner:
    registry = Registry(ttl_s=3.0)
    for port, (iid, role) in enumerate((("d0", "decode"), ("p0", "prefill")), start=5001):
        registry.observe(common_pb2.Load(
            instance_id=iid, role=role, address=f"127.0.0.1:{port}", free_blocks=100,
            total_blocks=100, block_size=16, running_requests=running if role == "decode"
            else 0, waiting_requests=waiting if role == "decode" else 0))
    return Planner(RouterConfig(disagg_threshold=16, disagg_min_running=3), registry)


def test_reported_load_decides():
    assert not planner_with_decode(running=2).plan(PROMPT, 1).disaggregate
    assert planner_with_decode(running=3).plan(PROMPT, 1).disaggregate
    assert planner_with_decode(running=2, waiting=1).plan(PROMPT, 1).disaggregate
    assert not planner_with_decode(running=3).plan(PROMPT, 2).disaggregate  # n > 1: on D


def test_own_open_requests_count_before_the_report_does():
    planner = planner_with_decode(running=0)
    with planner.open_requests.holding("d0"), planner.open_requests.holding("d0"):
        assert not planner.plan(PROMPT, 1).disaggregate
        with planner.open_requests.holding("d0"):
            assert planner.plan(PROMPT, 1).disaggregate
    assert not planner.plan(PROMPT, 1).disaggregate


def test_open_request_count_falls_when_a_request_fails():
    open_requests = OpenRequests()
    with pytest.raises(RuntimeError), open_requests.holding("d0"):
        assert open_requests.count("d0") == 1
        raise RuntimeError("request failed")
    assert open_requests.count("d0") == 0 and open_requests.count("other") == 0


def test_negative_min_running_is_rejected():
    with pytest.raises(ValueError, match="disagg_min_running"):
        RouterConfig(disagg_min_running=-1)
    with pytest.raises(ValueError, match="disagg_min_running"):
        ClusterSpec(disagg_min_running=-1)


def test_pdserve_up_default_depends_on_core_sharing():
    assert default_min_running(None, "turns") == SHARED_CORES_DISAGG_MIN_RUNNING
    assert default_min_running(None, "shared") == SHARED_CORES_DISAGG_MIN_RUNNING
    assert default_min_running(None, "split") == 0
    assert default_min_running(5, "split") == 5 and default_min_running(0, "turns") == 0


def test_router_cli_names_a_negative_min_running():
    from pdserve.cli import main as cli_main

    with pytest.raises(SystemExit, match="disagg_min_running must be >= 0"):
        cli_main(["router", "--disagg-min-running", "-1"])
