"""Shared pytest fixtures: a tiny random Llama checkpoint and the bundled SmolLM2 GGUF."""

from __future__ import annotations

import os

# Before any test module imports grpc: the tests start servers with fork + exec (see
# pdserve/__init__.py for why gRPC's fork support is off).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of a 2-layer random Llama (float32, real SmolLM2 tokenizer), written once."""
    from pdserve.models.tiny import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def copying_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose layers add nothing to the residual stream (o_proj and down_proj are
    zero): its next token depends on the last one alone, so its greedy output repeats and
    every well-made n-gram draft is right."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdserve.models.tiny import write_tiny_llama

    base = write_tiny_llama(tmp_path_factory.mktemp("base"), tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    path = tmp_path_factory.mktemp("copying")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(base).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """Absolute path of the bundled SmolLM2-135M-Instruct Q4_1 .gguf file."""
    from pdserve.models.loader import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL).path


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the PyPI dry runs of tests/unit/test_torch_resolution.py as soon as they are
    selected: they mostly wait on the network, and the rest of the suite runs meanwhile
    (from a thread: nothing here waits, and a failure reaches those tests, not the session)."""
    for item in session.items:
        start = getattr(getattr(item, "module", None), "start_dry_runs", None)
        if start is not None:
            start()
            return
