"""Building a model whose every parameter the checkpoint overwrites: nn.Linear and nn.Embedding
skip their random initialization (for SmolLM2-135M it took 0.5-1.6 s of each load, on 2 cores).
Safe only because load_weights refuses a checkpoint that leaves a parameter unset."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from torch import nn

_lock = threading.Lock()  # the patch is process-wide: one build at a time


@contextlib.contextmanager
def skip_random_init() -> Iterator[None]:
    """Within it, new nn.Linear / nn.Embedding parameters are left uninitialized (torch.empty)."""
    with _lock:
        saved = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Embedding)}
        try:
            for cls in saved:
                cls.reset_parameters = _leave_empty
            yield
        finally:
            for cls, method in saved.items():
                cls.reset_parameters = method


def _leave_empty(module: nn.Module) -> None:
    """reset_parameters that leaves the parameters as allocated."""
