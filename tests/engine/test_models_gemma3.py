"""Gemma 3 text-only (model_type gemma3_text): Gemma 2's layout without soft-capping, with
(1 + weight) RMSNorms over each query and key head, full attention on every third layer
here (sixth in released models) and a separate rotary embedding for the sliding layers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_reference import hf_greedy
from test_models_gemma2 import prefill_logits

from pdserve import LLM, SamplingParams
from pdserve.models.arch import ModelArch
from pdserve.models.loader import load_arch, resolve_model
from pdserve.models.tiny import write_tiny_llama

WINDOW = 8
PROMPTS = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog. " * 4,  # ~40 tokens: chunked prefill
    "x",
]


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    # 3 layers: sliding, sliding, full.
    return write_tiny_llama(tmp_path_factory.mktemp("gemma3"), architecture="Gemma3ForCausalLM",
                            num_hidden_layers=3, tie_word_embeddings=True,
                            sliding_window=WINDOW)


@pytest.fixture(scope="module")
def hf_gemma3(gemma3_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32).eval()


def test_gemma3_arch(gemma3_dir):
    arch = load_arch(resolve_model(str(gemma3_dir)))
    assert arch.architecture == "Gemma3ForCausalLM" and arch.is_gemma and arch.qk_norm
    assert arch.attn_logit_softcapping is None and arch.final_logit_softcapping is None
    assert [arch.layer_window(i) for i in range(3)] == [WINDOW, WINDOW, None]
    assert arch.rope_theta == 100000.0 and arch.rope_scaling_dict == {
        "factor": 4.0, "rope_type": "linear"}
    assert arch.local_rope_theta == 1000.0 and arch.local_rope_scaling is None


@pytest.mark.parametrize("n", [5, WINDOW + 1, 41])
def test_gemma3_logits_match_hf(gemma3_dir, hf_gemma3, n):
    ids = list(range(300, 300 + n))
    with torch.no_grad():
        want = hf_gemma3(torch.tensor([ids])).logits[0].float()
    got = prefill_logits(gemma3_dir, ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_gemma3_features_change_the_logits(gemma3_dir, hf_gemma3):
    """Without the window or the local rotary base the logits differ."""
    ids = list(range(300, 341))
    with torch.no_grad():
        want = hf_gemma3(torch.tensor([ids])).logits[0].float()
    arch = load_arch(resolve_model(str(gemma3_dir)))
    for change in (dict(sliding_window=None), dict(local_rope_theta=None),
                   dict(sliding_window=WINDOW - 1)):
        got = prefill_logits(gemma3_dir, ids, dataclasses.replace(arch, **change))
        assert (got - want).abs().max() > 1e-2, change


def test_gemma3_greedy_matches_hf(gemma3_dir, hf_gemma3):
    llm = LLM(str(gemma3_dir), kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=16)
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf_gemma3, tok.encode(prompt), 20), prompt


def test_gemma3_text_config_without_architectures():
    from transformers import Gemma3TextConfig

    arch = ModelArch.from_hf_config(Gemma3TextConfig(num_hidden_layers=6))
    assert arch.architecture == "Gemma3ForCausalLM"
    assert arch.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert arch.rope_theta == 1000000.0 and arch.local_rope_theta == 10000.0


def test_gemma3_bidirectional_is_refused():
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(num_hidden_layers=2)
    cfg.use_bidirectional_attention = True
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelArch.from_hf_config(cfg)


def test_gemma3_multimodal_is_refused(tmp_path):
    from pdserve.models.loader import resolve_model

    (tmp_path / "config.json").write_text(
        '{"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"}')
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration"):
        resolve_model(str(tmp_path))
