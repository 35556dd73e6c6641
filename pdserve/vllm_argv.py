"""vLLM's command-line conventions, applied before argparse parses the arguments: flags spelled
with underscores (`--max_model_len 1024`), and `--config FILE.yaml`, whose keys become flags
that the command line's own flags override (as `vllm serve` reads them)."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

MAX_CONFIG_BYTES = 1 << 20
_FLAG = re.compile(r"--[A-Za-z][A-Za-z0-9_-]*")


def normalize_argv(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`argv` with --config expanded and flag names' underscores turned into dashes. `parser`
    (with subcommands) tells how each flag of a config file takes its value."""
    argv = [_dashes(a) for a in argv]
    out: list[str] = []
    configs: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" or arg.startswith("--config="):
            configs.append(arg.partition("=")[2] if "=" in arg else
                           (argv[i + 1] if i + 1 < len(argv) else ""))
            i += 1 if "=" in arg else 2
            continue
        out.append(arg)
        i += 1
    if not configs:
        return out
    # After the subcommand and its positional model, if one comes first: the command line's
    # flags come later and win, and a positional model wins over the file's `model`.
    at = 1 if out and not out[0].startswith("-") else 0
    positional = at and len(out) > at and not out[at].startswith("-")
    sub = _subparser(parser, out[0]) if at else parser
    config_args = [flag for path in configs
                   for flag in config_flags(path, sub, skip={"model"} if positional else set())]
    at += 1 if positional else 0
    return out[:at] + config_args + out[at:]


def config_flags(path: str, parser: argparse.ArgumentParser | None = None,
                 skip: set[str] = frozenset()) -> list[str]:
    """The flags a YAML config file stands for: `key: value` is `--key=value`; `key: true` is
    `--key`, `false` is `--no-key` where the flag has that form and nothing otherwise; a list
    gives its items after a flag taking several values, else it is passed as JSON, as is a
    mapping. ValueError naming --config for a file that cannot be read."""
    import yaml

    if not path:
        raise ValueError("--config: expected a YAML file's path")
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_CONFIG_BYTES + 1)
        if len(text) > MAX_CONFIG_BYTES:
            raise ValueError(f"larger than {MAX_CONFIG_BYTES} bytes")
        data: Any = yaml.safe_load(text) or {}
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise ValueError(f"--config: cannot read {path!r}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config: {path!r} must hold a mapping of option names to values")
    actions = parser._option_string_actions if parser is not None else {}
    flags: list[str] = []
    for key, value in data.items():
        if str(key) in skip or value is None:
            continue
        flag = "--" + str(key).replace("_", "-")
        action = actions.get(flag)
        if value is True:
            flags.append(flag)
        elif value is False:
            if "--no-" + flag[2:] in actions:
                flags.append("--no-" + flag[2:])
        elif isinstance(value, list) and action is not None and action.nargs in ("+", "*"):
            flags += [flag, *(str(v) for v in value)]
        elif isinstance(value, list | dict):
            flags.append(f"{flag}={json.dumps(value)}")
        else:
            flags.append(f"{flag}={value}")
    return flags


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(command)
    return None


def _dashes(arg: str) -> str:
    """`--max_model_len=5` -> `--max-model-len=5`; anything else (a value with spaces, such as
    a prompt) as it is."""
    name, eq, value = arg.partition("=")
    if not _FLAG.fullmatch(name):
        return arg
    return name.replace("_", "-") + eq + value
