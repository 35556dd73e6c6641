"""`pdserve --help` and `pdserve COMMAND --help`: no torch imported, every flag with help that
shows its default (and its values, where it takes one of a few); `pdserve --version`."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys

import pytest

from pdserve import version as version_mod
from pdserve.cli import build_parser
from pdserve.cli_help import HelpFormatter, subparsers
from pdserve.engine.engine_args import CHOICES

COMMANDS = ["generate", "prefill", "decode", "router", "up", "serve"]
HEAVY = ["torch", "transformers", "safetensors"]


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_help_imports_no_torch():
    code = f"""
import contextlib, io, json, sys
from pdserve.cli import main
for argv in [["--help"], ["--version"], *[[c, "--help"] for c in {COMMANDS!r}]]:
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
        except SystemExit as e:
            assert e.code == 0, (argv, e.code)
print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))
"""
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


def test_module_entry_point_help_imports_no_torch():
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "pdserve.cli", "serve",
                             "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage: pdserve serve" in result.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()}
    assert not imported & set(HEAVY)
    assert "pdserve.engine.engine_args" in imported  # importtime did report


def _help_text(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = parser._get_formatter()
    assert isinstance(formatter, HelpFormatter)
    return formatter._expand_help(action) if action.help else ""


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_has_help_and_shows_its_default(command):
    parser = subparsers(build_parser())[command]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        text = _help_text(parser, action)
        assert text.strip(), f"pdserve {command} {name}: no help"
        assert "default" in text.lower(), f"pdserve {command} {name}: no default in {text!r}"
        if action.choices:  # argparse shows them as {a,b,...}
            assert "{" in parser._get_formatter()._format_action_invocation(action)


def test_top_level_help_lists_commands_and_version():
    text = build_parser().format_help()
    assert "--version" in text
    for command in COMMANDS:
        assert command in text


def test_choice_fields_show_the_values_the_config_accepts():
    from pdserve.config import _DTYPES, SchedulerConfig
    from pdserve.models.loader import TOKENIZER_MODES

    serve = subparsers(build_parser())["serve"]
    usage = serve.format_usage()
    for field, values in CHOICES.items():
        assert "{" + ",".join(values) + "}" in usage, field
    assert set(CHOICES["dtype"]) - {"auto"} <= set(_DTYPES)
    assert CHOICES["tokenizer_mode"] == TOKENIZER_MODES
    for policy in CHOICES["scheduling_policy"]:
        SchedulerConfig(policy=policy)
    for policy in CHOICES["kv_failure_policy"]:
        SchedulerConfig(kv_failure_policy=policy)
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(policy="lifo")


def test_version_flag_prints_the_package_version():
    result = subprocess.run([sys.executable, "-m", "pdserve.cli", "--version"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"pdserve {importlib.metadata.version('pdserve')}\n"


def test_version_falls_back_to_pyproject(monkeypatch, tmp_path):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert version_mod.version() == version_mod.pyproject_version()
    assert version_mod.version() not in ("", version_mod.UNKNOWN)
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "pdserve"\nversion = "9.8.7"\n')
    assert version_mod.pyproject_version(pyproject) == "9.8.7"
    assert version_mod.pyproject_version(tmp_path / "missing.toml") == version_mod.UNKNOWN


def test_up_takes_the_engine_flags_and_passes_them_to_every_instance():
    from pdserve.cli import build_parser
    from pdserve.cluster_cli import engine_flags

    args = build_parser().parse_args(
        ["up", "--num-decode", "2", "--dtype", "float32", "--max-num-seqs", "4",
         "--no-enable-prefix-caching", "--served-model-name", "a", "b"])
    flags = engine_flags(args)
    assert flags == ["--dtype", "float32", "--no-enable-prefix-caching", "--max-num-seqs", "4",
                     "--served-model-name", "a", "b"]
    # What an instance's own parser makes of them: the same values.
    instance = build_parser().parse_args(["decode", *flags])
    assert (instance.dtype, instance.max_num_seqs, instance.enable_prefix_caching) == \
        ("float32", 4, False)
    assert instance.served_model_name == ["a", "b"]
    assert engine_flags(build_parser().parse_args(["up"])) == []  # defaults stay implicit


def test_up_gives_its_gateway_the_tokenizer_flags_and_tool_calling():
    from pdserve.cli import build_parser
    from pdserve.cluster_cli import gateway_flags

    args = build_parser().parse_args(
        ["up", "--dtype", "float32", "--chat-template", "t.jinja", "--max-logprobs", "5",
         "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    flags = gateway_flags(args)
    assert flags == ["--chat-template", "t.jinja", "--max-logprobs", "5",
                     "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    gateway = build_parser().parse_args(["serve", "--router", "127.0.0.1:1", *flags])
    assert (gateway.chat_template, gateway.tool_call_parser) == ("t.jinja", "hermes")
    no_parser = build_parser().parse_args(["up", "--enable-auto-tool-choice"])
    with pytest.raises(ValueError, match="tool_call_parser"):
        gateway_flags(no_parser)
