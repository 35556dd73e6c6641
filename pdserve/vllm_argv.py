"""vLLM's command-line conventions, applied before argparse sees the arguments: flags spelled
with underscores (`--max_model_len 1024`), and `--config FILE.yaml`, whose keys become flags
that the command line's own flags override (as `vllm serve` reads them)."""

from __future__ import annotations

from typing import Any

MAX_CONFIG_BYTES = 1 << 20


def normalize_argv(argv: list[str]) -> list[str]:
    """`argv` with --config expanded and flag names' underscores turned into dashes."""
    argv = [_dashes(a) for a in argv]
    if "--config" not in argv and not any(a.startswith("--config=") for a in argv):
        return argv
    out: list[str] = []
    config_args: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" or arg.startswith("--config="):
            path = arg.partition("=")[2] if "=" in arg else (
                argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in arg else 2
            config_args += config_flags(path)
            continue
        out.append(arg)
        i += 1
    # After the subcommand (and its positional model, if one comes first): the command
    # line's flags come later and win.
    at = 1 if out and not out[0].startswith("-") else 0
    if at and len(out) > at and not out[at].startswith("-"):
        at += 1
    return out[:at] + config_args + out[at:]


def config_flags(path: str) -> list[str]:
    """The flags a YAML config file stands for: `key: value` is `--key value`, `key: true`
    is `--key` (false: `--no-key`), a list gives its items after the flag, a mapping is
    passed as JSON. ValueError naming --config for a file that cannot be read."""
    import json

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
    flags: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + flag[2:])
        elif isinstance(value, list):
            flags += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def _dashes(arg: str) -> str:
    """`--max_model_len=5` -> `--max-model-len=5`; anything else as it is."""
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value
