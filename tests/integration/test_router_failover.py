"""Instances dying under the router: a retried prefill, a local prefill, a clear error.

One 2P2D cluster, taken apart step by step. A prefill instance is frozen (SIGSTOP) so that a
request is sure to be waiting on it, then killed (SIGKILL) mid-request.
"""

import os
import signal
import threading
import time

import grpc
import pytest
from cluster_procs import wait_for
from frozen import freeze

from pdserve import LLM, SamplingParams
from pdserve.cluster import Cluster, ClusterSpec
from pdserve.proto.pdserve.v1 import (
    common_pb2,
    engine_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)

KV_BYTES = 8 << 20
SAMPLING = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    spec = ClusterSpec(model=str(tiny_model_dir), num_prefill=2, num_decode=2, grpc_port=0,
                       disagg_threshold=16, kv_cache_memory_bytes=KV_BYTES,
                       startup_timeout_s=90, log_dir=str(tmp_path_factory.mktemp("logs")),
                       router_args=("--prefill-timeout-s", "2"))
    with Cluster(spec) as c:
        yield c
        for child in c.children:  # nothing stays frozen into the teardown
            if child.proc.poll() is None:
                os.kill(child.proc.pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), kv_cache_memory_bytes=KV_BYTES)
    return lambda ids: llm.generate({"prompt_token_ids": ids}, SamplingParams(**SAMPLING),
                                    use_tqdm=False)[0].outputs[0].token_ids


def stub(cluster):
    return router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router_address))


def request(ids, **sampling):
    return router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids),
                                      sampling=common_pb2.SamplingParams(**(sampling or SAMPLING)))


def listed_prefills(router) -> dict[str, int]:
    """Prefill instances the router would route to now, with their waiting prompt tokens."""
    listed = router.ListInstances(router_pb2.ListInstancesRequest(), timeout=5)
    return {i.instance_id: i.waiting_tokens for i in listed.instances
            if i.instance_id.startswith("prefill")}


def generate_while_killing(cluster, name, ids):
    """Freeze `name`, start a request, kill `name` once the router has routed the request
    (its initial metadata) to it: the request is then still waiting (the router waits
    --prefill-timeout-s, 2 s, before it probes a silent prefill). First wait until the router
    lists `name` and every prefill it lists is idle, so that the pick is a tie; a request the
    router sent elsewhere all the same (on a loaded machine its view of `name` may lapse)
    ends without waiting: then `name` is thawed and the scenario tried again (3 times) with
    other tokens, whose prefix no instance holds. Returns (messages, seconds, the prompt)."""
    router = stub(cluster)
    proc = cluster.child(name).proc
    for attempt in range(3):
        ids = [t + 1000 * attempt for t in ids]
        assert wait_for(lambda: name in (seen := listed_prefills(router))
                        and not any(seen.values()), timeout=15), listed_prefills(router)
        freeze(proc.pid)
        start = time.monotonic()
        call = router.Generate(request(ids), timeout=30)
        try:
            call.initial_metadata()  # accepted and routed
            time.sleep(0.3)
            if call.done():  # not waiting on the frozen prefill: it went elsewhere
                list(call)
                os.kill(proc.pid, signal.SIGCONT)
                continue
            proc.kill()
            proc.wait(10)
            msgs = list(call)
        except grpc.RpcError as e:
            raise AssertionError(f"the request failed: {e}") from None
        return msgs, time.monotonic() - start, ids
    raise AssertionError(f"the router never sent the request to {name}: {router_log(cluster)}")


def router_log(cluster) -> str:
    return (cluster.log_dir / "router.log").read_text()[-3000:]


def decodes_free(cluster):
    for child in cluster.instances:
        if child.role == "decode" and child.proc.poll() is None:
            d = engine_pb2_grpc.DecodeStub(grpc.insecure_channel(child.address))
            load = d.GetLoad(common_pb2.LoadRequest(), timeout=5)
            if load.free_blocks != load.total_blocks:
                return False
    return True


def test_killed_prefill_is_retried_on_the_other_one(cluster, reference):
    # Idle cluster, tied scores: the first prefill pick is prefill-0 (smallest id).
    ids = list(range(5000, 5040))
    msgs, seconds, ids = generate_while_killing(cluster, "prefill-0", ids)
    assert [t for m in msgs for t in m.token_ids] == reference(ids)
    served = msgs[-1].served_by
    assert served.disaggregated and served.prefill_attempts == 2, (served, router_log(cluster))
    assert served.prefill_instance == "prefill-1"
    assert seconds < 15
    assert wait_for(lambda: decodes_free(cluster), timeout=15)


def test_last_prefill_killed_falls_back_to_local_prefill(cluster, reference):
    ids = list(range(6000, 6040))
    msgs, _, ids = generate_while_killing(cluster, "prefill-1", ids)
    assert [t for m in msgs for t in m.token_ids] == reference(ids)
    served = msgs[-1].served_by
    assert not served.disaggregated and served.prefill_attempts == 1
    assert served.prefill_instance == served.decode_instance
    # With no prefill instance left, long prompts are prefilled on D straight away.
    msgs = list(stub(cluster).Generate(request(list(range(6100, 6140))), timeout=30))
    assert msgs[-1].served_by.prefill_attempts == 0
    assert wait_for(lambda: decodes_free(cluster), timeout=15)


def test_frozen_decode_mid_stream_migrates_instead_of_hanging(cluster, tiny_model_dir):
    """A decode instance that stops (SIGSTOP: no error, no closed connection) mid-stream is
    probed once its stream has been silent for --prefill-timeout-s, and the request goes on
    on the other one; the client gets the undisturbed output."""
    ids, sampling = list(range(7500, 7540)), dict(temperature=0, max_tokens=300, ignore_eos=True)
    want = LLM(str(tiny_model_dir), kv_cache_memory_bytes=KV_BYTES).generate(
        {"prompt_token_ids": ids}, SamplingParams(**sampling), use_tqdm=False)[0]
    call = stub(cluster).Generate(request(ids, **sampling), timeout=60)
    first = [next(call), next(call)]
    frozen = cluster.child(first[0].served_by.decode_instance).proc
    freeze(frozen.pid)
    try:
        msgs = first + list(call)
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    assert [t for m in msgs for t in m.token_ids] == want.outputs[0].token_ids
    assert msgs[-1].served_by.migrations == 1
    names = {"decode-0", "decode-1"}
    assert wait_for(lambda: {i.instance_id for i in stub(cluster).ListInstances(
        router_pb2.ListInstancesRequest(), timeout=5).instances} >= names, timeout=15)


def test_dead_decode_before_streaming_is_retried_on_the_other_one(cluster, reference):
    # Two requests at once on tied decode instances: one of them picks decode-0, which is
    # dead; it is retried on decode-1 (the router notices before anything was streamed).
    cluster.child("decode-0").proc.kill()
    cluster.child("decode-0").proc.wait(10)
    prompts = [list(range(8000, 8040)), list(range(8100, 8140))]
    results = [None, None]

    def run(i):
        results[i] = list(stub(cluster).Generate(request(prompts[i]), timeout=30))

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for ids, msgs in zip(prompts, results, strict=True):
        assert msgs is not None, "a request failed or hung"
        assert [t for m in msgs for t in m.token_ids] == reference(ids)
        assert msgs[-1].served_by.decode_instance == "decode-1"


def test_decode_killed_mid_stream_gives_a_clear_error(cluster):
    call = stub(cluster).Generate(request(list(range(7000, 7040)), temperature=0,
                                          max_tokens=1500, ignore_eos=True), timeout=30)
    next(call)
    next(call)
    cluster.child("decode-1").proc.kill()
    with pytest.raises(grpc.RpcError) as e:
        for _ in call:
            pass
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # decode-1 died mid-stream. If the router still counted decode-0 (killed by an earlier
    # test) as live, the request migrated there and failed before streaming; either way the
    # client gets a clear error naming the dead instance.
    details = e.value.details()
    assert ("decode instance decode-1 failed mid-stream" in details
            or ("decode instance decode-0 failed before streaming" in details
                and "after 1 migrations" in details)), details
    with pytest.raises(grpc.RpcError) as e:
        list(stub(cluster).Generate(request(list(range(50))), timeout=10))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # Both decode instances are dead. decode-0 (killed by the test before) is known to be
    # down only if a request tried it there, else until its heartbeats expire: the router
    # tries it, fails before streaming and has no third instance to retry on.
    details = e.value.details()
    assert ("no healthy decode instance" in details
            or "decode instance decode-0 failed before streaming" in details), details
