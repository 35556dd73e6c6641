"""Structured outputs over gRPC through a real 1P1D cluster, over shm (over each KV connector
with PDSERVE_SLOW_TESTS=1: the grammar is the subject here, not the connector): the prefill
instance samples the first token under the grammar, the decode instance's matcher accepts it
and continues. The tiny random model keeps to the constraint only because it must, and its
disaggregated output equals the colocated one token for token."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import pytest
from connectors import connectors

from pdserve import LLM, SamplingParams
from pdserve.cluster import Cluster, ClusterSpec
from pdserve.proto.pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

PROMPT = list(range(6000, 6040))
SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "tag": {"enum": ["alpha", "beta", "gamma"]},
    "ok": {"type": "boolean"}}, "required": ["id", "tag", "ok"]}
CONSTRAINTS = {
    "json": (common_pb2.StructuredOutputs(json=json.dumps(SCHEMA), disable_any_whitespace=True),
             {"json": SCHEMA, "disable_any_whitespace": True},
             lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    "regex": (common_pb2.StructuredOutputs(regex=r"[a-z]{2,5}-\d{2}"),
              {"regex": r"[a-z]{2,5}-\d{2}"},
              lambda t: re.fullmatch(r"[a-z]{2,5}-\d{2}", t) or 1 / 0),
    "choice": (common_pb2.StructuredOutputs(choice=common_pb2.ChoiceList(
        choices=["north", "south", "east west"])), {"choice": ["north", "south", "east west"]},
        lambda t: t in ("north", "south", "east west") or 1 / 0),
}
SAMPLINGS = {"greedy": dict(temperature=0), "seeded": dict(temperature=1.0, seed=42)}


@pytest.fixture(scope="module", params=connectors("shm"))
def cluster(request, tiny_model_dir, tmp_path_factory):
    spec = ClusterSpec(model=str(tiny_model_dir), connector=request.param, grpc_port=0,
                       disagg_threshold=16, kv_cache_memory_bytes=8 << 20,
                       startup_timeout_s=90,
                       log_dir=str(tmp_path_factory.mktemp(f"so-{request.param}")))
    with Cluster(spec) as c:
        yield c


@pytest.fixture(scope="module")
def colocated(tiny_model_dir):
    return LLM(str(tiny_model_dir), kv_cache_memory_bytes=8 << 20)


def prompt_for(kind: str, sampling: str) -> list[int]:
    """A prompt of its own per case: a cached prefix would make the router skip the prefill
    instance."""
    i = list(CONSTRAINTS).index(kind) * len(SAMPLINGS) + list(SAMPLINGS).index(sampling)
    return [t + 100 * i for t in PROMPT]


def generate(cluster, structured, prompt=PROMPT, **sampling):
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router_address))
    request = router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(max_tokens=60, structured_outputs=structured,
                                           **sampling))
    msgs = list(stub.Generate(request, timeout=60))
    return [t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs), msgs[-1]


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("kind", CONSTRAINTS)
def test_disaggregated_constrained_output(cluster, colocated, kind, sampling):
    structured, offline, check = CONSTRAINTS[kind]
    prompt = prompt_for(kind, sampling)
    tokens, text, last = generate(cluster, structured, prompt, **SAMPLINGS[sampling])
    assert last.served_by.disaggregated and last.finish_reason == "stop"
    check(text)
    [want] = colocated.generate({"prompt_token_ids": prompt}, SamplingParams(
        max_tokens=60, structured_outputs=offline, **SAMPLINGS[sampling]), use_tqdm=False)
    assert tokens == want.outputs[0].token_ids and text == want.outputs[0].text


def test_malformed_constraint_is_invalid_argument(cluster):
    with pytest.raises(grpc.RpcError) as e:
        generate(cluster, common_pb2.StructuredOutputs(regex="(open"), temperature=0)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_outputs.regex" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        generate(cluster, common_pb2.StructuredOutputs(), temperature=0)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    tokens, text, _ = generate(cluster, CONSTRAINTS["regex"][0], temperature=0)  # still serving
    CONSTRAINTS["regex"][2](text)


@pytest.mark.parametrize("structured, sampling", [
    (common_pb2.StructuredOutputs(grammar='root ::= root "a"'), {}),  # accepts no text
    (common_pb2.StructuredOutputs(choice=common_pb2.ChoiceList(choices=["a"])),
     {"min_tokens": 10}),  # after "a" only the end, which min_tokens bans
])
def test_a_constraint_no_output_can_satisfy_is_invalid_argument(cluster, structured, sampling):
    """The request's own fault, wherever it shows (on P's first token or mid-stream on D):
    INVALID_ARGUMENT naming structured_outputs, and the cluster serves on."""
    with pytest.raises(grpc.RpcError) as e:
        generate(cluster, structured, temperature=0, **sampling)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_outputs" in e.value.details()
    tokens, text, _ = generate(cluster, CONSTRAINTS["regex"][0], temperature=0)
    CONSTRAINTS["regex"][2](text)
