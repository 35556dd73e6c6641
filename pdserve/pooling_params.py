"""Pooling parameters for embeddings (LLM.embed, LLM.encode, POST /v1/embeddings), with
vLLM's field names, defaults and checks."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class PoolingParams:
    """How a prompt's hidden states become one embedding.

    normalize: L2-normalize the embedding (None: the task's default, True for embed).
    dimensions: Matryoshka truncation: keep the first `dimensions` values, then normalize;
        between 1 and the model's hidden size.
    truncate_prompt_tokens: keep only the prompt's last k tokens (-1: the last max_model_len).
    """

    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool or None, got {self.normalize!r}")
        d = self.dimensions
        if d is not None and (not _is_int(d) or d < 1):
            raise ValueError(f"dimensions must be an int of at least 1 or None, got {d!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or (k < 1 and k != -1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 (the model's max length), "
                             f"an int of at least 1 or None, got {k!r}")

    @property
    def use_normalize(self) -> bool:
        return True if self.normalize is None else self.normalize

    def verify(self, hidden_size: int) -> None:
        """Raise ValueError if `dimensions` is more than the model's hidden size."""
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise ValueError(f"dimensions: {self.dimensions} is outside [1, {hidden_size}] "
                             f"(the model's hidden size)")

    def truncate_prompt(self, prompt_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as the engine runs it: its last truncate_prompt_tokens tokens (-1: the
        last max_model_len), or all of it when truncate_prompt_tokens is None."""
        k = self.truncate_prompt_tokens
        if k is None:
            return list(prompt_ids)
        if k > max_model_len:
            raise ValueError(f"truncate_prompt_tokens: {k} is greater than max_model_len="
                             f"{max_model_len}")
        k = max_model_len if k == -1 else k
        return list(prompt_ids[-k:])

    def clone(self) -> PoolingParams:
        return copy.deepcopy(self)
