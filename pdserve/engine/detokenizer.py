"""Incremental detokenization of one sequence, with stop-string detection.

Text is produced by decoding a short sliding window of tokens twice (with and without the
newest ones) and taking the difference, so each tokenizer's own decoding rules (byte-level
BPE, sentencepiece spaces, skipped special tokens) apply. A window whose text ends in U+FFFD
is an unfinished UTF-8 character: nothing is emitted until a later token completes it.
"""

from __future__ import annotations

from typing import Any

from pdserve.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns one sequence's sampled tokens into text and finds its stop strings.

    With `detokenize=False` (or no tokenizer) the text stays "" and the tokenizer is never used.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.params = params
        self.tokenizer = tokenizer if params.detokenize else None
        self.output_text = ""
        self.stop: list[str] = list(params.stop or [])
        self._stopped = False
        self._sent = 0  # chars of output_text already returned as delta
        self._held = self._held_at = 0  # _held_back's last answer, and len(output_text) then
        self._num_output_tokens = 0
        # Context tokens from the prompt tail, then all output tokens.
        self._token_ids: list[int] = []
        self._num_context = 0
        self._prefix_offset = 0
        self._read_offset = 0
        # Added tokens (id -> text), only needed to drop the spaces some decoders put between them.
        self._added: dict[int, str] = {}
        self._last_added = False
        if self.tokenizer is None:
            return
        self._token_ids = self._context(prompt_token_ids)
        self._num_context = self._read_offset = len(self._token_ids)
        if not params.skip_special_tokens and not params.spaces_between_special_tokens:
            decoder = getattr(self.tokenizer, "added_tokens_decoder", None) or {}
            self._added = {tid: str(getattr(tok, "content", tok)) for tid, tok in decoder.items()}

    @property
    def output_token_ids(self) -> list[int]:
        return self._token_ids[self._num_context:]

    def update(self, new_token_ids: list[int], num_output_tokens: int,
               stop_terminated: bool = False) -> str | None:
        """Append newly sampled tokens; `num_output_tokens` counts all output tokens so far,
        these included. Returns the stop string found (output_text is then cut before it, or
        after it with include_stop_str_in_output), else None. A stop string must end in the
        text of a token past the first `min_tokens` ones. With `stop_terminated` (the last new
        token is a stop token or EOS) that token adds no text unless include_stop_str_in_output.
        """
        if self.tokenizer is None or self._stopped:
            return None
        if stop_terminated and not self.params.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        first_index = num_output_tokens - len(new_token_ids)  # output tokens before these
        check_from = len(self.output_text)
        for j, token_id in enumerate(new_token_ids):
            self.output_text += self._decode_next(token_id)
            if first_index + j + 1 <= self.params.min_tokens:
                check_from = len(self.output_text)
        self._num_output_tokens = num_output_tokens
        return self._check_stop(check_from)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to report now: all of it (delta=False) or what is new since the last call.
        Until `finished`, a tail that could be the start of a stop string is held back; at
        `finished`, a trailing unfinished UTF-8 character is flushed (as U+FFFD, like decode)."""
        if finished:
            self._flush()
        end = len(self.output_text) if finished else len(self.output_text) - self._held_back()
        if not delta:
            return self.output_text[:end]
        if end <= self._sent:
            return ""
        text = self.output_text[self._sent:end]
        self._sent = end
        return text

    def decode_token(self, token_id: int) -> str | None:
        """The text of one token, for Logprob.decoded_token (None when not detokenizing)."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(
            token_ids,
            skip_special_tokens=self.params.skip_special_tokens,
            spaces_between_special_tokens=self.params.spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _context(self, prompt_token_ids: list[int]) -> list[int]:
        """The longest prompt tail (at most a few tokens) whose text ends on a whole
        character, so the first output tokens decode as they would after the prompt."""
        n = len(prompt_token_ids)
        for start in range(max(0, n - _CONTEXT_TOKENS), n):
            tail = list(prompt_token_ids[start:])
            if not self._decode(tail).endswith(_REPLACEMENT):
                return tail
        return []

    def _decode_next(self, token_id: int) -> str:
        self._token_ids.append(token_id)
        ids = self._token_ids
        prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(ids[self._prefix_offset:])
        is_added = token_id in self._added
        both_added = is_added and self._last_added
        self._last_added = is_added
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        if both_added and self._read_offset - self._prefix_offset == 1:
            return self._added[token_id]
        return full_text[len(prefix_text):]

    def _flush(self) -> None:
        """Emit what an unfinished trailing character held back (once the sequence ended)."""
        if self.tokenizer is None or self._stopped or self._read_offset == len(self._token_ids):
            return
        ids = self._token_ids
        prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(ids)
        check_from = len(self.output_text)
        self.output_text += full_text[len(prefix_text):]
        if self._num_output_tokens > self.params.min_tokens:
            self._check_stop(check_from)

    def _check_stop(self, check_from: int) -> str | None:
        """Find the earliest stop string ending past `check_from`; cut output_text there."""
        text = self.output_text
        if not self.stop or check_from >= len(text):
            return None
        best: tuple[int, str] | None = None
        for stop in self.stop:
            pos = text.find(stop, max(0, check_from - len(stop) + 1))
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return None
        pos, stop = best
        end = pos + len(stop) if self.params.include_stop_str_in_output else pos
        self.output_text = text[:end]
        self._stopped = True
        return stop

    def _held_back(self) -> int:
        """Length of the longest tail of output_text that is a proper prefix of a stop string.

        Such a tail is at most the last answer plus the characters added since (its part
        before them was such a tail then), and it ends with the text's last character: so a
        call checks only the lengths where a stop string has that character, up to that bound,
        and long stop strings cost no more than their matches grow."""
        if self._stopped or not self.stop or self.params.include_stop_str_in_output:
            return 0
        text = self.output_text
        bound = min(len(text), self._held + len(text) - self._held_at)
        best = 0
        for stop in self.stop:
            length = min(len(stop) - 1, bound)
            while length > best:
                length = stop.rfind(text[-1], 0, length) + 1  # stop[length - 1] == text[-1]
                if length <= best:
                    break
                if text.endswith(stop[:length]):
                    best = length
                    break
                length -= 1
        self._held, self._held_at = best, len(text)
        return best
