"""Qwen3 (q/k RMSNorm per head, explicit head_dim, no q/k/v bias) matches transformers."""

from __future__ import annotations

import pytest
import torch
from hf_reference import hf_greedy

from pdserve import LLM, SamplingParams
from pdserve.kernels.attention import AttentionMetadata, PrefillSpan
from pdserve.models.llama import LlamaForCausalLM
from pdserve.models.loader import load_arch, load_state_dict, resolve_model
from pdserve.models.tiny import write_tiny_llama

PROMPTS = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog. " * 6,  # > 48 tokens: chunked prefill
    "1 2 3",
    "x",
]


def prefill_logits(path, token_ids: list[int]) -> torch.Tensor:
    """pdserve's logits at every position of one prompt, in one prefill: (n, vocab)."""
    resolved = resolve_model(str(path))
    arch = load_arch(resolved)
    model = LlamaForCausalLM(arch).eval()
    model.load_weights(load_state_dict(resolved, torch.float32))
    n, block = len(token_ids), 16
    blocks = -(-n // block)
    cache = torch.zeros(arch.num_hidden_layers, 2, blocks, block, arch.num_key_value_heads,
                        arch.head_dim)
    empty = torch.zeros(0, dtype=torch.long)
    meta = AttentionMetadata(torch.arange(n), empty, torch.zeros(0, 1, dtype=torch.long), empty,
                             [PrefillSpan(0, n, n, torch.arange(blocks))])
    with torch.no_grad():
        hidden = model(torch.tensor(token_ids), torch.arange(n), cache, meta)
        return model.compute_logits(hidden)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    # head_dim 32 with hidden 64 and 4 heads: q/o projections are not square.
    return write_tiny_llama(tmp_path_factory.mktemp("qwen3"), architecture="Qwen3ForCausalLM",
                            head_dim=32, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def hf_qwen3(qwen3_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()


def test_qwen3_arch(qwen3_dir):
    arch = load_arch(resolve_model(str(qwen3_dir)))
    assert arch.architecture == "Qwen3ForCausalLM"
    assert arch.qk_norm and not arch.attention_bias
    assert arch.head_dim == 32 != arch.hidden_size // arch.num_attention_heads


def test_qwen3_logits_match_hf(qwen3_dir, hf_qwen3):
    ids = list(range(200, 237))
    with torch.no_grad():
        want = hf_qwen3(torch.tensor([ids])).logits[0].float()
    got = prefill_logits(qwen3_dir, ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_qwen3_greedy_matches_hf(qwen3_dir, hf_qwen3):
    llm = LLM(str(qwen3_dir), kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=48)
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf_qwen3, tok.encode(prompt), 16), prompt


def test_qwen3_sliding_window_is_refused():
    from transformers import Qwen3Config

    from pdserve.models.arch import ModelArch

    cfg = Qwen3Config(num_hidden_layers=2, max_window_layers=1, use_sliding_window=True,
                      sliding_window=16)
    with pytest.raises(ValueError, match="sliding"):
        ModelArch.from_hf_config(cfg)
