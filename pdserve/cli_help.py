"""How `pdserve ... --help` reads: every flag with a line of help, its default and, where it
takes one of a few values, those values (`{a,b}`, from argparse's choices or a metavar).

The subcommands' modules register their own flags; `finish_help` fills in the help of the flags
they leave without one, from FLAG_HELP, and gives every parser the same formatter.
"""

from __future__ import annotations

import argparse

# Help for flags registered without one, by destination; ("command", dest) for one command.
FLAG_HELP: dict[str | tuple[str, str], str] = {
    "host": "the address to listen on (0.0.0.0: every interface)",
    "connector": "how KV blocks move from prefill to decode instances (shm: on one host; "
                 "none: no transfer, colocated only)",
    "instance_id": "this instance's name at the router (default: ROLE-RANDOM)",
    "prefill_attempts": "prefill instances tried for a prompt before the decode instance "
                        "prefills it itself",
    "prefill_timeout_s": "seconds one Prefill call may take before another is tried",
    ("up", "model"): "the model every instance serves (a name, a Hugging Face directory or a "
                     ".gguf file)",
    ("up", "num_prefill"): "prefill instances to start (0: decode instances prefill)",
    ("up", "num_decode"): "decode instances to start",
    ("up", "disagg_threshold"): "uncached prompt tokens from which a prompt is prefilled on a "
                                "prefill instance (0: always)",
    ("up", "kv_cache_memory_bytes"): "each instance's KV cache in bytes (default: 4 GiB on "
                                     "CPU, an error if not available; on CUDA what "
                                     "gpu_memory_utilization leaves)",
    ("up", "kv_cache_memory_fraction"): "each instance's KV cache as a share of memory "
                                        "instead: of total RAM on CPU, of the GPU's memory "
                                        "(weights included) on CUDA (default: none)",
    ("up", "redis_url"): "share the prefix index through this Redis (default: the router's, "
                         "in memory)",
    ("up", "startup_timeout_s"): "seconds every process has to become ready",
    ("up", "log_dir"): "where each process writes its log (default: a new temporary directory)",
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, less the default where the help already tells it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text.lower():
            return text
        return super()._get_help_string(action)


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser's subcommands by name (empty if it has none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def finish_help(parser: argparse.ArgumentParser) -> None:
    """Give `parser` and its subcommands HelpFormatter, and FLAG_HELP's help to the flags that
    have none."""
    parser.formatter_class = HelpFormatter
    for command, sub in subparsers(parser).items():
        sub.formatter_class = HelpFormatter
        for action in sub._actions:
            if action.help is None:
                action.help = FLAG_HELP.get((command, action.dest), FLAG_HELP.get(action.dest))
