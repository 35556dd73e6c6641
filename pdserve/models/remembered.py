"""What transformers works out from a model's small files, remembered once per machine.

transformers reads a config through the model's config class, whose import pulls in much of
transformers, torch.distributed and sympy (about 3 s of every engine, router and gateway
start here), and AutoTokenizer reads the config again only to choose the tokenizer's class.
Both answers depend on small files alone, so they are kept as JSON in pdserve's cache:
- the ModelArch a config gives, keyed by config.json and generation_config.json (or a GGUF
  file's config fields), the overrides, and the source of the code that reads them;
- the class AutoTokenizer picks for a folder, keyed by the folder and its files' names,
  sizes and modification times.
Each key also names the transformers version. Later loads skip transformers' config classes
and give the same ModelArch and tokenizer; a cache that cannot be read or written costs only
the time it would have saved.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

from pdserve.cache_dir import cache_dir
from pdserve.models import arch as arch_module
from pdserve.models.arch import ModelArch

log = logging.getLogger(__name__)
T = TypeVar("T")


def remembered(kind: str, key_parts: Sequence[str | bytes], compute: Callable[[], T],
               save: Callable[[T], Any], restore: Callable[[Any], T]) -> T:
    """`restore(saved)` where the cache holds what `save` made of `compute()` for the same
    `kind` and key parts; else `compute()`, which is then saved for the next load."""
    path = cache_dir() / "resolved" / f"{kind}-{_key(kind, key_parts)}.json"
    try:
        return restore(json.loads(path.read_text()))
    except FileNotFoundError:
        pass
    except (OSError, ValueError, TypeError, KeyError, ImportError, AttributeError) as e:
        log.warning("working out %s again: its cached copy %s does not load (%s)", kind, path, e)
    value = compute()
    try:
        _write(path, json.dumps(save(value)))
    except (OSError, TypeError, ValueError) as e:
        log.info("%s is not cached (%s): %s", kind, path, e)
    return value


def remembered_arch(key_parts: Sequence[str | bytes], compute: Callable[[], ModelArch]
                    ) -> ModelArch:
    """The ModelArch `compute()` reads from the files that `key_parts` hold."""
    source = Path(arch_module.__file__).read_bytes()
    return remembered("arch", [*key_parts, source], compute, dataclasses.asdict,
                      ModelArch.from_fields)


def load_tokenizer_folder(folder: str | Path, autoload: Callable[[], Any],
                          **kwargs: Any) -> Any:
    """The tokenizer in `folder`: `autoload()` (AutoTokenizer's) the first time; after that
    the class it chose, loaded straight from the folder with `kwargs`."""
    folder = Path(folder).resolve()
    files = [(f.name, f.stat()) for f in sorted(folder.iterdir()) if f.is_file()]
    stamps = [str(folder), *(f"{name}\0{st.st_size}\0{st.st_mtime_ns}" for name, st in files),
              json.dumps(kwargs, sort_keys=True)]

    def load(saved: dict[str, str]) -> Any:
        cls = getattr(importlib.import_module(saved["module"]), saved["name"])
        return cls.from_pretrained(str(folder), _from_auto=True, **kwargs)

    return remembered("tokenizer-class", stamps, autoload,
                      lambda tok: {"module": type(tok).__module__, "name": type(tok).__name__},
                      load)


def _key(kind: str, parts: Sequence[str | bytes]) -> str:
    digest = hashlib.sha256(f"{kind}\0{metadata.version('transformers')}".encode())
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()[:24]


def _write(path: Path, text: str) -> None:
    """Write a temporary file beside `path`, then rename it into place: a process reading
    meanwhile sees the whole file or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
        raise
