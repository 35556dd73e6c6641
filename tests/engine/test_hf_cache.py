"""Hugging Face repo ids ("org/name") resolve to snapshots of the local HF cache, offline."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from pdserve import SamplingParams
from pdserve.models.loader import resolve_model, resolve_tokenizer

COMMIT = "0123456789abcdef0123456789abcdef01234567"
PROMPTS = ["Hello, my name is", "1 2 3", "The quick brown fox jumps over the lazy dog."]


def lay_out_hf_cache(src: Path, cache: Path, repo_id: str) -> Path:
    """Copy `src` into `cache` the way huggingface_hub stores a download: content-addressed
    blobs, a snapshot of relative symlinks to them, and refs/main naming the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        if f.is_file():
            data = f.read_bytes()
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def hf_cache(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hub"
    lay_out_hf_cache(tiny_model_dir, cache, "tiny-org/tiny-llama")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_repo_id_resolves_to_cached_snapshot(hf_cache: Path) -> None:
    r = resolve_model("tiny-org/tiny-llama")
    assert r.name == "tiny-org/tiny-llama" and r.gguf_file is None
    assert Path(r.path) == (hf_cache / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT)
    assert resolve_tokenizer("tiny-org/tiny-llama").path == r.path


def test_hf_home_is_honoured(tmp_path: Path, tiny_model_dir: Path,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = lay_out_hf_cache(tiny_model_dir, tmp_path / "home" / "hub", "org/name")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert Path(resolve_model("org/name").path) == snapshot.resolve()


def test_missing_repo_id_is_a_clear_error(hf_cache: Path) -> None:
    with pytest.raises(ValueError) as info:
        resolve_model("tiny-org/not-downloaded")
    msg = str(info.value)
    assert msg.startswith("model: 'tiny-org/not-downloaded'")
    assert "not in the local cache" in msg
    assert str(hf_cache / "models--tiny-org--not-downloaded") in msg
    with pytest.raises(ValueError, match=r"^tokenizer: .*not in the local cache"):
        resolve_tokenizer("tiny-org/not-downloaded")
    with pytest.raises(ValueError, match="model: path .* does not exist"):
        resolve_model("./not/a-repo-id")  # an explicit relative path stays a path


def test_bundled_names_still_resolve(hf_cache: Path) -> None:
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct").gguf_file is not None


def test_llm_from_repo_id_matches_llm_from_path(hf_cache: Path, tiny_llm) -> None:
    from pdserve import LLM

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM("tiny-org/tiny-llama", kv_cache_memory_bytes=4 << 20)
    assert llm.llm_engine.config.model.resolved.name == "tiny-org/tiny-llama"
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    want = tiny_llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.prompt_token_ids for o in got] == [o.prompt_token_ids for o in want]


def test_llm_missing_repo_id_raises(hf_cache: Path) -> None:
    from pdserve import LLM

    with pytest.raises(ValueError, match=r"^model: .*not in the local cache"):
        LLM("tiny-org/not-downloaded")


def test_a_revision_picks_the_cached_snapshot_it_names(hf_cache: Path) -> None:
    """As vLLM's --revision: a commit in the cache, and a clear error for one not there."""
    from pdserve import EngineArgs

    assert Path(resolve_model("tiny-org/tiny-llama", COMMIT).path).name == COMMIT
    args = EngineArgs(model="tiny-org/tiny-llama", revision="f" * 40)
    with pytest.raises(ValueError, match="revision 'f{40}'"):
        args.create_engine_config()
