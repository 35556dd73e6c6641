"""One chat choice's tool calls, per the request's tool_choice: "auto" reads them from free
text with the server's tool-call parser; "required" and a named function read the JSON that
structured outputs made the model write. Whole answers and stream deltas alike."""

from __future__ import annotations

from pdserve.gateway.tool_parsers import (
    get_tool_parser,
    named_tool_call,
    new_call_id,
    parse_required,
)


class ToolCallOutput:
    """Feed a choice's text (`feed`, then `finish`) for stream deltas, or read a whole text
    with `message`."""

    def __init__(self, tool_choice: str | dict, parser_name: str | None):
        self.required = tool_choice == "required"
        self.named = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
        self.parser = get_tool_parser(parser_name) if tool_choice == "auto" else None
        self._buffer = ""
        self._named_id: str | None = None
        self._required_sent = False

    @property
    def called(self) -> bool:
        """Whether the streamed deltas so far (`feed`, `finish`) held tool calls."""
        if self.parser is not None:
            return self.parser.called
        return self._named_id is not None or self._required_sent


    def message(self, text: str) -> dict:
        """The assistant message for a whole output: content and tool_calls."""
        if self.parser is not None:
            parsed = self.parser.parse(text)
            content, calls = parsed.content, parsed.tool_calls
        elif self.named is not None:
            content, calls = None, [named_tool_call(self.named, text)]
        else:
            try:
                content, calls = None, parse_required(text)
            except ValueError:  # cut short (length): hand the text over as it is
                content, calls = text, []
        msg: dict = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = [call.to_openai() for call in calls]
        return msg

    def feed(self, text: str) -> list[dict]:
        """Deltas to send for the next piece of text."""
        if self.parser is not None:
            return self.parser.feed(text)
        if self.named is None:
            self._buffer += text
            return []
        if not text:
            return []
        if self._named_id is None:
            self._named_id = new_call_id()
            return [{"tool_calls": [{"index": 0, "id": self._named_id, "type": "function",
                                     "function": {"name": self.named, "arguments": text}}]}]
        return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]

    def finish(self) -> list[dict]:
        """Deltas for what is left at the end of the output."""
        if self.parser is not None:
            return self.parser.finish()
        if self.named is not None or not self._buffer:
            return []
        calls = self._required_calls()
        if calls is None:
            return [{"content": self._buffer}]
        self._required_sent = True
        return [{"tool_calls": [{"index": i, **call.to_openai()}]}
                for i, call in enumerate(calls)]

    def _required_calls(self):
        try:
            return parse_required(self._buffer)
        except ValueError:
            return None
