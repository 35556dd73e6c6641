"""Hugging Face repo ids ("org/name") resolved to snapshots in the local Hugging Face cache.

Offline only, as vLLM with HF_HUB_OFFLINE=1: the cache is looked up with huggingface_hub's
`snapshot_download(..., local_files_only=True)` and nothing is ever downloaded. The cache
directory is read from the environment at call time (HF_HUB_CACHE, else HF_HOME/hub, else
$XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub), so a test or a server may set
it after huggingface_hub was imported.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# owner/name as the Hub spells repo ids: letters, digits, '-', '_', '.'; no '--' or '..'.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")


def is_repo_id(name: str) -> bool:
    """Whether `name` could be a Hugging Face repo id (checked only once it is not a path)."""
    return (_REPO_ID.fullmatch(name) is not None and ".." not in name and "--" not in name
            and not name.endswith((".", ".gguf")))


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache directory, per the current environment."""
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return Path(cache).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache",
                                              "huggingface")
    return Path(home).expanduser() / "hub"


def cached_snapshot(repo_id: str, revision: str | None = None, what: str = "model") -> Path:
    """The snapshot directory of `repo_id` (at `revision`, default "main") in the local cache.

    Raises ValueError starting with `what:` when it is not there; never touches the network.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    folder = cache / ("models--" + repo_id.replace("/", "--"))
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=str(cache),
                                 local_files_only=True)
    except LocalEntryNotFoundError as e:
        raise ValueError(
            f"{what}: {repo_id!r} is not a local path, and the Hugging Face repo {repo_id!r} "
            f"(revision {revision or 'main'!r}) is not in the local cache: looked in "
            f"{str(folder)!r} (cache {str(cache)!r}, from HF_HUB_CACHE / HF_HOME). pdserve "
            f"never downloads: fetch it first (e.g. `hf download {repo_id}`) or pass a local "
            "directory or .gguf file") from e
    except Exception as e:  # e.g. an incomplete snapshot, a malformed cache
        raise ValueError(f"{what}: cannot use the cached Hugging Face repo {repo_id!r} in "
                         f"{str(folder)!r}: {e}") from e
    return Path(path)
