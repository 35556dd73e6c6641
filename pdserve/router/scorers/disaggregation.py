"""Disaggregate or not: send a prompt through a prefill instance only when that pays.

Moving KV from prefill to decode costs a transfer; a prompt whose uncached part is short is
cheaper to prefill on the decode instance itself (llm-d's "pd profile" rule). Optionally also
by load: a decode instance running only a few requests reads every weight in each step for a
few rows, and a prompt chunk computed beside them costs little more than those rows alone.
Where its prefill instance computes on the same cores (`pdserve up` on one machine), that
prompt would cost the same cores anyway, so it is cheaper on the decode instance.
"""

from __future__ import annotations


def should_disaggregate(uncached_prompt_tokens: int, threshold: int, decode_running: int = 0,
                        min_running: int = 0) -> bool:
    """True when at least `threshold` prompt tokens still need computing (0: always) and the
    decode instance already runs at least `min_running` requests (0: however few)."""
    if threshold < 0:
        raise ValueError(f"disaggregation threshold must be >= 0, got {threshold}")
    if min_running < 0:
        raise ValueError(f"disaggregation min_running must be >= 0, got {min_running}")
    return uncached_prompt_tokens >= threshold and decode_running >= min_running


def uncached_tokens(num_prompt_tokens: int, matched_blocks: int, block_size: int) -> int:
    """Prompt tokens not covered by `matched_blocks` cached leading blocks."""
    return max(0, num_prompt_tokens - matched_blocks * block_size)
