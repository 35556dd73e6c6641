"""Relay of a decode instance's stream to the client.

A decode call may start after the client already has part of sequence 0: the first token of a
disaggregated prefill, or every token a failed decode instance streamed before it died (the
request then continues elsewhere: migration). The decode side's first message repeats those
tokens (their ids, their text as a prefix of the message's text, and empty logprobs entries),
so that message is stripped of exactly those. The relay also records what it forwards, which is
where a migration continues from. The last message gets the request's usage (tokens the client
received; cached tokens as the prefill side reported them) and `served_by`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pdserve.proto.pdserve.v1 import common_pb2, engine_pb2

logger = logging.getLogger(__name__)


@dataclass
class Continuation:
    """What the client has received of sequence 0: enough to continue it on another
    instance, and to tell the repeated part of that instance's first message."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    cumulative_logprob: float = 0.0

    def decode_request(self, request_id: str, prompt_ids: list[int],
                       sampling: common_pb2.SamplingParams) -> engine_pb2.DecodeRequest:
        """A Decode call that recomputes the prompt and these tokens, then continues."""
        return engine_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt_ids,
                                        sampling=sampling, output_token_ids=self.token_ids)


class BrokenDecodeStream(ValueError):
    """D sent a message no decode of this request can send."""


class Relay:
    """Turns D's messages into the client's; one Relay per Decode call."""

    def __init__(self, request_id: str, prompt_ids: list[int], n: int,
                 served: common_pb2.ServedBy, sent: Continuation | None = None,
                 cached_tokens: int = 0):
        """`sent`: what the client already has of sequence 0 (None: nothing at all, not even
        a first message)."""
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.served = served
        self.cached_tokens = cached_tokens
        self.received = False  # D sent something (a retry elsewhere is no longer possible)
        self.n = n
        self.unfinished = set(range(n))
        self.sent = Continuation(list(sent.token_ids), sent.text,
                                 sent.cumulative_logprob) if sent else Continuation()
        self.completion_tokens = len(self.sent.token_ids)
        self._repeated = Continuation(list(self.sent.token_ids), self.sent.text)
        # D's cumulative logprob counts only the tokens it sampled: add those before them.
        self._base_logprob = self.sent.cumulative_logprob
        self._sent_first = sent is not None

    @property
    def complete(self) -> bool:
        return not self.unfinished

    @property
    def missing(self) -> list[int]:
        return sorted(self.unfinished)

    def forward(self, msg: common_pb2.GenerateResponse) -> common_pb2.GenerateResponse | None:
        """The client's version of `msg`, or None when nothing is left to send;
        BrokenDecodeStream for a message of no sequence of this request."""
        if not 0 <= msg.index < self.n:
            raise BrokenDecodeStream(f"index: {msg.index} is outside [0, {self.n})")
        self.received = True
        out = common_pb2.GenerateResponse()
        out.CopyFrom(msg)
        out.request_id = self.request_id
        if self._repeated.token_ids and msg.index == 0 and msg.token_ids:
            self._strip_repeated(out)
        if out.index == 0:
            self.sent.token_ids.extend(out.token_ids)
            self.sent.text += out.text
            out.cumulative_logprob += self._base_logprob
            self.sent.cumulative_logprob = out.cumulative_logprob
        self.completion_tokens += len(out.token_ids)
        if out.finish_reason:
            self.unfinished.discard(out.index)
        last = out.HasField("usage") or self.complete
        if last:
            out.usage.prompt_tokens = len(self.prompt_ids)
            out.usage.completion_tokens = self.completion_tokens
            if self.cached_tokens:
                out.usage.cached_tokens = self.cached_tokens
        with_served_by = last
        if not self._sent_first:  # D prefilled: this is the client's first message
            if not out.prompt_token_ids:
                out.prompt_token_ids.extend(self.prompt_ids)
            self._sent_first = with_served_by = True
        if with_served_by:
            out.served_by.CopyFrom(self.served)
        if not (out.token_ids or out.text or out.logprobs or out.finish_reason
                or out.HasField("usage") or out.HasField("served_by")):
            return None
        return out

    def _strip_repeated(self, out: common_pb2.GenerateResponse) -> None:
        """Drop from D's first message the tokens, text and logprobs the client has."""
        repeated = self._repeated
        n = len(repeated.token_ids)
        if list(out.token_ids[:n]) != repeated.token_ids:
            logger.warning("request %s: the decode stream does not repeat the %d tokens the "
                           "client has", self.request_id, n)
        del out.token_ids[:n]
        if out.text.startswith(repeated.text):
            out.text = out.text[len(repeated.text):]
        else:
            logger.warning("request %s: the decode stream's text does not start with the "
                           "text the client has", self.request_id)
        del out.logprobs[:n]
        out.ClearField("prompt_token_ids")  # the first message had them
        repeated.token_ids = []
