"""GPU tests: they need a CUDA device and Triton compiled for it (no TRITON_INTERPRET).

Run them alone, in one command, on any machine with an NVIDIA GPU: `bash scripts/gpu_check.sh`
(or `python -m pytest tests/gpu`). Everywhere else every test here is skipped.
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    SKIP_REASON = "TRITON_INTERPRET=1: the GPU tests need Triton compiled for the device"
elif not torch.cuda.is_available():
    SKIP_REASON = "no CUDA device"
else:
    SKIP_REASON = ""


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if SKIP_REASON and str(item.fspath).startswith(here):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_resolved():
    from pdserve.models.loader import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def hf_smollm2_cuda(smollm2_resolved):
    """transformers' own Llama on the GPU in float32, holding SmolLM2's dequantized weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pdserve.models.loader import load_state_dict

    config = AutoConfig.from_pretrained(smollm2_resolved.directory,
                                        gguf_file=smollm2_resolved.gguf_file,
                                        local_files_only=True)
    config.tie_word_embeddings = True
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(load_state_dict(smollm2_resolved, torch.float32), strict=False)
    model.tie_weights()
    return model.eval().to("cuda")
