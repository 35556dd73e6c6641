"""Disaggregate or not: send a prompt through a prefill instance only when that pays.

Moving KV from prefill to decode costs a transfer; a prompt whose uncached part is short is
cheaper to prefill on the decode instance itself (llm-d's "pd profile" rule).
"""

from __future__ import annotations


def should_disaggregate(uncached_prompt_tokens: int, threshold: int) -> bool:
    """True when at least `threshold` prompt tokens still need computing (0: always)."""
    if threshold < 0:
        raise ValueError(f"disaggregation threshold must be >= 0, got {threshold}")
    return uncached_prompt_tokens >= threshold


def uncached_tokens(num_prompt_tokens: int, matched_blocks: int, block_size: int) -> int:
    """Prompt tokens not covered by `matched_blocks` cached leading blocks."""
    return max(0, num_prompt_tokens - matched_blocks * block_size)
