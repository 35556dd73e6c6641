"""Two credentials on a real 1P1D cluster: the cluster secret on the internal plane, API keys
on the router's public methods. Each attack of an outsider on the same network is refused with
UNAUTHENTICATED, and the cluster keeps serving correct answers to a client with a key."""

import secrets

import grpc
import pytest
from connectors import connectors
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import LLM, SamplingParams
from pdserve.cluster import Cluster, ClusterSpec
from pdserve.proto.pdserve.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from pdserve.services.auth import TOKEN_HEADER

API_KEY = "sk-test-" + secrets.token_hex(8)
SECRET = secrets.token_hex(32)
PROMPT = list(range(3000, 3040))
GREEDY = common_pb2.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
DENIED = grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture(scope="module", params=connectors("tcp"))
def cluster(request, tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp(f"auth-{request.param}")
    key_file = logs / "api_keys"
    key_file.write_text(f"# client keys\nsk-other-key-123\n{API_KEY}\n")
    spec = ClusterSpec(model=str(tiny_model_dir), connector=request.param, grpc_port=0,
                       disagg_threshold=16, kv_cache_memory_bytes=8 << 20,
                       startup_timeout_s=90, log_dir=str(logs), cluster_secret=SECRET,
                       router_args=("--api-key-file", str(key_file), "--max-instances", "2"))
    with Cluster(spec) as c:
        yield c


@pytest.fixture(scope="module")
def want(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), kv_cache_memory_bytes=8 << 20)
    return llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids


def router(cluster):
    return router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router_address))


def generate(cluster, metadata=()):
    request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=PROMPT),
                                         sampling=GREEDY)
    msgs = list(router(cluster).Generate(request, timeout=30, metadata=metadata))
    return [t for m in msgs for t in m.token_ids], msgs[-1]


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


def test_client_with_a_key_is_served_and_one_without_is_not(cluster, want):
    tokens, last = generate(cluster, [("authorization", f"Bearer {API_KEY}")])
    assert tokens == want and last.served_by.disaggregated
    assert code_of(lambda: generate(cluster)) == DENIED
    assert code_of(lambda: generate(cluster, [("authorization", "Bearer sk-guess")])) == DENIED
    listing = router_pb2.ListInstancesRequest()
    assert code_of(lambda: router(cluster).ListInstances(listing, timeout=5)) == DENIED
    embed = router_pb2.EmbedRequest(token_ids=router_pb2.TokenIds(ids=PROMPT))
    assert code_of(lambda: router(cluster).Embed(embed, timeout=30)) == DENIED
    served = router(cluster).Embed(embed, timeout=30,
                                   metadata=[("authorization", f"Bearer {API_KEY}")])
    assert served.prompt_tokens == len(PROMPT) and served.instance_id == "prefill-0"


def test_fake_instance_cannot_register(cluster, want):
    fake = common_pb2.Load(instance_id="decode-evil", role="decode", address="127.0.0.1:9",
                           total_blocks=10**6, free_blocks=10**6, block_size=16,
                           connector=cluster.spec.connector)
    assert code_of(lambda: router(cluster).Heartbeat(fake, timeout=5)) == DENIED
    assert code_of(lambda: router(cluster).Heartbeat(
        fake, timeout=5, metadata=[(TOKEN_HEADER, "0" * 64)])) == DENIED
    events = router_pb2.KVEventBatch(instance_id="decode-evil", seq=1)
    assert code_of(lambda: router(cluster).PublishKVEvents(events, timeout=5)) == DENIED
    listed = router(cluster).ListInstances(router_pb2.ListInstancesRequest(), timeout=5,
                                           metadata=[("authorization", f"Bearer {API_KEY}")])
    assert {i.instance_id for i in listed.instances} == {"prefill-0", "decode-0"}
    for _ in range(3):  # every request still goes to the real instances
        tokens, last = generate(cluster, [("authorization", f"Bearer {API_KEY}")])
        assert tokens == want and last.served_by.decode_instance == "decode-0"


@pytest.mark.parametrize("field, bad", [
    ("running_requests", {"running_requests": -10**6}),
    ("address", {"address": "decode-0-without-a-port"}),  # the router opens channels to it
    ("address", {"address": "decode 0\n:50062"}),  # and logs it
    ("block_size", {"block_size": 24}),
])
def test_member_heartbeat_with_a_bad_field_is_refused_naming_it(cluster, want, field, bad):
    fields = dict(address=cluster.child("decode-0").address, total_blocks=64, free_blocks=64,
                  block_size=16, connector=cluster.spec.connector)
    load = common_pb2.Load(instance_id="decode-0", role="decode", **{**fields, **bad})
    with pytest.raises(grpc.RpcError) as e:
        router(cluster).Heartbeat(load, timeout=5, metadata=[(TOKEN_HEADER, SECRET)])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()
    tokens, last = generate(cluster, [("authorization", f"Bearer {API_KEY}")])
    assert tokens == want and last.served_by.decode_instance == "decode-0"


def test_member_cannot_register_instances_beyond_max_instances(cluster, want):
    """The router tracks at most --max-instances (2 here: P and D) instances; a member's
    heartbeats and KV events for new ones are refused while both still heartbeat."""
    member = [(TOKEN_HEADER, SECRET)]
    for k in range(3):
        fake = common_pb2.Load(instance_id=f"decode-extra-{k}", role="decode",
                               address=f"127.0.0.1:{9 + k}", total_blocks=64, free_blocks=64,
                               block_size=16, connector=cluster.spec.connector)
        with pytest.raises(grpc.RpcError) as e:
            router(cluster).Heartbeat(fake, timeout=5, metadata=member)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-instances" in e.value.details()
        batch = router_pb2.KVEventBatch(instance_id=f"decode-extra-{k}", seq=0)
        assert not router(cluster).PublishKVEvents(batch, timeout=5, metadata=member).applied
    listed = router(cluster).ListInstances(router_pb2.ListInstancesRequest(), timeout=5,
                                           metadata=member)
    assert {i.instance_id for i in listed.instances} == {"prefill-0", "decode-0"}
    tokens, last = generate(cluster, [("authorization", f"Bearer {API_KEY}")])
    assert tokens == want and last.served_by.decode_instance == "decode-0"


@pytest.mark.parametrize("field, batch_fields, snapshot_fields", [
    ("medium", {"medium": "m" * 100_000}, {"medium": "m" * 100_000}),  # stored per block
    ("block_hashes", {"events": [router_pb2.KVEvent(stored=router_pb2.BlockStored(
        block_hashes=[1, -2], num_tokens=32))]}, {"block_hashes": [1, -2]}),
    ("parent_hash", {"events": [router_pb2.KVEvent(stored=router_pb2.BlockStored(
        block_hashes=[1], parent_hash=-1, num_tokens=16))]}, None),
    ("num_tokens", {"events": [router_pb2.KVEvent(stored=router_pb2.BlockStored(
        block_hashes=[1], num_tokens=-1))]}, None),
])
def test_member_kv_events_with_a_bad_field_are_refused_naming_it(cluster, want, field,
                                                                 batch_fields, snapshot_fields):
    """KV events over gRPC are checked as strictly as their JSON form (Redis publishers)."""
    member = [(TOKEN_HEADER, SECRET)]
    batch = router_pb2.KVEventBatch(instance_id="decode-0", seq=10**6, **batch_fields)
    calls = [lambda: router(cluster).PublishKVEvents(batch, timeout=5, metadata=member)]
    if snapshot_fields is not None:
        snapshot = router_pb2.KVStateSnapshot(instance_id="decode-0", seq=10**6,
                                              **{"block_hashes": [1, 2, 3], **snapshot_fields})
        calls.append(lambda: router(cluster).ResyncKVState(snapshot, timeout=5, metadata=member))
    for call in calls:
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in e.value.details()
    tokens, last = generate(cluster, [("authorization", f"Bearer {API_KEY}")])
    assert tokens == want and last.served_by.decode_instance == "decode-0"


def test_instances_refuse_calls_without_the_cluster_secret(cluster, want):
    prefill = cluster.child("prefill-0").address
    decode = cluster.child("decode-0").address
    p = engine_pb2_grpc.PrefillStub(grpc.insecure_channel(prefill))
    d = engine_pb2_grpc.DecodeStub(grpc.insecure_channel(decode))
    req = engine_pb2.PrefillRequest(request_id="steal", prompt_token_ids=PROMPT, sampling=GREEDY)
    assert code_of(lambda: p.Prefill(req, timeout=10)) == DENIED
    assert code_of(lambda: p.GetLoad(common_pb2.LoadRequest(), timeout=5)) == DENIED
    assert code_of(lambda: p.Release(engine_pb2.ReleaseRequest(request_id="x"), timeout=5)) \
        == DENIED
    assert code_of(lambda: list(d.Decode(engine_pb2.DecodeRequest(
        request_id="d", prompt_token_ids=PROMPT, sampling=GREEDY), timeout=10))) == DENIED
    assert code_of(lambda: d.Abort(common_pb2.AbortRequest(request_id="x"), timeout=5)) \
        == DENIED
    embed = engine_pb2.EmbedPromptRequest(request_id="e", prompt_token_ids=PROMPT)
    for address in (prefill, decode):  # every instance's Pooling service is internal
        pooling = engine_pb2_grpc.PoolingStub(grpc.insecure_channel(address))
        assert code_of(lambda: pooling.Embed(embed, timeout=10)) == DENIED
    # Health probes stay open; a peer with the secret is served.
    for address in (prefill, decode, cluster.router_address):
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
    load = p.GetLoad(common_pb2.LoadRequest(), timeout=5, metadata=[(TOKEN_HEADER, SECRET)])
    assert load.instance_id == "prefill-0"
    # The cluster secret is also accepted on the public surface (a gateway in the cluster).
    tokens, _ = generate(cluster, [(TOKEN_HEADER, SECRET)])
    assert tokens == want


def test_oversized_or_forging_ids_are_refused_naming_the_field(cluster, want):
    """Ids are stored per block, logged per request and used as label values: short and
    printable only, at the router and at the instances."""
    member = [(TOKEN_HEADER, SECRET)]
    client = [("authorization", f"Bearer {API_KEY}")]
    long_id = "i" * 129
    refusals = [
        ("instance_id", lambda: router(cluster).Heartbeat(common_pb2.Load(
            instance_id=long_id, role="decode", address="127.0.0.1:9", block_size=16),
            timeout=5, metadata=member)),
        ("instance_id", lambda: router(cluster).PublishKVEvents(router_pb2.KVEventBatch(
            instance_id=long_id, seq=0), timeout=5, metadata=member)),
        ("events", lambda: router(cluster).PublishKVEvents(router_pb2.KVEventBatch(
            instance_id="decode-0", seq=0, events=[router_pb2.KVEvent(
                stored=router_pb2.BlockStored(block_hashes=range(1, 4098)))]),
            timeout=5, metadata=member)),
        ("instance_id", lambda: router(cluster).ResyncKVState(router_pb2.KVStateSnapshot(
            instance_id="a b", seq=0, block_hashes=[1]), timeout=5, metadata=member)),
        ("request_id", lambda: list(router(cluster).Generate(router_pb2.GenerateRequest(
            request_id="ok\nforged log line", token_ids=router_pb2.TokenIds(ids=PROMPT),
            sampling=GREEDY), timeout=30, metadata=client))),
        ("request_id", lambda: router(cluster).Embed(router_pb2.EmbedRequest(
            request_id="r" * 257, token_ids=router_pb2.TokenIds(ids=PROMPT)), timeout=30,
            metadata=client)),
    ]
    decode = engine_pb2_grpc.DecodeStub(grpc.insecure_channel(cluster.child("decode-0").address))
    refusals.append(("request_id", lambda: list(decode.Decode(engine_pb2.DecodeRequest(
        request_id="d" * 1000, prompt_token_ids=PROMPT, sampling=GREEDY), timeout=30,
        metadata=member))))
    prefill = engine_pb2_grpc.PrefillStub(
        grpc.insecure_channel(cluster.child("prefill-0").address))
    refusals.append(("cache_salt", lambda: prefill.Prefill(engine_pb2.PrefillRequest(
        request_id="salted", prompt_token_ids=PROMPT, sampling=GREEDY, cache_salt="s" * 300),
        timeout=30, metadata=member)))
    refusals.append(("cache_salt", lambda: list(decode.Decode(engine_pb2.DecodeRequest(
        request_id="salted", prompt_token_ids=PROMPT, sampling=GREEDY, cache_salt="s" * 300),
        timeout=30, metadata=member))))
    for field, call in refusals:
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
        assert field in e.value.details()
    tokens, last = generate(cluster, client)
    assert tokens == want and last.served_by.decode_instance == "decode-0"
