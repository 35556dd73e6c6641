"""Relay of a decode instance's stream to the client.

After a disaggregated prefill the router has already sent the first token; the decode side's
first message repeats it (its token id, its text as a prefix of the message's text, and an
empty logprobs entry), so that message is stripped of exactly those. The last message gets the
request's usage (tokens the client received; cached tokens as the prefill side reported them
when it prefilled) and `served_by`.
"""

from __future__ import annotations

import logging

from pdserve.proto.pdserve.v1 import common_pb2, engine_pb2

logger = logging.getLogger(__name__)


class Relay:
    """Turns D's messages into the client's; one Relay per Decode call."""

    def __init__(self, request_id: str, prompt_ids: list[int], n: int,
                 served: common_pb2.ServedBy, first: engine_pb2.PrefillResponse | None = None):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.served = served
        self.first = first
        self.received = False  # D sent something (a retry elsewhere is no longer possible)
        self.unfinished = set(range(n))
        self.completion_tokens = 1 if first is not None else 0
        self._strip_pending = first is not None
        self._sent_first = first is not None

    @property
    def complete(self) -> bool:
        return not self.unfinished

    @property
    def missing(self) -> list[int]:
        return sorted(self.unfinished)

    def forward(self, msg: common_pb2.GenerateResponse) -> common_pb2.GenerateResponse | None:
        """The client's version of `msg`, or None when nothing is left to send."""
        self.received = True
        out = common_pb2.GenerateResponse()
        out.CopyFrom(msg)
        out.request_id = self.request_id
        if self._strip_pending and msg.index == 0 and msg.token_ids:
            self._strip_first(out)
        self.completion_tokens += len(out.token_ids)
        if out.finish_reason:
            self.unfinished.discard(out.index)
        last = out.HasField("usage") or self.complete
        if last:
            out.usage.prompt_tokens = len(self.prompt_ids)
            out.usage.completion_tokens = self.completion_tokens
            if self.first is not None:
                out.usage.cached_tokens = self.first.num_cached_tokens
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

    def _strip_first(self, out: common_pb2.GenerateResponse) -> None:
        self._strip_pending = False
        if out.token_ids[0] != self.first.first_token_id or \
                not out.text.startswith(self.first.first_text):
            logger.warning("request %s: the decode stream does not repeat the first token "
                           "(%d %r)", self.request_id, self.first.first_token_id,
                           self.first.first_text)
        del out.token_ids[0]
        out.text = out.text[len(self.first.first_text):]
        if out.logprobs:
            del out.logprobs[0]
        out.ClearField("prompt_token_ids")  # the first message had them
