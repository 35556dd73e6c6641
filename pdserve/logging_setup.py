"""Logging for every pdserve server (`serve`, `router`, `prefill`, `decode`, `up`), set up in
one place from two flags:

    --log-level {critical,error,warning,info,debug}   (default info)
    --log-format {text,json}                          (default text)

text: `TIME LEVEL LOGGER: MESSAGE` lines on stderr. json: one JSON object per line on stderr,
with `time` (ISO 8601, UTC), `level`, `logger` and `message`, plus the record's structured
fields where it has them (a request's end: request_id, prompt_tokens, output_tokens, ttft_s,
...; periodic stats: tokens/s, requests, KV cache usage), and `exception` for a traceback.
In json mode Python warnings and transformers' messages go through the same handler, so that
every line a server writes is JSON.

`announce` writes a server's `... listening on ADDRESS` line: plain on stdout in text mode
(scripts wait for it), a log record in json mode; `report` does the same for a problem, on
stderr. Importing this module does not import torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from datetime import datetime, timezone
from typing import Any, TextIO

LEVELS = ("critical", "error", "warning", "info", "debug")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_BASE_KEYS = ("time", "level", "logger", "message")

logger = logging.getLogger("pdserve")
_format = "text"  # the format `setup_logging` last set up


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, then `extra={"fields":
    {...}}`'s entries (never replacing those four), exception and stack text if any."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc)
                            .isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update({k: v for k, v in fields.items() if k not in _BASE_KEYS})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def add_log_args(parser: argparse.ArgumentParser) -> None:
    """--log-level and --log-format."""
    parser.add_argument("--log-level", default="info", choices=LEVELS, type=str.lower,
                        help="the server's log level")
    parser.add_argument("--log-format", default="text", choices=FORMATS,
                        help="text lines, or one JSON object per line (time, level, logger, "
                             "message and the record's fields)")


def setup_logging(level: str = "info", fmt: str = "text", stream: TextIO | None = None) -> None:
    """Route every logger through one handler on `stream` (default stderr) in `fmt`, at
    `level`; calling it again replaces that handler. ValueError names the bad flag."""
    global _format
    if level.lower() not in LEVELS:
        raise ValueError(f"--log-level: expected one of {', '.join(LEVELS)}, got {level!r}")
    if fmt not in FORMATS:
        raise ValueError(f"--log-format: expected text or json, got {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    _format = fmt
    logging.captureWarnings(fmt == "json")
    if fmt == "json":
        _route_transformers()


def setup_from_args(args: argparse.Namespace) -> None:
    """setup_logging from the flags add_log_args added."""
    setup_logging(args.log_level, args.log_format)


def announce(message: str) -> None:
    """A server's `... listening on ...` line: stdout in text mode, a record in json mode."""
    if _format == "json":
        logger.info(message)
    else:
        print(message, flush=True)


def report(message: str, level: int = logging.WARNING) -> None:
    """A problem the user must see: on stderr as is in text mode, a record in json mode."""
    if _format == "json":
        logger.log(level, message)
    else:
        print(message, file=sys.stderr, flush=True)


def _route_transformers() -> None:
    """transformers logs through a handler of its own: send its records to ours instead."""
    if "transformers" not in sys.modules:
        try:
            import transformers  # noqa: F401 - servers load it for the tokenizer anyway
        except ImportError:
            return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
