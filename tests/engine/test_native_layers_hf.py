"""Greedy generation through the decoder's native layer loop (kernels/cpu_layers.py) equals
transformers', for Llama and for Qwen2's qkv bias: the tiny test models elsewhere have head
size 16, which the loop does not serve, so these use head size 64."""

import pytest
import torch
from hf_reference import hf_greedy
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve import LLM, SamplingParams, TokensPrompt
from pdserve.kernels import native
from pdserve.models.tiny import write_tiny_llama


def assert_greedy_matches_transformers(llm, path, prompts, max_tokens=12):
    """`max_tokens` greedy tokens per prompt from `llm` equal transformers' in float32, loaded
    from `path`."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, max_tokens)


@pytest.mark.skipif(native.load() is None, reason="native kernels not built")
@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_engine_matches_transformers_through_native_layers(tmp_path, architecture):
    path = write_tiny_llama(tmp_path / "m", architecture=architecture, hidden_size=128,
                            num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
                            head_dim=64, attention_bias=architecture == "Qwen2ForCausalLM")
    llm = LLM(model=str(path), kv_cache_memory_bytes=1 << 24, max_num_batched_tokens=48)
    assert llm.llm_engine.runner.model.native_layers is not None
    assert_greedy_matches_transformers(llm, path, [[5 + (11 * i + 3 * j) % 900 for j in
                                                    range(9 + 23 * i)] for i in range(4)])


@pytest.mark.skipif(native.load() is None, reason="native kernels not built")
def test_bfloat16_checkpoint_in_float32_matches_transformers(tmp_path):
    """A bf16 checkpoint served in float32 (the CPU default): its projections are held as
    bfloat16 (kernels/coded_weights.py), and greedy output still equals transformers' in
    float32 on the same checkpoint."""
    fp32 = write_tiny_llama(tmp_path / "fp32", hidden_size=128, num_attention_heads=2,
                            num_key_value_heads=1, num_hidden_layers=2, head_dim=64)
    path = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(fp32, dtype=torch.bfloat16).save_pretrained(path)
    AutoTokenizer.from_pretrained(fp32).save_pretrained(path)
    llm = LLM(model=str(path), kv_cache_memory_bytes=1 << 24, max_num_batched_tokens=48)
    model = llm.llm_engine.runner.model
    assert model.native_layers is not None
    assert all(w.qkv_codes and w.down_codes and not w.qkv_params
               for w in model.native_layers.weights)  # bfloat16 codes: no params
    assert_greedy_matches_transformers(llm, path, [[5 + (7 * i + 5 * j) % 900 for j in
                                                    range(6 + 19 * i)] for i in range(3)])


@pytest.mark.skipif(native.load() is None, reason="native kernels not built")
def test_prompt_logprobs_over_chunks_match_transformers(tmp_path):
    """The native loop's last layer runs only for the rows a step uses: with a 100-token prompt
    in chunks of up to 48 tokens beside a request without prompt logprobs, every prompt
    logprob (rows spread over three steps) still equals transformers' log-softmax."""
    from hf_reference import hf_logprobs

    path = write_tiny_llama(tmp_path / "m", hidden_size=128, num_attention_heads=2,
                            num_key_value_heads=1, num_hidden_layers=2, head_dim=64)
    llm = LLM(model=str(path), kv_cache_memory_bytes=1 << 24, max_num_batched_tokens=48)
    assert llm.llm_engine.runner.model.native_layers is not None
    prompts = [[5 + (13 * j) % 900 for j in range(100)], [7 + (3 * j) % 900 for j in range(30)]]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                        prompt_logprobs=1),
                         SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf_logprobs(hf, prompts[0])
    got = outs[0].prompt_logprobs
    assert got[0] is None and len(got) == len(prompts[0])
    for pos in range(1, len(prompts[0])):
        tid = prompts[0][pos]
        assert abs(got[pos][tid].logprob - ref[pos - 1, tid].item()) < 1e-4
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, 4)


@pytest.mark.skipif(native.load() is None, reason="native kernels not built")
def test_smollm2_decoding_in_lanes_matches_transformers(smollm2_llm, hf_smollm2, monkeypatch):
    """Sixteen sequences decoding together on two threads run their steps in two lanes
    (csrc/decoder_lanes.c), on the bundled checkpoint's coded weights: greedy tokens equal
    transformers'."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    lib, lanes = native.load(), []
    run = lib.decoder_lanes_f32
    monkeypatch.setattr(lib, "decoder_lanes_f32",
                        lambda *args: lanes.append(args[-1]) or run(*args))
    prompts = [[100 + (7 * i + 13 * j) % 40000 for j in range(5 + 9 * i)] for i in range(16)]
    try:
        outs = smollm2_llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                    SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                                    use_tqdm=False)
    finally:
        torch.set_num_threads(before)
    assert lanes and set(lanes) == {2}  # decode steps of 16 rows ran in two lanes
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf_smollm2, prompt, 10)
