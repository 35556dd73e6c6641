"""Draft tokens by prompt lookup: n-gram speculative decoding.

A greedy sequence often repeats itself or its prompt. When the last n tokens (n from
`prompt_lookup_max` down to `prompt_lookup_min`) occurred earlier in the sequence, the tokens
that followed their latest occurrence are proposed as the next ones (repeated with the period
that occurrence implies, where fewer tokens have followed it than asked for). The engine
computes the sequence's last token and the drafts in one step, as decode rows at growing
context lengths, takes the argmax at every position and keeps the drafts up to the first that
differs from it, plus the argmax after them: the same tokens as one at a time, in fewer steps.
Each kept draft saves a step's share of the fixed costs and most of a pass over the sequence's
keys and values (the decode attention reads a sequence's rows one after another, from cache);
a refused one costs a row of arithmetic.

Sampled sequences speculate too: with a seed, each row draws what one token at a time draws
at its place and the drafts are kept while they equal those draws (the same tokens as without
drafts); without one, drafts are kept by rejection sampling, so the tokens follow the
distribution of sampling one at a time (draft_verifier.py).
Penalties, biases, masks and grammars apply to each drafted row as at its place, and logprobs
come from the rows that chose the tokens (draft_verifier.py); a sequence with a grammar drafts
only what its grammar accepts (vLLM cuts drafts the same way); below min_tokens each row
forbids the stop tokens as its place does. A stop string completed inside kept drafts ends
the output there (output_processor.py). A sequence whose drafts keep failing backs off:
after a draft is rejected outright it proposes none for 1, 2, 4 ... (at most
MAX_BACKOFF_STEPS) steps, and one accepted draft resets that.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.engine.request import Request

MAX_BACKOFF_STEPS = 32
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` for its "ngram" method (prompt lookup)."""

    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5

    def __post_init__(self) -> None:
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 64:
            raise ValueError(f"speculative_config: need 1 <= prompt_lookup_min <= "
                             f"prompt_lookup_max <= 64, got {self.prompt_lookup_min} and "
                             f"{self.prompt_lookup_max}")

    @classmethod
    def from_vllm(cls, value: Any) -> SpeculativeConfig | None:
        """vLLM's dict (or its JSON text) with vLLM's meaning: {"method": "ngram" (or "model":
        "ngram"), "num_speculative_tokens": k, "prompt_lookup_min": lo, "prompt_lookup_max":
        hi}; without either bound both are 5, with one the other equals it; k is 3 unless
        given. None or {} for no speculation. Other methods (draft models, EAGLE, MTP) and
        keys raise ValueError naming them."""
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"speculative_config is not JSON: {exc}") from None
        if value is None or value == {}:
            return None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a dict (JSON object)")
        options = dict(value)
        method, model = options.pop("method", None), options.pop("model", None)
        if method is None and model in _NGRAM_NAMES:
            method = "ngram"
        if method not in _NGRAM_NAMES or model not in (None, *_NGRAM_NAMES):
            raise ValueError(f"speculative_config.method {method!r} (model {model!r}) is not "
                             "supported: pdserve drafts by prompt lookup only (method 'ngram')")
        unknown = sorted(set(options) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"speculative_config: unsupported key(s) {unknown}")
        for key, v in options.items():
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"speculative_config.{key} must be an integer, got {v!r}")
        lo, hi = options.pop("prompt_lookup_min", None), options.pop("prompt_lookup_max", None)
        lo, hi = (lo or hi or cls.prompt_lookup_min), (hi or lo or cls.prompt_lookup_max)
        return cls(**options, prompt_lookup_min=lo, prompt_lookup_max=hi)


_NGRAM_NAMES = ("ngram", "[ngram]")


def speculates(request: Request) -> bool:
    """Whether the request drafts: every generating request does. Its next token is the
    argmax of its logits (greedy) or a draw from them after its biases, masks, penalties,
    min_tokens and grammar and temperature, min_p, top_k and top_p, and the verifier gives
    each row those of its place (and a seeded row its place's draw)."""
    return request.pooling_params is None


def propose_drafts(running: list[Request], config: SpeculativeConfig | None,
                   max_model_len: int) -> dict[str, list[int]]:
    """Draft tokens for the decoding requests among `running` that speculate, by request id;
    never more than their max_tokens and max_model_len leave room for (the token after the
    drafts is always sampled)."""
    if config is None:
        return {}
    drafts = {}
    for request in running:
        if request.num_tokens - request.num_computed_tokens == 1 and speculates(request):
            request.drafts = request.drafts or NgramDrafts(config)
            max_tokens = request.sampling_params.max_tokens or max_model_len
            limit = min(max_tokens - request.num_output_tokens,
                        max_model_len - request.num_tokens) - 1
            draft = request.drafts.propose(request.all_token_ids, limit)
            if draft and request.grammar is not None:
                draft = draft[:request.grammar.accepted_prefix(draft)]
            if draft:
                drafts[request.request_id] = draft
    return drafts


class NgramDrafts:
    """One sequence's n-gram index: where each n-gram of its tokens (but the last n) last
    ended, for lookups in O(1) per step; it catches up with the tokens it is given. It holds
    up to (max - min + 1) entries per token, a few hundred bytes: well under 1% of what a
    token's keys and values take in the cache."""

    def __init__(self, config: SpeculativeConfig):
        self.lo, self.hi = config.prompt_lookup_min, config.prompt_lookup_max
        self.k = config.num_speculative_tokens
        self.last_end: dict[tuple[int, ...], int] = {}  # n-gram -> its latest end (exclusive)
        self.indexed = 0  # n-grams ending at 1 .. indexed are in last_end
        self.backoff = 0  # steps to skip before drafting again
        self.misses = 0  # drafts rejected outright in a row

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to min(k, limit) tokens to follow `tokens` (the whole sequence), or none."""
        if self.backoff:
            self.backoff -= 1
            return []
        if limit <= 0:
            return []
        end = len(tokens)
        for e in range(self.indexed + 1, end):  # every n-gram but those ending at `end`
            for n in range(self.lo, min(self.hi, e) + 1):
                self.last_end[tuple(tokens[e - n:e])] = e
        self.indexed = max(self.indexed, end - 1)
        for n in range(min(self.hi, end - 1), self.lo - 1, -1):
            found = self.last_end.get(tuple(tokens[end - n:]))
            if found is not None:  # the tokens since then repeat with period end - found
                count, period = min(self.k, limit), end - found
                draft = tokens[found:found + count]
                while len(draft) < count:
                    draft.append(draft[-period])
                return draft
        return []

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """The outcome of a verified draft: a rejection outright backs off, exponentially."""
        if num_accepted or not num_drafted:
            self.misses = 0
            return
        self.backoff = min(1 << self.misses, MAX_BACKOFF_STEPS)
        self.misses += 1
