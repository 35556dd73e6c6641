"""Gemma 2 (scaled embeddings, (1 + weight) RMSNorms, four norms per layer, GELU-tanh MLP,
soft-capped attention scores and logits, sliding-window attention on alternate layers)
matches transformers, with a window small enough that prompts and generations cross it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_reference import hf_greedy

from pdserve import LLM, SamplingParams
from pdserve.kernels.attention import AttentionMetadata, PrefillSpan
from pdserve.models.arch import ModelArch
from pdserve.models.llama import LlamaForCausalLM
from pdserve.models.loader import load_arch, load_state_dict, resolve_model
from pdserve.models.tiny import write_tiny_llama

WINDOW = 8
PROMPTS = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog. " * 4,  # ~40 tokens: chunked prefill
    "1 2 3",
    "x",
]


def prefill_logits(path, token_ids: list[int], arch: ModelArch | None = None) -> torch.Tensor:
    """pdserve's logits at every position of one prompt, in one prefill: (n, vocab)."""
    resolved = resolve_model(str(path))
    arch = arch or load_arch(resolved)
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
def gemma2_dir(tmp_path_factory):
    # 3 layers: sliding, full, sliding.
    return write_tiny_llama(tmp_path_factory.mktemp("gemma2"), architecture="Gemma2ForCausalLM",
                            num_hidden_layers=3, tie_word_embeddings=True,
                            sliding_window=WINDOW)


@pytest.fixture(scope="module")
def hf_gemma2(gemma2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gemma2_dir, dtype=torch.float32).eval()


def test_gemma2_arch(gemma2_dir):
    arch = load_arch(resolve_model(str(gemma2_dir)))
    assert arch.architecture == "Gemma2ForCausalLM" and arch.is_gemma
    assert arch.hidden_act == "gelu_pytorch_tanh"
    assert arch.attn_logit_softcapping == 2.0 and arch.final_logit_softcapping == 5.0
    assert arch.query_pre_attn_scalar == arch.head_dim + 8
    assert [arch.layer_window(i) for i in range(3)] == [WINDOW, None, WINDOW]


@pytest.mark.parametrize("n", [5, WINDOW, WINDOW + 1, 41])
def test_gemma2_logits_match_hf(gemma2_dir, hf_gemma2, n):
    ids = list(range(300, 300 + n))
    with torch.no_grad():
        want = hf_gemma2(torch.tensor([ids])).logits[0].float()
    got = prefill_logits(gemma2_dir, ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_gemma2_features_change_the_logits(gemma2_dir, hf_gemma2):
    """Without the window or the soft-caps the logits differ: the comparison above sees them."""
    ids = list(range(300, 341))
    with torch.no_grad():
        want = hf_gemma2(torch.tensor([ids])).logits[0].float()
    arch = load_arch(resolve_model(str(gemma2_dir)))
    for change in (dict(sliding_window=None), dict(attn_logit_softcapping=None),
                   dict(final_logit_softcapping=None), dict(sliding_window=WINDOW + 1)):
        got = prefill_logits(gemma2_dir, ids, dataclasses.replace(arch, **change))
        assert (got - want).abs().max() > 1e-2, change


def test_gemma2_greedy_matches_hf(gemma2_dir, hf_gemma2):
    # 16-token chunks: the long prompt is prefilled in several steps, each chunk's keys read
    # back from the cache; 24 new tokens decode well past the window.
    llm = LLM(str(gemma2_dir), kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=16)
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert len(tok.encode(PROMPTS[1])) > 32
    for prompt, out in zip(PROMPTS, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf_gemma2, tok.encode(prompt), 24), prompt


def test_gemma2_config_without_architectures():
    from transformers import Gemma2Config

    arch = ModelArch.from_hf_config(Gemma2Config(num_hidden_layers=2))  # model_type only
    assert arch.architecture == "Gemma2ForCausalLM"
    assert arch.layer_types == ("sliding_attention", "full_attention")
    assert arch.sliding_window == 4096 and arch.query_pre_attn_scalar == 256


@pytest.mark.parametrize("change, field", [
    (dict(hidden_activation="relu"), "hidden_activation"),
    (dict(layer_types=["chunked_attention", "full_attention"]), "layer_types"),
])
def test_gemma2_unsupported_variants_are_refused(change, field):
    from transformers import Gemma2Config

    cfg = Gemma2Config(num_hidden_layers=2)
    for key, value in change.items():
        setattr(cfg, key, value)
    with pytest.raises(ValueError, match=field):
        ModelArch.from_hf_config(cfg)

