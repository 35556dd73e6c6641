"""Greedy outputs are token-identical to transformers' generate."""

import pytest
from hf_reference import hf_greedy

from pdserve import SamplingParams, TokensPrompt

PROMPTS = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "1 2 3",
    "In a shocking finding, scientists discovered a herd of unicorns living in a remote valley",
    "x",
]


def test_tiny_batch_with_chunked_prefill_matches_hf(tiny_llm, hf_tiny):
    # max_num_batched_tokens=48 splits the long prompt and mixes prefills with decodes.
    tok = tiny_llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outputs = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
    assert len(tok.encode(PROMPTS[1])) > 48
    for prompt, out in zip(PROMPTS, outputs):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(hf_tiny, ids, 20), prompt
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids,
                                                 skip_special_tokens=True)


def test_token_prompts_and_per_prompt_params(tiny_llm, hf_tiny):
    ids = [[5, 6, 7, 8, 9], list(range(100, 140))]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9)]
    outputs = tiny_llm.generate([TokensPrompt(prompt_token_ids=i) for i in ids], params,
                                use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 9]
    for prompt_ids, out in zip(ids, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf_tiny, prompt_ids, len(
            out.outputs[0].token_ids))


def test_qwen2_with_qkv_bias_matches_hf(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from pdserve import LLM
    from pdserve.models.tiny import write_tiny_llama

    path = write_tiny_llama(tmp_path / "qwen", architecture="Qwen2ForCausalLM",
                            attention_bias=True, tie_word_embeddings=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), kv_cache_memory_bytes=4 << 20)
    tok = llm.get_tokenizer()
    outputs = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=10,
                                                       ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf, tok.encode(prompt), 10)


@pytest.mark.parametrize("prompt", ["The capital of France is", "def fibonacci(n):"])
def test_smollm2_matches_hf(smollm2_llm, hf_smollm2, prompt):
    tok = smollm2_llm.get_tokenizer()
    [out] = smollm2_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24,
                                                        ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(hf_smollm2, tok.encode(prompt), 24)


def test_smollm2_batch_on_coded_weights_matches_hf(smollm2_llm, hf_smollm2):
    """The bundled GGUF is Q4_1 with a Q8_0 embedding: every projection and the tied LM head
    hold coded weights (kernels/coded_weights.py), which serve steps of a few rows."""
    model = smollm2_llm.llm_engine.runner.model
    layers = model.native_layers
    assert layers is not None and layers.shape.coded_max_rows > 0
    assert all(getattr(w, f"{p}_codes") for w in layers.weights
               for p in ("qkv", "o", "gate_up", "down"))
    assert model.lm_head.codes is not None
    tok = smollm2_llm.get_tokenizer()
    outs = smollm2_llm.generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=16,
                                                            ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_smollm2, tok.encode(prompt), 16), prompt


def test_smollm2_chat_answers(smollm2_llm):
    [out] = smollm2_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                             SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended on <|im_end|>
