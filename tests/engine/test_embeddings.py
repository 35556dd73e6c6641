"""Embeddings (LLM.embed / LLM.encode, PoolingParams, POST /v1/embeddings) against
transformers on the tiny random model: the final hidden state (after the final norm) of the
last prompt token, L2-normalized by default."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from starlette.testclient import TestClient

from pdserve import EmbeddingRequestOutput, PoolingParams, PoolingRequestOutput, SamplingParams
from pdserve.engine.engine_args import EngineArgs
from pdserve.gateway.app import build_app
from pdserve.gateway.local_backend import LocalBackend

SHORT = "Hello world"
MEDIUM = "The quick brown fox jumps over the lazy dog near the river bank"
LONG = "Once upon a time in a land far away there lived a dragon who loved books. " * 6


@torch.no_grad()
def hf_last_hidden(model, ids: list[int]) -> torch.Tensor:
    out = model(torch.tensor([ids]), output_hidden_states=True)
    last = out.hidden_states[-1][0, -1]
    # transformers' Llama records its last hidden state after the final norm: the logits
    # are lm_head of it.
    assert torch.allclose(model.lm_head(last), out.logits[0, -1], atol=1e-4)
    return last.float()


def ids_of(llm, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text)


def test_embed_matches_hf_in_one_batch(tiny_llm, hf_tiny):
    prompts = [SHORT, LONG, MEDIUM, LONG, {"prompt_token_ids": ids_of(tiny_llm, MEDIUM)}]
    assert len(ids_of(tiny_llm, LONG)) > 48  # more than one chunk (max_num_batched_tokens)
    outs = tiny_llm.embed(prompts, use_tqdm=False)
    assert all(isinstance(o, EmbeddingRequestOutput) for o in outs)
    assert len({o.request_id for o in outs}) == len(prompts)
    for prompt, out in zip(prompts, outs):
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else ids_of(tiny_llm, prompt)
        assert out.finished and list(out.prompt_token_ids) == ids
        ref = torch.nn.functional.normalize(hf_last_hidden(hf_tiny, ids), dim=-1)
        got = torch.tensor(out.outputs.embedding)
        assert got.shape == ref.shape and out.outputs.hidden_size == ref.numel()
        assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()
        assert abs(got.norm().item() - 1.0) < 1e-4
    assert not tiny_llm.llm_engine.has_unfinished_requests()


def test_prefix_cache_hit_gives_the_same_embedding(tiny_llm, hf_tiny):
    [first] = tiny_llm.embed(LONG, use_tqdm=False)
    [again] = tiny_llm.embed(LONG, use_tqdm=False)
    assert again.num_cached_tokens > 0  # its prompt's full blocks came from the cache
    ref = torch.nn.functional.normalize(hf_last_hidden(hf_tiny, ids_of(tiny_llm, LONG)), dim=-1)
    for out in (first, again):
        assert torch.allclose(torch.tensor(out.outputs.embedding), ref, atol=1e-4)


def test_dimensions_and_normalize(tiny_llm, hf_tiny):
    raw = hf_last_hidden(hf_tiny, ids_of(tiny_llm, MEDIUM))
    [cut] = tiny_llm.embed(MEDIUM, PoolingParams(dimensions=8), use_tqdm=False)
    assert len(cut.outputs.embedding) == 8
    assert torch.allclose(torch.tensor(cut.outputs.embedding),
                          torch.nn.functional.normalize(raw[:8], dim=-1), atol=1e-4)
    [plain] = tiny_llm.embed(MEDIUM, PoolingParams(normalize=False), use_tqdm=False)
    assert torch.allclose(torch.tensor(plain.outputs.embedding), raw, atol=1e-4)
    [full] = tiny_llm.embed(MEDIUM, PoolingParams(dimensions=raw.numel()), use_tqdm=False)
    assert len(full.outputs.embedding) == raw.numel()


def test_encode_returns_tensors(tiny_llm, hf_tiny):
    outs = tiny_llm.encode([SHORT, MEDIUM], use_tqdm=False)
    for text, out in zip([SHORT, MEDIUM], outs):
        assert isinstance(out, PoolingRequestOutput) and isinstance(out.outputs.data,
                                                                     torch.Tensor)
        ref = torch.nn.functional.normalize(hf_last_hidden(hf_tiny, ids_of(tiny_llm, text)),
                                            dim=-1)
        assert torch.allclose(out.outputs.data, ref, atol=1e-4)


def test_truncate_prompt_tokens(tiny_llm, hf_tiny):
    ids = ids_of(tiny_llm, LONG)
    [out] = tiny_llm.embed(LONG, PoolingParams(truncate_prompt_tokens=5), use_tqdm=False)
    assert list(out.prompt_token_ids) == ids[-5:]
    ref = torch.nn.functional.normalize(hf_last_hidden(hf_tiny, ids[-5:]), dim=-1)
    assert torch.allclose(torch.tensor(out.outputs.embedding), ref, atol=1e-4)


@pytest.mark.parametrize("kwargs, field", [
    ({"dimensions": 0}, "dimensions"), ({"dimensions": "8"}, "dimensions"),
    ({"normalize": "yes"}, "normalize"), ({"truncate_prompt_tokens": 0},
                                          "truncate_prompt_tokens")])
def test_pooling_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PoolingParams(**kwargs)


def test_bad_requests_raise(tiny_llm):
    hidden = tiny_llm.llm_engine.config.model.arch.hidden_size
    with pytest.raises(ValueError, match="dimensions"):
        tiny_llm.embed(SHORT, PoolingParams(dimensions=hidden + 1), use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_params"):
        tiny_llm.embed([SHORT, MEDIUM], [PoolingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        tiny_llm.embed("", use_tqdm=False)
    assert not tiny_llm.llm_engine.has_unfinished_requests()


def test_mixed_batch_leaves_generation_unchanged(tiny_llm, hf_tiny):
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    gen_prompts = [SHORT, LONG]
    alone = [o.outputs[0].token_ids for o in tiny_llm.generate(gen_prompts, greedy,
                                                               use_tqdm=False)]
    engine = tiny_llm.llm_engine
    free_before = engine.num_free_blocks
    gen_ids = []
    for i, p in enumerate(gen_prompts):
        gen_ids.append(engine.add_request(f"mix-gen-{i}", p, greedy.clone()))
        engine.add_request(f"mix-emb-{i}", [MEDIUM, LONG][i], PoolingParams())
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert [done[r].outputs[0].token_ids for r in gen_ids] == alone
    for i, text in enumerate([MEDIUM, LONG]):
        out = done[f"mix-emb-{i}"]
        assert isinstance(out, PoolingRequestOutput)
        ref = torch.nn.functional.normalize(hf_last_hidden(hf_tiny, ids_of(tiny_llm, text)),
                                            dim=-1)
        assert torch.allclose(out.outputs.data, ref, atol=1e-4)
    assert engine.num_free_blocks == free_before  # every block back (cached ones evictable)


# --- HTTP: POST /v1/embeddings ----------------------------------------------------------------

@pytest.fixture(scope="module")
def client(tiny_model_dir):
    backend = LocalBackend.from_engine_args(EngineArgs(
        model=str(tiny_model_dir), kv_cache_memory_bytes=8 << 20, served_model_name="tiny"))
    with TestClient(build_app(backend, "tiny")) as c:
        yield c


def test_http_embeddings_float_and_base64(client, tiny_model_dir, hf_tiny, tiny_llm):
    r = client.post("/v1/embeddings", json={"model": "tiny", "input": [SHORT, LONG]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "tiny"
    ids = [ids_of(tiny_llm, SHORT), ids_of(tiny_llm, LONG)]
    n = sum(map(len, ids))
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}
    assert [d["index"] for d in body["data"]] == [0, 1]
    for d, toks in zip(body["data"], ids):
        assert d["object"] == "embedding"
        ref = torch.nn.functional.normalize(hf_last_hidden(hf_tiny, toks), dim=-1)
        assert torch.allclose(torch.tensor(d["embedding"]), ref, atol=1e-4)
    r = client.post("/v1/embeddings", json={"input": ids[1], "encoding_format": "base64",
                                            "dimensions": 16, "user": "u"})
    assert r.status_code == 200, r.text
    [d] = r.json()["data"]
    vec = np.frombuffer(base64.b64decode(d["embedding"]), dtype=np.float32)
    ref = torch.nn.functional.normalize(hf_last_hidden(hf_tiny, ids[1])[:16], dim=-1)
    assert vec.shape == (16,) and np.allclose(vec, ref.numpy(), atol=1e-4)
    r = client.post("/v1/embeddings", json={"input": [ids[0], ids[1]]})
    assert r.status_code == 200 and len(r.json()["data"]) == 2


def test_http_embeddings_normalize_and_truncate(client, hf_tiny, tiny_llm):
    """vLLM's extra fields: the raw last hidden state of the prompt's last 5 tokens."""
    ids = ids_of(tiny_llm, LONG)
    r = client.post("/v1/embeddings", json={"input": LONG, "normalize": False,
                                            "truncate_prompt_tokens": 5})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 5  # the tokens embedded
    ref = hf_last_hidden(hf_tiny, ids[-5:])
    assert torch.allclose(torch.tensor(r.json()["data"][0]["embedding"]), ref, atol=1e-4)


@pytest.mark.parametrize("body, param", [
    ({"input": SHORT, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": SHORT, "truncate_prompt_tokens": 10 ** 7}, "truncate_prompt_tokens"),
    ({"input": SHORT, "dimensions": 0}, "dimensions"),
    ({"input": SHORT, "dimensions": 100000}, "dimensions"),
    ({"input": []}, "input"),
    ({"input": SHORT, "encoding_format": "hex"}, "encoding_format"),
    ({"input": [10 ** 9]}, "input"),
])
def test_http_embeddings_bad_input(client, body, param):
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_openapi_documents_embeddings(client):
    doc = client.get("/openapi.json").json()
    ref = doc["paths"]["/v1/embeddings"]["post"]["requestBody"]["content"]
    assert ref["application/json"]["schema"]["$ref"].endswith("/EmbeddingRequest")
