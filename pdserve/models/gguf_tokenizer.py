"""A GGUF file's tokenizer, converted once per machine.

transformers rebuilds a GGUF model's tokenizer from the file's metadata at every load (about
7 s for SmolLM2's 49,152 tokens here, in every process that serves the model: engine, router,
gateway). The converted tokenizer is saved (tokenizer.json, its config and chat template) in
pdserve's cache, under a key naming the file (path, size, modification time) and the
transformers and tokenizers versions that converted it; later loads read those files (about
0.4 s) and give the same tokenizer.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.cache_dir import cache_dir
from pdserve.models.remembered import load_tokenizer_folder

log = logging.getLogger(__name__)


def cache_key(gguf_path: str | Path) -> str:
    """Names the file as it is now and the libraries that convert it."""
    import tokenizers
    import transformers

    path = Path(gguf_path).resolve()
    stat = path.stat()
    text = "\0".join(map(str, (path, stat.st_size, stat.st_mtime_ns, transformers.__version__,
                               tokenizers.__version__)))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def cached_folder(gguf_path: str | Path) -> Path:
    return cache_dir() / f"tokenizer-{cache_key(gguf_path)}"


def load_gguf_tokenizer(gguf_path: str | Path, convert: Callable[[], Any]) -> Any:
    """The tokenizer of `gguf_path`: from the cache when it holds it, else `convert()`'s
    (transformers' conversion), which is then saved there for the next load. A cache that
    cannot be read or written only costs the conversion."""
    folder = cached_folder(gguf_path)
    if folder.is_dir():
        try:
            tokenizer = load_tokenizer_folder(folder, lambda: _autoload(folder),
                                              local_files_only=True)
            tokenizer.name_or_path = str(Path(gguf_path).parent)  # as the conversion names it
            return tokenizer
        except (OSError, ValueError) as e:
            log.warning("converting the GGUF tokenizer again: its cached copy in %s does not "
                        "load (%s)", folder, e)
    tokenizer = convert()
    try:
        _save(tokenizer, folder)
    except OSError as e:
        log.info("the converted GGUF tokenizer is not cached (%s): %s", folder, e)
    return tokenizer


def _autoload(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def _save(tokenizer: Any, folder: Path) -> None:
    """Write into a fresh folder beside `folder`, then rename it into place: a process loading
    meanwhile sees all the files or none (another process saving the same key wins)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(folder, ignore_errors=True)  # a copy that did not load
        os.rename(tmp, folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not folder.is_dir():
            raise
