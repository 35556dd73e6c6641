"""Prompt schemas accepted by `LLM.generate`, as in vLLM."""

from __future__ import annotations

from typing import NotRequired, TypeAlias, TypedDict


class TextPrompt(TypedDict):
    """Schema for a text prompt."""

    prompt: str
    """The input text to be tokenized before passing to the model."""
    cache_salt: NotRequired[str]
    """Optional salt that isolates this prompt's prefix-cache entries."""


class TokensPrompt(TypedDict):
    """Schema for a tokenized prompt."""

    prompt_token_ids: list[int]
    """The token ids to pass to the model."""
    prompt: NotRequired[str]
    """The prompt text corresponding to the token ids, if available."""
    token_type_ids: NotRequired[list[int]]
    """Token type ids for cross-encoder models."""
    cache_salt: NotRequired[str]
    """Optional salt that isolates this prompt's prefix-cache entries."""


PromptType: TypeAlias = str | TextPrompt | TokensPrompt
"""Any prompt: a plain string, a TextPrompt or a TokensPrompt."""
