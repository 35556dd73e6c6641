"""What transformers works out from a model's small files, remembered per machine
(pdserve/models/remembered.py): the remembered ModelArch and tokenizer are the ones
transformers' own classes give, a later process gets them without importing a config class,
and a changed file, other overrides or a broken cached copy are worked out again."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
from test_gguf_tokenizer import assert_same

from pdserve.cache_dir import CACHE_ENV
from pdserve.models.arch import ModelArch
from pdserve.models.loader import (
    DEFAULT_MODEL,
    _hf_config,
    load_arch,
    load_tokenizer,
    resolve_model,
)
from pdserve.models.tiny import write_tiny_llama

ARCHITECTURES = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {a: write_tiny_llama(tmp_path_factory.mktemp(a), architecture=a, num_hidden_layers=1)
            for a in ARCHITECTURES}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    return tmp_path / "resolved"


def transformers_arch(resolved, overrides=None) -> ModelArch:
    cfg, gen = _hf_config(resolved)
    if overrides:
        cfg.update(overrides)
    return ModelArch.from_hf_config(cfg, gen)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_the_remembered_arch_is_transformers(model_dirs, cache, architecture):
    resolved = resolve_model(str(model_dirs[architecture]))
    expected = transformers_arch(resolved)
    assert load_arch(resolved) == expected  # worked out, then saved
    assert len(list(cache.glob("arch-*.json"))) == 1
    assert load_arch(resolved) == expected  # read back from JSON
    overrides = {"rms_norm_eps": 0.125, "max_position_embeddings": 64}
    assert load_arch(resolved, overrides) == transformers_arch(resolved, overrides)
    assert load_arch(resolved, overrides).rms_norm_eps == 0.125
    assert load_arch(resolved) == expected
    assert len(list(cache.glob("arch-*.json"))) == 2


def test_the_bundled_gguf_arch_is_remembered(cache):
    resolved = resolve_model(DEFAULT_MODEL)
    expected = transformers_arch(resolved)
    assert load_arch(resolved) == expected
    assert load_arch(resolved) == expected
    assert len(list(cache.glob("arch-*.json"))) == 1


def test_a_changed_config_or_a_broken_copy_is_read_again(model_dirs, cache, caplog):
    folder = model_dirs["LlamaForCausalLM"]
    resolved = resolve_model(str(folder))
    before = load_arch(resolved)
    config = json.loads((folder / "config.json").read_text())
    try:
        (folder / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 0.5}))
        assert load_arch(resolved).rms_norm_eps == 0.5
        assert load_arch(resolved) == transformers_arch(resolved)
    finally:
        (folder / "config.json").write_text(json.dumps(config))
    assert load_arch(resolved) == before
    for saved in cache.glob("arch-*.json"):
        saved.write_text('{"vocab_size": ')
    with caplog.at_level(logging.WARNING, logger="pdserve.models.remembered"):
        assert load_arch(resolved) == before
    assert "does not load" in caplog.text
    assert load_arch(resolved) == before
    # a function of the config is applied to transformers' own config, every time
    assert load_arch(resolved, lambda cfg: cfg).rms_norm_eps == before.rms_norm_eps


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Gemma3ForCausalLM"])
def test_the_remembered_tokenizer_class_gives_autotokenizers(model_dirs, cache, architecture):
    from transformers import AutoTokenizer

    folder = model_dirs[architecture]
    expected = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert_same(load_tokenizer(resolve_model(str(folder))), expected)
    (saved,) = cache.glob("tokenizer-class-*.json")
    assert json.loads(saved.read_text())["name"] == type(expected).__name__
    assert_same(load_tokenizer(resolve_model(str(folder))), expected)
    # a class that is not there any more: AutoTokenizer picks again
    saved.write_text(json.dumps({"module": "transformers", "name": "NoSuchTokenizer"}))
    assert_same(load_tokenizer(resolve_model(str(folder))), expected)
    assert json.loads(saved.read_text())["name"] == type(expected).__name__


def test_a_later_process_imports_no_config_class(model_dirs, cache):
    """The point of remembering: once a model's arch and tokenizer were worked out (here, in
    this process), another process loads them without importing transformers' model config
    classes or torch; reading the config through transformers there imports them."""
    folder = model_dirs["LlamaForCausalLM"]
    resolved = resolve_model(str(folder))
    arch, vocab = load_arch(resolved), len(load_tokenizer(resolved))
    script = f"""
import sys
from pdserve.models.loader import _hf_config, load_arch, load_tokenizer, resolve_model
def configs():
    return sorted(m for m in sys.modules if m.startswith("transformers.models.")
                  and ".configuration_" in m)
resolved = resolve_model({str(folder)!r})
print(load_arch(resolved).hidden_size, len(load_tokenizer(resolved)))
print(configs(), "torch" in sys.modules)
_hf_config(resolved)
print(configs())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=True).stdout.splitlines()
    assert out[0] == f"{arch.hidden_size} {vocab}"
    assert out[1] == "[] False"
    assert "transformers.models.llama.configuration_llama" in out[2]  # the check can tell


def test_an_unwritable_cache_still_loads(model_dirs, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker))  # "resolved" cannot be made under a file
    resolved = resolve_model(str(model_dirs["Qwen3ForCausalLM"]))
    assert load_arch(resolved) == transformers_arch(resolved)
    assert len(load_tokenizer(resolved)) > 1000
