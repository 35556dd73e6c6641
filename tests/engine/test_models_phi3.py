"""Phi-3 (fused qkv_proj / gate_up_proj checkpoints) matches transformers."""

from __future__ import annotations

import pytest
import torch
from hf_reference import hf_greedy
from test_models_qwen3 import PROMPTS, prefill_logits

from pdserve import LLM, SamplingParams
from pdserve.models.arch import ModelArch
from pdserve.models.loader import load_arch, load_state_dict, resolve_model
from pdserve.models.tiny import write_tiny_llama


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("phi3"), architecture="Phi3ForCausalLM",
                            num_key_value_heads=2)


@pytest.fixture(scope="module")
def hf_phi3(phi3_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(phi3_dir, dtype=torch.float32).eval()


def test_phi3_checkpoint_is_fused_and_loads(phi3_dir):
    resolved = resolve_model(str(phi3_dir))
    arch = load_arch(resolved)
    assert arch.architecture == "Phi3ForCausalLM" and arch.rope_scaling is None
    sd = load_state_dict(resolved, torch.float32)
    assert "model.layers.0.self_attn.qkv_proj.weight" in sd
    assert "model.layers.0.mlp.gate_up_proj.weight" in sd
    assert "model.layers.0.self_attn.q_proj.weight" not in sd


def test_phi3_logits_match_hf(phi3_dir, hf_phi3):
    ids = list(range(300, 341))
    with torch.no_grad():
        want = hf_phi3(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(prefill_logits(phi3_dir, ids), want, atol=1e-4, rtol=1e-4)


def test_phi3_greedy_matches_hf(phi3_dir, hf_phi3):
    llm = LLM(str(phi3_dir), kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=48)
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf_phi3, tok.encode(prompt), 16), prompt


@pytest.mark.parametrize("kind", ["longrope", "su"])
def test_phi3_rope_scaling_is_refused(kind):
    from transformers import Phi3Config

    cfg = Phi3Config(num_hidden_layers=1, hidden_size=64, num_attention_heads=4)
    scaling = {"rope_type": kind, "type": kind, "short_factor": [1.0] * 8,
               "long_factor": [2.0] * 8, "rope_theta": 10000.0}
    if isinstance(getattr(cfg, "rope_parameters", None), dict):  # transformers >= 5
        cfg.rope_parameters = scaling
    else:
        cfg.rope_scaling = scaling
    with pytest.raises(ValueError, match="^rope_scaling: .*Phi3ForCausalLM"):
        ModelArch.from_hf_config(cfg)


def test_phi3_sliding_window_caps_context():
    from transformers import Phi3Config

    cfg = Phi3Config(num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
                     max_position_embeddings=4096, sliding_window=2047)
    assert ModelArch.from_hf_config(cfg).max_position_embeddings == 2047
