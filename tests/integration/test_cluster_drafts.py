"""N-gram drafts on the instances of a real 1P1D cluster (router, prefill and decode
processes): greedy output through the router equals a colocated engine's without drafts, and
the gateway's /metrics sums the instances' draft counters, as vLLM names them."""

from __future__ import annotations

import re
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from pdserve import LLM, SamplingParams, StructuredOutputsParams, TokensPrompt
from pdserve.cluster import Cluster, ClusterSpec
from pdserve.gateway.app import build_app
from pdserve.gateway.router_backend import RouterBackend

DRAFTS = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
THRESHOLD = 8  # prompts of 8+ uncached tokens are prefilled on the prefill instance
WAIT_S = 15
NAMES = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
         "spec_decode_num_accepted_tokens")


@pytest.fixture(scope="module")
def cluster(copying_model_dir):
    spec = ClusterSpec(model=str(copying_model_dir), connector="shm", grpc_port=0,
                       disagg_threshold=THRESHOLD, kv_cache_memory_bytes=8 << 20,
                       startup_timeout_s=90, instance_args=("--speculative-config", DRAFTS))
    with Cluster(spec) as c:
        yield c


def samples(client) -> dict[str, float]:
    """One scrape of the gateway's /metrics: sample name -> value."""
    return {s.name: s.value for f in text_string_to_metric_families(client.get("/metrics").text)
            for s in f.samples}


def metric(client, name: str) -> float | None:
    """The value of the gateway's `pdserve:<name>` sample, or None when it shows none."""
    return samples(client).get(f"pdserve:{name}")


def wait_for(read):
    """read()'s first truthy value within WAIT_S (the router has the instances' counters from
    their next heartbeats), else its last."""
    deadline = time.monotonic() + WAIT_S
    while not (value := read()) and time.monotonic() < deadline:
        time.sleep(0.3)
    return value


def settled(read, pause_s: float = 2.5):
    """read()'s value once two reads `pause_s` apart agree (the router hears the instances'
    counters with their heartbeats, every second), within WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    last = read()
    while time.monotonic() < deadline:
        time.sleep(pause_s)
        if (now := read()) == last:
            return now
        last = now
    return last


def draft_counters(client) -> tuple[float, ...] | None:
    """The gateway's three draft counters from one scrape (three scrapes could straddle a
    heartbeat), or None when it shows none."""
    values = samples(client)
    counts = tuple(values.get(f"pdserve:{name}_total") for name in NAMES)
    return None if None in counts else counts


def test_drafting_instances_give_colocated_tokens_and_count_their_drafts(cluster,
                                                                         copying_model_dir):
    """Greedy, seeded sampled and constrained requests, disaggregated and not."""
    llm = LLM(str(copying_model_dir), kv_cache_memory_bytes=8 << 20)  # no drafts
    backend = RouterBackend(cluster.router_address, str(copying_model_dir))
    regex = "(cat |dog ){5}"
    cases = [({"temperature": 0}, {}), ({"temperature": 2.0, "top_k": 3, "seed": 7}, {}),
             ({"temperature": 0}, {"structured_outputs": StructuredOutputsParams(regex=regex)})]
    with TestClient(build_app(backend, "copy")) as client:
        assert draft_counters(client) == (0, 0, 0)  # shown: the instances draft
        for prompt in ([5, 6, 7, 5, 6, 7, 5, 6, 9], [11, 12]):  # disaggregated, decode only
            for sampling, constraint in cases:
                want = llm.generate(TokensPrompt(prompt_token_ids=prompt), SamplingParams(
                    max_tokens=16, ignore_eos=not constraint, **sampling, **constraint),
                    use_tqdm=False)[0].outputs[0].text
                r = client.post("/v1/completions", json={
                    "model": "copy", "prompt": prompt, "max_tokens": 16,
                    "ignore_eos": not constraint, **sampling,
                    **({"structured_outputs": {"regex": regex}} if constraint else {})})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == want, (sampling, constraint)
                assert not constraint or re.fullmatch(regex, want)
            if len(prompt) >= THRESHOLD:  # its KV came from the prefill instance
                assert wait_for(lambda: metric(client, "kv_transfer_bytes_total"))
        counts = wait_for(lambda: [c for c in [draft_counters(client)] if c and c[0] > 0])
        assert counts, f"no drafts counted in {WAIT_S} s"
        drafts, tokens, kept = settled(lambda: draft_counters(client))  # every heartbeat in
    assert drafts > 0 and drafts <= tokens <= 3 * drafts and 0 < kept <= tokens


def test_logprobs_through_drafting_instances_are_colocated_ones(cluster, copying_model_dir):
    """Requests asking for logprobs draft on the decode instance too, and the gateway gives
    a logprob for every token, those of a colocated engine without drafts."""
    llm = LLM(str(copying_model_dir), kv_cache_memory_bytes=8 << 20)  # no drafts
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    backend = RouterBackend(cluster.router_address, str(copying_model_dir))
    with TestClient(build_app(backend, "copy")) as client:
        before = settled(lambda: draft_counters(client))
        for prompt in ([5, 6, 7, 5, 6, 7, 5, 6, 9, 4], [13, 14, 15]):  # prefilled remotely, not
            [want] = llm.generate(TokensPrompt(prompt_token_ids=prompt), params,
                                  use_tqdm=False)
            w = want.outputs[0]
            r = client.post("/v1/completions", json={
                "model": "copy", "prompt": prompt, "max_tokens": 16, "temperature": 0,
                "ignore_eos": True, "logprobs": 2})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["text"] == w.text
            got = choice["logprobs"]["token_logprobs"]
            assert got == pytest.approx([e[t].logprob for t, e in zip(w.token_ids, w.logprobs)],
                                        abs=1e-4)
            tops = choice["logprobs"]["top_logprobs"]
            assert len(tops) == 16 and all(len(top) >= 2 for top in tops)
        after = wait_for(lambda: [c for c in [draft_counters(client)]
                                  if c and c[2] > before[2]])
    assert after, f"no kept drafts counted in {WAIT_S} s"
