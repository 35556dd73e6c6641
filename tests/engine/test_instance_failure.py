"""An instance whose engine loop dies says so: NOT_SERVING, no more heartbeats, exit code 1."""

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import SamplingParams
from pdserve.engine.engine_args import EngineArgs
from pdserve.services.instance import Instance


def test_dead_engine_loop_turns_the_instance_not_serving(tiny_model_dir):
    instance = Instance("decode", EngineArgs(model=str(tiny_model_dir),
                                             kv_cache_memory_bytes=4 << 20), "none")
    instance.start()
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(instance.address))

    def status():
        return health.Check(health_pb2.HealthCheckRequest(), timeout=5).status

    assert status() == health_pb2.HealthCheckResponse.SERVING

    def broken_step():  # a fault that no validation of a request could have caught
        raise RuntimeError("injected fault")

    instance.engine.step = broken_step
    stream = instance.loop.submit("r", {"prompt_token_ids": [5, 6, 7]},
                                  SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="injected fault"):
        stream.get(timeout=10)
    deadline = time.monotonic() + 10
    while status() != health_pb2.HealthCheckResponse.NOT_SERVING:
        assert time.monotonic() < deadline, "still SERVING with a dead engine"
        time.sleep(0.05)
    assert instance._stop.is_set()  # no more heartbeats: the router drops it
    # The process's main thread returns exit code 1 for its supervisor.
    assert instance.server.serve_until_signal(on_stop=instance.stop) == 1
