"""`LLM.generate` on the GPU: the engine picks CUDA and the Triton kernels by itself, and its
greedy output equals transformers' on the same GPU."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.kernels import dispatch

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "The quick brown fox jumps over the lazy dog. " * 12,
    "1 2 3 4 5",
    "In a shocking finding, scientists discovered a herd of unicorns living in a remote valley",
    "def fibonacci(n):",
    "Write a short poem about the sea.",
    "x",
]
NEW_TOKENS = 32
KV_BYTES = 512 << 20


@pytest.fixture(scope="module")
def kernel_calls():
    """Counts the calls that reach the Triton paged attention through the dispatcher."""
    calls = []
    real = dispatch.triton_kernels().paged_attention
    dispatch.triton_kernels().paged_attention = lambda *a: calls.append(1) or real(*a)
    yield calls
    dispatch.triton_kernels().paged_attention = real


@pytest.fixture(scope="module")
def llm_fp32():
    return LLM(dtype="float32", kv_cache_memory_bytes=KV_BYTES)


@torch.inference_mode()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """n argmax tokens of transformers' forward pass (with its KV cache) and no logits
    processor: generate's `min_new_tokens` would forbid EOS, which `ignore_eos` allows."""
    x, past, out = torch.tensor([ids], device="cuda"), None, []
    for _ in range(n):
        step = model(input_ids=x, past_key_values=past, use_cache=True)
        past, token = step.past_key_values, int(step.logits[0, -1].argmax())
        out.append(token)
        x = torch.tensor([[token]], device="cuda")
    return out


@torch.inference_mode()
def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """Teacher-forced log_softmax at every position: (len(ids), V), float32."""
    logits = model(torch.tensor([ids], device="cuda")).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_greedy_equal_up_to_a_tie(model, ids: list[int], got: list[int], want: list[int],
                                    tie_nats: float = 1e-3) -> None:
    """got == want, or they agree up to a position where transformers' two candidates are a
    tie (log-probabilities within `tie_nats`): there float32 rounding may pick either, and the
    sequences legitimately part."""
    if got == want:
        return
    i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
    logp = hf_logprobs(model, ids + want[:i])[-1]
    gap = abs(float(logp[got[i]] - logp[want[i]]))
    assert gap < tie_nats, f"token {i}: {got[i]} vs {want[i]}, {gap:.2e} nats apart"


def test_engine_runs_on_cuda_with_triton(llm_fp32, kernel_calls):
    config = llm_fp32.llm_engine.config
    assert config.device.device == "cuda"
    assert all(p.is_cuda for p in llm_fp32.llm_engine.model.parameters())
    assert llm_fp32.llm_engine.runner.kv_cache.is_cuda
    n = len(kernel_calls)
    llm_fp32.generate("Hi", SamplingParams(max_tokens=3), use_tqdm=False)
    layers = config.model.arch.num_hidden_layers
    assert len(kernel_calls) - n == 3 * layers  # one prefill step and two decode steps


def test_default_dtype_on_cuda_is_16_bit():
    llm = LLM(kv_cache_memory_bytes=64 << 20)
    assert llm.llm_engine.config.model.dtype in (torch.bfloat16, torch.float16)
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.text.strip()


def test_float32_greedy_equals_transformers(llm_fp32, hf_smollm2_cuda):
    tok = llm_fp32.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm_fp32.generate(PROMPTS, params, use_tqdm=False)  # one batch, mixed lengths
    exact = 0
    for prompt, out in zip(PROMPTS, outputs):
        ids, got = tok.encode(prompt), out.outputs[0].token_ids
        want = hf_greedy(hf_smollm2_cuda, ids, NEW_TOKENS)
        assert_greedy_equal_up_to_a_tie(hf_smollm2_cuda, ids, got, want)
        exact += got == want
    assert exact >= len(PROMPTS) - 2  # a tie is rare: most prompts match to the last token


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_greedy_tokens_are_near_transformers_best(dtype, hf_smollm2_cuda):
    """16-bit rounding may flip near-ties, so exact equality is not expected; each greedy
    token must be one that transformers (float32, teacher-forced on pdserve's own output)
    ranks within 1 nat of its best."""
    llm = LLM(dtype=dtype, kv_cache_memory_bytes=KV_BYTES)
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False)):
        ids, new = tok.encode(prompt), out.outputs[0].token_ids
        logp = hf_logprobs(hf_smollm2_cuda, ids + new)[len(ids) - 1:-1]  # (NEW_TOKENS, V)
        chosen = logp.gather(1, torch.tensor(new, device="cuda")[:, None])[:, 0]
        gap = (logp.max(dim=1).values - chosen).max().item()
        assert gap < 1.0, (prompt, gap)
    del llm
