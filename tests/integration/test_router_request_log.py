"""The router logs one INFO record per Router.Generate call when it ends (logger
`pdserve.request.router`, pdserve/router/request_log.py), as the instances log theirs: token
counts equal what the client received, and it names the prefill and decode instances. A
prefill and a decode process of the tiny model, the router in-process (so caplog sees it)."""

from __future__ import annotations

import logging
import uuid

import grpc
import pytest
from cluster_procs import prefill_and_decode, wait_for

from pdserve.proto.pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from pdserve.router.routing import RouterConfig
from pdserve.router.server import RouterServer

LOGGER = "pdserve.request.router"
PROMPT = "The history of the printing press begins in ancient China, where woodblocks were used"


@pytest.fixture(scope="module")
def instances(tiny_model_dir):
    prefill, decode = prefill_and_decode(tiny_model_dir, "tcp")
    yield prefill, decode
    decode.stop()
    prefill.stop()


def start_router(model_dir, instances, **config) -> RouterServer:
    prefill, decode = instances
    router = RouterServer(RouterConfig(model=str(model_dir), disagg_threshold=0, **config),
                          prefill=[prefill.address], decode=[decode.address]).start()
    assert wait_for(lambda: len(router.core.registry.live()) == 2, timeout=30)
    return router


def generate(router: RouterServer, request_id: str, text: str, **sampling):
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(router.address))
    request = router_pb2.GenerateRequest(request_id=request_id, text=text,
                                         sampling=common_pb2.SamplingParams(**sampling))
    return list(stub.Generate(request, timeout=60))


def ends(caplog, request_id: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == LOGGER and r.fields["request_id"] == request_id]


def test_router_logs_each_request_end(tiny_model_dir, instances, caplog):
    caplog.set_level(logging.INFO)
    router = start_router(tiny_model_dir, instances)
    try:
        rid = f"log-{uuid.uuid4().hex[:8]}"
        msgs = generate(router, rid, PROMPT, max_tokens=4, temperature=0, ignore_eos=True)
        bad = f"bad-{uuid.uuid4().hex[:8]}"
        with pytest.raises(grpc.RpcError) as e:
            generate(router, bad, PROMPT, max_tokens=4, top_p=2.0)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert wait_for(lambda: ends(caplog, rid) and ends(caplog, bad), timeout=10)
    finally:
        router.stop()

    usage, served = msgs[-1].usage, msgs[-1].served_by
    assert usage.completion_tokens == sum(len(m.token_ids) for m in msgs) == 4
    [record] = ends(caplog, rid)
    f = record.fields
    assert record.levelno == logging.INFO
    assert f["finish_reason"] == "length"
    assert f["prompt_tokens"] == usage.prompt_tokens == len(router.core.encode(PROMPT))
    assert f["output_tokens"] == 4
    assert 0 <= f["ttft_s"] <= f["e2e_s"]
    assert f["disaggregated"] and f["migrations"] == 0
    assert f["prefill_instance"] == served.prefill_instance
    assert f["decode_instance"] == served.decode_instance
    assert served.prefill_instance and served.decode_instance
    assert served.prefill_instance != served.decode_instance  # P prefilled, D decoded
    message = record.getMessage()
    assert message.startswith(f"request {rid} finished (length): ")
    assert f"{usage.prompt_tokens} prompt tokens" in message and "4 output tokens" in message
    assert f"prefill {served.prefill_instance}, decode {served.decode_instance}" in message
    assert PROMPT not in message and "printing" not in str(f)  # no prompt text

    [record] = ends(caplog, bad)
    assert record.fields["finish_reason"] == "error"
    assert record.fields["error"].startswith("INVALID_ARGUMENT: ")
    assert record.fields["output_tokens"] == 0 and record.fields["ttft_s"] is None


def test_router_request_log_can_be_turned_off(tiny_model_dir, instances, caplog):
    caplog.set_level(logging.INFO)
    router = start_router(tiny_model_dir, instances, log_requests=False)
    try:
        msgs = generate(router, "quiet", PROMPT, max_tokens=2, temperature=0, ignore_eos=True)
    finally:
        router.stop()
    assert sum(len(m.token_ids) for m in msgs) == 2
    assert not [r for r in caplog.records if r.name == LOGGER]
