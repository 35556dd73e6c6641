"""Fixtures for engine tests: pdserve engines and independent Hugging Face references."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def hf_tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir):
    from pdserve import LLM

    return LLM(str(tiny_model_dir), kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=48,
               max_num_seqs=8)


@pytest.fixture(scope="session")
def smollm2_llm():
    from pdserve import LLM

    return LLM("SmolLM2-135M-Instruct", kv_cache_memory_bytes=96 << 20)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_llm):
    """transformers' own Llama implementation holding the same (dequantized) weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pdserve.models.loader import load_state_dict

    resolved = smollm2_llm.llm_engine.config.model.resolved
    config = AutoConfig.from_pretrained(resolved.directory, gguf_file=resolved.gguf_file,
                                        local_files_only=True)
    config.tie_word_embeddings = True
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(load_state_dict(resolved, torch.float32), strict=False)
    model.tie_weights()
    return model.eval()
