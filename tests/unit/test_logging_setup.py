"""logging_setup: the JSON formatter, one handler for every logger, and the lines servers
announce (plain in text mode, records in json mode)."""

from __future__ import annotations

import io
import json
import logging
from datetime import datetime

import pytest

from pdserve import logging_setup
from pdserve.logging_setup import JsonFormatter, announce, report, setup_logging


def record(msg="hello %s", args=("world",), level=logging.WARNING, **extra):
    rec = logging.LogRecord("pdserve.test", level, __file__, 1, msg, args, None)
    rec.__dict__.update(extra)
    return rec


def test_json_formatter_writes_one_object_with_the_four_keys():
    line = JsonFormatter().format(record())
    assert "\n" not in line
    entry = json.loads(line)
    assert list(entry) == ["time", "level", "logger", "message"]
    assert entry["level"] == "WARNING" and entry["logger"] == "pdserve.test"
    assert entry["message"] == "hello world"
    assert datetime.fromisoformat(entry["time"]).utcoffset().total_seconds() == 0


def test_json_formatter_adds_fields_but_never_replaces_the_base_keys():
    entry = json.loads(JsonFormatter().format(record(
        fields={"request_id": "r1", "output_tokens": 5, "message": "spoofed", "ttft_s": None})))
    assert entry["message"] == "hello world"
    assert entry["request_id"] == "r1" and entry["output_tokens"] == 5
    assert entry["ttft_s"] is None


def test_json_formatter_keeps_multiline_messages_and_tracebacks_on_one_line():
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        import sys

        rec = record("line one\nline two", (), exc_info=sys.exc_info())
    line = JsonFormatter().format(rec)
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["message"] == "line one\nline two"
    assert "RuntimeError: boom" in entry["exception"]


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)
    logging.captureWarnings(False)
    logging_setup._format = "text"


def test_setup_logging_json_routes_every_logger_and_replaces_its_handler(restore_logging,
                                                                         capsys):
    stream = io.StringIO()
    setup_logging("info", "json", stream=stream)
    setup_logging("info", "json", stream=stream)  # again: still one handler
    assert len(logging.getLogger().handlers) == 1
    logging.getLogger("uvicorn.error").info("started")
    logging.getLogger("pdserve.x").debug("hidden at info")
    announce("router listening on 127.0.0.1:1")
    report("warning: decode-0 exited")
    entries = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(e["logger"], e["message"]) for e in entries] == [
        ("uvicorn.error", "started"), ("pdserve", "router listening on 127.0.0.1:1"),
        ("pdserve", "warning: decode-0 exited")]
    assert capsys.readouterr().out == ""


def test_setup_logging_text_keeps_announcements_plain_on_stdout(restore_logging, capsys):
    stream = io.StringIO()
    setup_logging("warning", "text", stream=stream)
    logging.getLogger("pdserve.x").info("hidden at warning")
    logging.getLogger("pdserve.x").warning("shown")
    announce("pdserve gateway listening on http://127.0.0.1:8000")
    report("error: something")
    captured = capsys.readouterr()
    assert captured.out == "pdserve gateway listening on http://127.0.0.1:8000\n"
    assert captured.err == "error: something\n"
    assert stream.getvalue().rstrip("\n").endswith("WARNING pdserve.x: shown")
    assert "hidden" not in stream.getvalue()


@pytest.mark.parametrize("level,fmt,flag", [("loud", "text", "--log-level"),
                                            ("info", "xml", "--log-format")])
def test_bad_values_name_the_flag(level, fmt, flag):
    with pytest.raises(ValueError, match=flag):
        setup_logging(level, fmt)
