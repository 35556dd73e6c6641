"""Gemma 2 is refused with a clear error: the paged attention kernels have no attention
logit soft-capping and no per-layer sliding windows yet."""

from __future__ import annotations

import json

import pytest

MESSAGE = ("architecture: Gemma2ForCausalLM needs attention soft-capping/sliding windows, "
           "not supported yet")


def test_gemma2_config_is_refused():
    from transformers import Gemma2Config

    from pdserve.models.arch import ModelArch

    with pytest.raises(ValueError) as info:
        ModelArch.from_hf_config(Gemma2Config(num_hidden_layers=2))  # no `architectures`
    assert str(info.value) == MESSAGE


def test_gemma2_directory_is_refused(tmp_path):
    from pdserve import LLM
    from pdserve.models.loader import resolve_model

    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"}))
    for load in (resolve_model, LLM):
        with pytest.raises(ValueError) as info:
            load(str(tmp_path))
        assert str(info.value) == MESSAGE
