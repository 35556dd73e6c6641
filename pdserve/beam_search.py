"""Beam search with vLLM's semantics, over any engine that returns next-token logprobs.

Each step extends every live beam by one token: the engine generates one token for each beam
(its tokens as the prompt, so the prefix cache holds the shared part) with the top
2 x beam_width logprobs, every candidate becomes a new beam, and the beam_width best by score
survive. A beam that ends with EOS is set aside as complete (unless ignore_eos). After
max_tokens steps the complete and live beams are ranked together and the best beam_width are
returned. Score (vLLM's): cumulative logprob / len(tokens) ** length_penalty, where tokens
count the prompt and a final EOS does not count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# One beam's next-token candidates: token id -> logprob.
Candidates = dict[int, float]


# |length_penalty| beyond this overflows len ** length_penalty for long beams (or makes it
# 0): no ranking needs more.
MAX_LENGTH_PENALTY = 10.0


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam search parameters."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int of at least 1, got {value!r}")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < 1e9:
            raise ValueError(f"temperature must be a non-negative number, got "
                             f"{self.temperature!r}")
        if not isinstance(self.length_penalty, (int, float)) or \
                not -MAX_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY:
            raise ValueError(f"length_penalty must be a number in [-{MAX_LENGTH_PENALTY}, "
                             f"{MAX_LENGTH_PENALTY}], got {self.length_penalty!r}")


@dataclass
class BeamSearchSequence:
    """A beam: `tokens` are the prompt's and the generated ones; `logprobs` one candidates
    dict per generated token; `text` the generated text (set at the end)."""

    tokens: list[int]
    logprobs: list[Candidates] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_token_id: int | None,
               length_penalty: float) -> float:
    length = len(beam.tokens)
    if eos_token_id is not None and beam.tokens and beam.tokens[-1] == eos_token_id:
        length -= 1
    return beam.cum_logprob / (length ** length_penalty)


class BeamSearch:
    """One prompt's search: `live` beams to extend, `advance` with their candidates."""

    def __init__(self, prompt_ids: list[int], params: BeamSearchParams,
                 eos_token_id: int | None):
        self.prompt_len = len(prompt_ids)
        self.params = params
        self.eos = eos_token_id
        self.live = [BeamSearchSequence(list(prompt_ids))]
        self.complete: list[BeamSearchSequence] = []
        self.steps = 0

    def next_batch(self) -> list[list[int]]:
        """The token lists whose next-token logprobs the next step needs ([] when done)."""
        if self.steps >= self.params.max_tokens:
            return []
        return [beam.tokens for beam in self.live]

    def _key(self, beam: BeamSearchSequence) -> float:
        return beam_score(beam, self.eos, self.params.length_penalty)

    def advance(self, candidates: Sequence[Candidates]) -> None:
        """candidates[i]: the next-token logprobs of live beam i."""
        self.steps += 1
        grown = []
        for beam, options in zip(self.live, candidates):
            for token, logprob in options.items():
                new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [options],
                                         beam.cum_logprob + logprob)
                if token == self.eos and not self.params.ignore_eos:
                    new.finish_reason = "stop"
                    self.complete.append(new)
                else:
                    grown.append(new)
        self.live = sorted(grown, key=self._key, reverse=True)[:self.params.beam_width]

    def result(self, decode: Callable[[list[int]], str]) -> BeamSearchOutput:
        for beam in self.live:
            beam.finish_reason = "length"
        ranked = sorted(self.complete + self.live, key=self._key, reverse=True)
        best = ranked[:self.params.beam_width]
        for beam in best:
            generated = beam.tokens[self.prompt_len:]
            if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                generated = generated[:-1]  # EOS is not text
            beam.text = decode(generated)
        return BeamSearchOutput(best)


def run_beam_search(searches: list[BeamSearch],
                    next_token_logprobs: Callable[[list[list[int]]], list[Candidates]],
                    decode: Callable[[list[int]], str]) -> list[BeamSearchOutput]:
    """Run searches side by side: `next_token_logprobs(token lists)` gives each token list's
    top 2 x beam_width next-token logprobs, for every live beam of every search at once."""
    while True:
        batches = [(s, s.next_batch()) for s in searches]
        batches = [(s, b) for s, b in batches if b]
        if not batches:
            return [s.result(decode) for s in searches]
        results = next_token_logprobs([tokens for _, b in batches for tokens in b])
        start = 0
        for s, b in batches:
            s.advance(results[start:start + len(b)])
            start += len(b)
