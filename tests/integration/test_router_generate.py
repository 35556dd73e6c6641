"""Router + prefill + decode processes (`Cluster`, as `pdserve up` starts them) over loopback."""

import threading
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import unquote

import grpc
import pytest
from cluster_procs import all_free, wait_for
from connectors import connectors

from pdserve import LLM, SamplingParams
from pdserve.cluster import Cluster, ClusterSpec
from pdserve.proto.pdserve.v1 import (
    common_pb2,
    router_pb2,
    router_pb2_grpc,
)

THRESHOLD = 16  # prompts of 16+ uncached tokens are disaggregated
KV_BYTES = 8 << 20


@pytest.fixture(scope="module")
def clusters(tiny_model_dir, tmp_path_factory):
    """`get(connector, *instance_args)`: a 1P1D cluster; the previous one is stopped first
    (CPU is scarce)."""
    running: dict[tuple, Cluster] = {}

    def get(connector: str, *instance_args: str) -> Cluster:
        key = (connector, *instance_args)
        if key not in running:
            for other in running.values():
                other.stop()
            running.clear()
            spec = ClusterSpec(model=str(tiny_model_dir), connector=connector, grpc_port=0,
                               disagg_threshold=THRESHOLD, kv_cache_memory_bytes=KV_BYTES,
                               startup_timeout_s=90, instance_args=instance_args,
                               log_dir=str(tmp_path_factory.mktemp(f"logs-{connector}")))
            running[key] = Cluster(spec).start()
        return running[key]

    yield get
    for cluster in running.values():
        cluster.stop()


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), kv_cache_memory_bytes=KV_BYTES)


def router(cluster):
    return router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router_address))


def generate(cluster, prompt, timeout=30, **sampling):
    """All messages of one Generate; `prompt` is text or a list of token ids."""
    request = router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(**sampling))
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return list(router(cluster).Generate(request, timeout=timeout))


def tokens(msgs, index=0):
    return [t for m in msgs if m.index == index for t in m.token_ids]


def test_text_prompt_is_tokenized_like_the_engine(clusters, llm):
    cluster = clusters("shm")
    text = "The history of the printing press begins in ancient China, where woodblocks were " * 2
    msgs = generate(cluster, text, temperature=0, max_tokens=8, ignore_eos=True)
    want = llm.generate(text, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0]
    assert list(msgs[0].prompt_token_ids) == want.prompt_token_ids
    assert tokens(msgs) == want.outputs[0].token_ids
    assert msgs[-1].served_by.disaggregated


def test_short_prompt_goes_to_decode_only(clusters, llm):
    cluster = clusters("shm")
    ids = list(range(4000, 4000 + THRESHOLD - 1))
    msgs = generate(cluster, ids, temperature=0, max_tokens=6, ignore_eos=True)
    want = llm.generate({"prompt_token_ids": ids}, SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert tokens(msgs) == want.token_ids
    served = msgs[-1].served_by
    assert not served.disaggregated and served.prefill_attempts == 0
    assert served.prefill_instance == served.decode_instance == "decode-0"
    assert msgs[0].HasField("served_by") and list(msgs[0].prompt_token_ids) == ids


def test_prompt_cached_on_decode_skips_prefill(clusters):
    """D's KV events reach the router's prefix index: a prompt D holds is not sent to P."""
    cluster = clusters("shm")
    ids = list(range(4500, 4540))
    assert generate(cluster, ids, max_tokens=2)[-1].served_by.disaggregated

    def decode_only():
        last = generate(cluster, ids, max_tokens=2)[-1]
        return not last.served_by.disaggregated and last.usage.cached_tokens >= 32

    assert wait_for(decode_only, timeout=10, interval=0.2)


def test_cache_salt_is_hashed_alike_by_router_and_instances(clusters, llm):
    """A salted prompt's blocks reach the index under the salt's hashes, which the router
    computes too (the prompt then stays on D); another salt matches nothing anywhere."""
    cluster = clusters("shm")
    ids = list(range(4600, 4640))
    want = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=3,
                        ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids

    def salted(salt):
        request = router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=ids), cache_salt=salt,
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        msgs = list(router(cluster).Generate(request, timeout=30))
        assert tokens(msgs) == want
        return msgs[-1]

    first = salted("tenant-a")
    assert first.served_by.disaggregated and first.usage.cached_tokens == 0
    assert wait_for(lambda: (lambda last: not last.served_by.disaggregated
                             and last.usage.cached_tokens >= 32)(salted("tenant-a")),
                    timeout=10, interval=0.2)
    other = salted("tenant-b")
    assert other.served_by.disaggregated and other.usage.cached_tokens == 0
    with pytest.raises(grpc.RpcError) as e:
        salted("s" * 257)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in e.value.details()


def test_first_token_finishes_without_decode(clusters):
    cluster = clusters("shm")
    msgs = generate(cluster, list(range(4100, 4140)), temperature=0, max_tokens=1)
    (msg,) = msgs
    assert len(msg.token_ids) == 1 and msg.finish_reason == "length"
    assert msg.usage.completion_tokens == 1 and msg.served_by.disaggregated
    assert msg.served_by.decode_instance == ""
    assert wait_for(lambda: all_free(cluster), timeout=15)


def test_n2_prefills_on_decode(clusters, llm):
    cluster = clusters("shm")
    ids = list(range(4200, 4240))
    sampling = {"n": 2, "temperature": 0.8, "seed": 11, "max_tokens": 6, "ignore_eos": True}
    msgs = generate(cluster, ids, **sampling)
    want = llm.generate({"prompt_token_ids": ids}, SamplingParams(**sampling),
                        use_tqdm=False)[0].outputs
    assert [tokens(msgs, i) for i in (0, 1)] == [w.token_ids for w in want]
    assert {m.index for m in msgs if m.finish_reason} == {0, 1}
    assert not msgs[-1].served_by.disaggregated
    assert msgs[-1].usage.completion_tokens == 12


@pytest.mark.parametrize("prompt, sampling, field", [
    (list(range(50)), {"temperature": -1.0}, "temperature"),
    (list(range(50)), {"top_p": 1.5}, "top_p"),
    (list(range(50)), {"temperature": float("nan")}, "temperature"),
    (list(range(50)), {"presence_penalty": float("inf")}, "presence_penalty"),
    (list(range(50)), {"logit_bias": {5: float("nan")}}, "logit_bias"),
    (list(range(50)), {"max_tokens": 0}, "max_tokens"),
    (list(range(50)), {"n": 2, "temperature": 0}, "n"),
    (list(range(50)), {"n": 129, "temperature": 1.0}, "n"),  # at most 128 sequences
    (list(range(50)), {"stop": ["x"] * 129}, "stop"),  # checked at every token: bounded
    (list(range(50)), {"bad_words": ["x"] * 1025}, "bad_words"),
    ("", {}, "prompt"),
    ([], {}, "prompt"),
    (None, {}, "prompt"),
    ([-3] * 20, {}, "token_ids"),
    ([10**8] * 20, {}, "token_id"),  # out of the vocabulary: the prefill instance says so
    ([10**8] * 2, {}, "token_id"),  # same, from the decode instance (under the threshold)
])
def test_invalid_arguments(clusters, prompt, sampling, field):
    cluster = clusters("shm")
    request = router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(**sampling))
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None:
        request.token_ids.ids.extend(prompt)
    with pytest.raises(grpc.RpcError) as e:
        list(router(cluster).Generate(request, timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()


@pytest.mark.parametrize("prompt, sampling, field", [
    (list(range(50)), {"max_tokens": 10**6}, "max_tokens"),
    (list(range(3000)), {"max_tokens": 1}, "prompt"),  # the tiny model's context is 2,048
    (list(range(50)), {"logprobs": 21}, "logprobs"),
    (list(range(50)), {"prompt_logprobs": 100}, "prompt_logprobs"),
    (list(range(50)), {"logprob_token_ids": list(range(21))}, "logprob_token_ids"),
])
def test_caps_equal_the_http_gateways(clusters, prompt, sampling, field):
    cluster = clusters("shm")
    request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=prompt),
                                         sampling=common_pb2.SamplingParams(**sampling))
    with pytest.raises(grpc.RpcError) as e:
        list(router(cluster).Generate(request, timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()


def test_invalid_utf8_text_is_invalid_argument(clusters):
    """Field 2 (text) holding bytes that are not UTF-8, sent raw: proto3 forbids them."""
    cluster = clusters("shm")
    raw = grpc.insecure_channel(cluster.router_address).unary_stream(
        "/pdserve.v1.Router/Generate", request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as e:
        list(raw(b"\x12\x03\xff\xfe\xfd", timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "GenerateRequest" in e.value.details() or "Generate" in e.value.details()
    assert tokens(generate(cluster, list(range(4600, 4620)), max_tokens=2))  # still serves


def test_client_cancel_frees_blocks_on_both_sides(clusters):
    cluster = clusters("shm")
    request = router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=list(range(4300, 4340))),
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True))
    call = router(cluster).Generate(request, timeout=60)
    first = next(call)
    assert first.served_by.disaggregated
    for _ in range(3):
        next(call)
    call.cancel()
    assert wait_for(lambda: all_free(cluster), timeout=15)
    # The cluster still serves.
    assert tokens(generate(cluster, list(range(4400, 4440)), max_tokens=3, ignore_eos=True))


def test_two_clients_choosing_the_same_request_id_both_get_their_answer(clusters, llm):
    """Clients choose request ids; two may clash. Each call reaches the instances under an id
    of its own, so neither is refused as a duplicate, nor aborted, nor has its KV lease
    released by the other's call."""
    cluster = clusters("shm")
    prompts = [list(range(5000, 5040)), list(range(5100, 5140))]
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    start = threading.Barrier(2)

    def call(ids):
        start.wait()
        return list(router(cluster).Generate(router_pb2.GenerateRequest(
            request_id="same", token_ids=router_pb2.TokenIds(ids=ids), sampling=sampling),
            timeout=60))

    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(call, prompts))
    for ids, msgs in zip(prompts, answers):
        want = llm.generate({"prompt_token_ids": ids}, SamplingParams(
            temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)[0].outputs[0]
        assert tokens(msgs) == want.token_ids
        assert {m.request_id for m in msgs} == {"same"} and msgs[-1].served_by.disaggregated
    assert wait_for(lambda: all_free(cluster), timeout=15)


def test_initial_metadata_names_the_request_before_any_token(clusters):
    """An accepted Generate call sends `pdserve-request-id` first: the client's id
    (percent-encoded: metadata is ASCII), else the one the router made up, which every answer
    then carries; a refused call sends none, and the router goes on serving."""
    cluster = clusters("shm")
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def call(request_id, ids=list(range(4500, 4540))):
        return router(cluster).Generate(router_pb2.GenerateRequest(
            request_id=request_id, token_ids=router_pb2.TokenIds(ids=ids),
            sampling=sampling), timeout=60)

    for request_id, header in (("mine-1.a_b~", "mine-1.a_b~"), ("réq 1/😀", "r%C3%A9q%201%2F%F0%9F%98%80"),
                               ("", None)):
        answer = call(request_id)
        (sent,) = [v for k, v in answer.initial_metadata() if k == "pdserve-request-id"]
        assert sent == (header or sent) and len(sent) >= 4
        assert unquote(sent) == (request_id or sent)
        assert {m.request_id for m in answer} == {unquote(sent)}
    for request_id, ids in (("a\nforged log line", list(range(10))), ("x" * 10_000, [1, 2]),
                            ("ok", [-1])):
        bad = call(request_id, ids)
        with pytest.raises(grpc.RpcError) as e:
            list(bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "pdserve-request-id" not in dict(bad.initial_metadata() or ())
    assert tokens(list(call("after")))  # still serving


def test_list_instances(clusters):
    cluster = clusters("shm")
    listed = router(cluster).ListInstances(router_pb2.ListInstancesRequest(), timeout=5)
    by_id = {i.instance_id: i for i in listed.instances}
    assert set(by_id) == {"prefill-0", "decode-0"}
    assert by_id["decode-0"].address == cluster.child("decode-0").address
    assert by_id["prefill-0"].role == "prefill" and by_id["prefill-0"].block_size == 16


def test_truncation_and_logprob_token_ids_through_the_cluster(clusters, llm):
    """truncate_prompt_tokens is applied at the router (before routing) and logprob_token_ids
    reach the instances: the same as the colocated engine."""
    cluster = clusters("shm")
    ids = list(range(7000, 7060))
    msgs = generate(cluster, ids, max_tokens=4, ignore_eos=True, temperature=0,
                    truncate_prompt_tokens=24, logprob_token_ids=[11, 12])
    [want] = llm.generate({"prompt_token_ids": ids[-24:]}, SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, logprob_token_ids=[11, 12]),
        use_tqdm=False)
    assert tokens(msgs) == want.outputs[0].token_ids
    assert msgs[-1].usage.prompt_tokens == 24 and msgs[-1].served_by.disaggregated
    entries = [{e.token_id for e in p.entries} for m in msgs for p in m.logprobs]
    assert len(entries) == 4 and all({11, 12} <= e for e in entries)


# Last: the shm cluster serves every test above; in the slow run tcp and nixl start once each.
@pytest.mark.parametrize("connector", connectors("shm"))
def test_disaggregated_matches_colocated(clusters, llm, connector):
    cluster = clusters(connector)
    base = {"shm": 1000, "tcp": 2000, "nixl": 3000}[connector]  # fresh prompts: no cache hits
    for k, sampling in enumerate([{"temperature": 0}, {"temperature": 0.9, "seed": 5}]):
        ids = list(range(base + 100 * k, base + 100 * k + 40))
        msgs = generate(cluster, ids, max_tokens=12, ignore_eos=True, logprobs=1, **sampling)
        want = llm.generate({"prompt_token_ids": ids}, SamplingParams(
            max_tokens=12, ignore_eos=True, **sampling), use_tqdm=False)[0].outputs[0]
        assert tokens(msgs) == want.token_ids
        assert "".join(m.text for m in msgs) == want.text
        first, last = msgs[0], msgs[-1]
        assert list(first.token_ids) == [want.token_ids[0]]  # sent as soon as P answered
        assert list(first.prompt_token_ids) == ids
        assert sum(len(m.logprobs) for m in msgs) == 12
        assert all(m.logprobs[i].entries[0].token_id == t
                   for m in msgs for i, t in enumerate(m.token_ids))
        assert last.finish_reason == "length"
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (40, 12)
        served = last.served_by
        assert served.disaggregated and served.kv_connector == connector
        assert (served.prefill_instance, served.decode_instance) == ("prefill-0", "decode-0")
        assert served.prefill_attempts == 1
    assert wait_for(lambda: all_free(cluster), timeout=15)


# Last: it starts a cluster of its own.
def test_a_request_that_ends_on_the_prefill_side_keeps_its_text(clusters, llm, tiny_model_dir):
    """One token asked with stop strings set, a stop string inside the first token, and a
    prompt that leaves the instances (shorter context than the router's) room for one token:
    the prefill instance ends each, with the text, tokens and finish reason a colocated engine
    of that context gives (no decode side to send them)."""
    cluster = clusters("shm", "--max-model-len", "256")
    short = LLM(str(tiny_model_dir), kv_cache_memory_bytes=KV_BYTES, max_model_len=256)
    ids = list(range(4300, 4340))
    first = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1),
                         use_tqdm=False)[0].outputs[0].text
    inner = next(first[i:] for i in range(1, len(first)) if first[i] not in first[:i])
    full = list(range(1000, 1000 + 255))
    for prompt, sampling in ((ids, {"max_tokens": 1, "stop": ["zzz"]}),
                             (ids, {"max_tokens": 5, "stop": [inner]}),
                             (full, {"max_tokens": 16, "ignore_eos": True})):
        want = short.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0,
                                                                          **sampling),
                              use_tqdm=False)[0].outputs[0]
        msgs = generate(cluster, prompt, temperature=0, **sampling)
        assert tokens(msgs) == list(want.token_ids), sampling
        assert "".join(m.text for m in msgs) == want.text, sampling
        assert msgs[-1].finish_reason == want.finish_reason, sampling
        assert msgs[-1].served_by.disaggregated and not msgs[-1].served_by.decode_instance
    assert wait_for(lambda: all_free(cluster), timeout=15)
