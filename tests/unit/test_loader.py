"""Model resolution, ModelArch, weight loading (safetensors and GGUF) and tokenizers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from pdserve.models.arch import ModelArch
from pdserve.models.loader import (
    DEFAULT_MODEL,
    load_arch,
    load_state_dict,
    load_tokenizer,
    resolve_model,
)

SMOLLM2_NAMES = [
    "model.embed_tokens.weight",  # Q8_0
    "model.layers.0.self_attn.q_proj.weight",  # Q4_1, permuted by llama.cpp (9 heads)
    "model.layers.7.self_attn.k_proj.weight",  # Q4_1, permuted by llama.cpp (3 KV heads)
    "model.layers.29.self_attn.v_proj.weight",
    "model.layers.3.self_attn.o_proj.weight",
    "model.layers.3.mlp.down_proj.weight",
    "model.layers.0.input_layernorm.weight",  # F32
    "model.norm.weight",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_path: str):
    return resolve_model(smollm2_path)


@pytest.fixture(scope="module")
def smollm2_state_dict(smollm2) -> dict[str, torch.Tensor]:
    return load_state_dict(smollm2, torch.float32)


# ---------------------------------------------------------------------------- resolution
def test_resolve_default_name_finds_bundled_gguf() -> None:
    for name in (DEFAULT_MODEL, "HuggingFaceTB/SmolLM2-135M-Instruct"):
        r = resolve_model(name)
        assert r.name == name
        assert r.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
        assert Path(r.path).is_file() and Path(r.path).name == r.gguf_file
        assert Path(r.directory) == Path(r.path).parent


def test_resolve_missing_path_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model: path .* does not exist"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="model"):
        resolve_model(str(tmp_path))  # a directory without config.json


def test_resolve_unsupported_architecture_raises(tmp_path: Path) -> None:
    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 1}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="architecture 'GPT2LMHeadModel' is not supported"):
        resolve_model(str(tmp_path))


def test_resolve_directory(tiny_model_dir: Path) -> None:
    r = resolve_model(str(tiny_model_dir))
    assert r.gguf_file is None and r.directory == r.path and r.name == str(tiny_model_dir)


# ---------------------------------------------------------------------------- ModelArch
def test_arch_from_configs() -> None:
    from transformers import GenerationConfig, GPT2Config, LlamaConfig, Qwen2Config

    cfg = LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, eos_token_id=2,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
    )
    arch = ModelArch.from_hf_config(cfg, GenerationConfig(eos_token_id=[7, 2]))
    assert arch.architecture == "LlamaForCausalLM"  # from model_type: no `architectures`
    assert arch.head_dim == 16 and arch.rope_theta == 5e5
    assert arch.rope_scaling_dict == {"rope_type": "linear", "factor": 2.0}
    assert arch.eos_token_ids == (7, 2)
    hash(arch)

    qwen = ModelArch.from_hf_config(Qwen2Config(architectures=["Qwen2ForCausalLM"]))
    assert qwen.attention_bias and qwen.rope_scaling is None
    with pytest.raises(ValueError, match="not supported"):
        ModelArch.from_hf_config(GPT2Config(architectures=["GPT2LMHeadModel"]))


# ---------------------------------------------------------------------------- tiny model
def test_tiny_state_dict_matches_transformers(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    r = resolve_model(str(tiny_model_dir))
    ours = load_state_dict(r, torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True).state_dict()
    assert set(ours) == set(ref)
    for name, tensor in ref.items():
        assert ours[name].dtype == torch.float32
        assert torch.equal(ours[name], tensor), name
    assert ours["model.layers.0.input_layernorm.weight"].std() > 0.01  # norms are randomised
    bf16 = load_state_dict(r, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())


def test_tiny_arch_matches_config(tiny_model_dir: Path) -> None:
    from transformers import AutoConfig

    arch = load_arch(resolve_model(str(tiny_model_dir)))
    cfg = AutoConfig.from_pretrained(tiny_model_dir, local_files_only=True)
    assert arch.architecture == "LlamaForCausalLM"
    assert (arch.num_hidden_layers, arch.hidden_size, arch.intermediate_size) == (2, 64, 128)
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (4, 2, 16)
    assert arch.vocab_size == cfg.vocab_size == 49152
    assert arch.rms_norm_eps == cfg.rms_norm_eps
    assert arch.max_position_embeddings == 2048
    assert not arch.tie_word_embeddings and not arch.attention_bias
    assert arch.bos_token_id == cfg.bos_token_id and arch.eos_token_ids == (cfg.eos_token_id,)
    assert arch.torch_dtype == "float32"


# ---------------------------------------------------------------------------- SmolLM2 GGUF
def _reference_gguf_tensors(path: str, names: list[str]) -> dict[str, torch.Tensor]:
    """The gguf-py + transformers pieces that AutoModelForCausalLM uses for a GGUF file
    (reader, dequantize, llama q/k un-permutation, tensor-name map)."""
    from gguf import MODEL_ARCH, GGUFReader, dequantize, get_tensor_name_map
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    name_map = get_tensor_name_map(MODEL_ARCH.LLAMA, 30)
    wanted = {name_map.get_name(n.removesuffix(".weight")) + ".weight": n for n in names}
    processor = TENSOR_PROCESSORS["llama"](config={"num_attention_heads": 9, "num_key_value_heads": 3})
    out = {}
    for t in GGUFReader(path).tensors:
        if t.name in wanted:
            w = processor.process(weights=dequantize(t.data, t.tensor_type), name=t.name).weights
            out[wanted[t.name]] = torch.from_numpy(np.copy(w))
    assert set(out) == set(names)
    return out


def test_smollm2_state_dict_matches_transformers_gguf(smollm2_path: str, smollm2_state_dict) -> None:
    sd = smollm2_state_dict
    expected_names = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{part}.weight"
        for i in range(30)
        for part in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
            "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
        )
    }
    assert set(sd) == expected_names  # tied embeddings: no lm_head.weight
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert sd["model.layers.7.self_attn.k_proj.weight"].shape == (192, 576)
    assert sd["model.layers.3.mlp.down_proj.weight"].shape == (576, 1536)
    ref = _reference_gguf_tensors(smollm2_path, SMOLLM2_NAMES)
    for name in SMOLLM2_NAMES:
        assert sd[name].dtype == torch.float32
        torch.testing.assert_close(sd[name], ref[name], atol=1e-6, rtol=0, msg=name)


@pytest.mark.skipif(not os.environ.get("PDSERVE_SLOW_TESTS"), reason="set PDSERVE_SLOW_TESTS=1 (~40 s)")
def test_smollm2_state_dict_matches_from_pretrained(smollm2, smollm2_state_dict) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smollm2.directory, gguf_file=smollm2.gguf_file, local_files_only=True, dtype=torch.float32
    )
    ref = model.state_dict()
    assert set(ref) - set(smollm2_state_dict) == {"lm_head.weight"}
    for name, tensor in smollm2_state_dict.items():
        torch.testing.assert_close(tensor, ref[name], atol=1e-6, rtol=0, msg=name)


def test_smollm2_arch(smollm2) -> None:
    from transformers import AutoConfig

    arch = load_arch(smollm2)
    assert arch.architecture == "LlamaForCausalLM"
    assert (arch.num_hidden_layers, arch.num_attention_heads, arch.num_key_value_heads) == (30, 9, 3)
    assert (arch.head_dim, arch.hidden_size, arch.vocab_size) == (64, 576, 49152)
    assert arch.tie_word_embeddings and arch.rope_theta == 100000.0 and arch.rope_scaling is None
    # the fast metadata path agrees with transformers' own GGUF config parsing
    cfg = AutoConfig.from_pretrained(smollm2.directory, gguf_file=smollm2.gguf_file, local_files_only=True)
    assert arch == ModelArch.from_hf_config(cfg)


def test_smollm2_metadata_matches_gguf_py(smollm2) -> None:
    """Our reader's metadata (string arrays read in one loop) is gguf-py's, and the reader of
    the metadata is opened once per process while the file stays the same."""
    from gguf import GGUFReader, GGUFValueType

    from pdserve.models.gguf_file import open_gguf

    ours = open_gguf(smollm2.path)
    assert open_gguf(smollm2.path) is ours
    reference = GGUFReader(smollm2.path)
    assert set(ours.metadata) == {k for k in reference.fields if not k.startswith("GGUF.")}
    for key, field in reference.fields.items():
        if key.startswith("GGUF."):
            continue
        if field.types[0] == GGUFValueType.ARRAY and field.types[-1] == GGUFValueType.STRING:
            assert ours.metadata[key] == [bytes(field.parts[i]).decode() for i in field.data], key
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152
    assert set(ours.tensors) == {t.name for t in reference.tensors}


def test_smollm2_tokenizer(smollm2, tiny_model_dir: Path) -> None:
    tok = load_tokenizer(smollm2)
    assert tok.chat_template
    text = "The capital of France is"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids and tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert "<|im_start|>user\nhi<|im_end|>" in chat and chat.endswith("<|im_start|>assistant\n")
    tiny = load_tokenizer(resolve_model(str(tiny_model_dir)))  # same tokenizer, saved to disk
    assert tiny.encode(text, add_special_tokens=False) == ids and tiny.chat_template == tok.chat_template


def test_models_are_built_without_random_init_and_refuse_a_partial_checkpoint(
        tiny_model_dir: Path) -> None:
    """load_model skips nn.Linear / nn.Embedding's random init, which is safe only because a
    checkpoint that leaves any parameter unset is refused; the patch is undone afterwards."""
    from torch import nn

    from pdserve.engine.engine_args import EngineArgs
    from pdserve.engine.llm_engine import load_model
    from pdserve.models.empty_init import skip_random_init
    from pdserve.models.llama import LlamaForCausalLM

    linear_init = nn.Linear.reset_parameters
    config = EngineArgs(model=str(tiny_model_dir), kv_cache_memory_bytes=4 << 20) \
        .create_engine_config()
    model = load_model(config)
    assert nn.Linear.reset_parameters is linear_init
    reference = load_state_dict(config.model.resolved, torch.float32)
    assert torch.equal(model.embed_tokens.weight, reference["model.embed_tokens.weight"])
    with skip_random_init():
        assert nn.Linear.reset_parameters is not linear_init
        empty = LlamaForCausalLM(config.model.arch)
    partial = {k: v for k, v in reference.items() if "layers.1.mlp.down_proj" not in k}
    with pytest.raises(ValueError, match="weights missing from checkpoint"):
        empty.load_weights(partial)
