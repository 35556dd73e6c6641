"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import NoReturn

from pdserve.cli_help import HelpFormatter, finish_help
from pdserve.cpu_budget import add_cpu_args, apply_cpu_budget, cores_from_args
from pdserve.cpu_turns import use_cpu_turns
from pdserve.engine.engine_args import EngineArgs
from pdserve.parent_watch import watch_parent
from pdserve.process_exit import exit_now
from pdserve.ports import PortInUse, check_bindable
from pdserve.version import version
from pdserve.vllm_argv import normalize_argv


def _generate(args: argparse.Namespace) -> int:
    from pdserve.sampling_params import SamplingParams

    # checked before the model loads: a bad value fails at once
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.sampling_seed)
    from pdserve import LLM

    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    print(outputs[0].outputs[0].text)
    return 0


# Modules that register a subcommand with `add_cli(subparsers)`. Importing them must not
# import torch (tests/unit/test_cli_help.py checks): --help stays fast.
_SUBCOMMANDS = ["pdserve.services.prefill_server", "pdserve.services.decode_server",
                "pdserve.router.server", "pdserve.cluster_cli", "pdserve.gateway.server"]
# The ports each server listens on, as (dest, flag): checked before any model is loaded.
_LISTEN_PORTS = {"serve": [("port", "--port")], "prefill": [("port", "--port")],
                 "decode": [("port", "--port")], "router": [("grpc_port", "--grpc-port")],
                 "up": [("grpc_port", "--grpc-port"), ("port", "--port")]}


def build_parser() -> argparse.ArgumentParser:
    """The `pdserve` parser, with every subcommand."""
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}",
                        help="print pdserve's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = sub.add_parser("generate", help="generate text for one prompt with a local engine")
    gen.add_argument("--prompt", required=True, help="the prompt (required)")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's mass")
    gen.add_argument("--sampling-seed", type=int, default=None,
                     help="this request's seed (default: the engine's --seed)")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    add_cpu_args(gen)
    EngineArgs.add_cli_args(gen)
    gen.set_defaults(func=_generate)
    for module in _SUBCOMMANDS:
        importlib.import_module(module).add_cli(sub)
    finish_help(parser)
    return parser


def check_ports(args: argparse.Namespace) -> None:
    """Fail now, not after loading a model, if a server's port is taken (ports.PortInUse)."""
    for dest, flag in _LISTEN_PORTS.get(args.command, []):
        check_bindable(args.host, getattr(args, dest), flag)


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand: its errors become one `error: ...` line on stderr, exit code 2 for
    a bad value (ValueError), 1 for a busy port. vLLM's spellings (`--max_model_len`) and
    `--config FILE.yaml` are read as `vllm serve` reads them."""
    parser = build_parser()
    try:
        argv = normalize_argv(sys.argv[1:] if argv is None else list(argv), parser)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        if args.command != "up":  # up's --cpu-cores are the pool it shares out
            watch_parent()  # a child of `pdserve up` stops with it
            apply_cpu_budget(cores_from_args(args))
            use_cpu_turns(getattr(args, "cpu_turns", None))
        check_ports(args)
        return args.func(args)
    except PortInUse as e:
        _error(e, args)
        return 1
    except ValueError as e:
        _error(e, args)
        return 2
    except KeyboardInterrupt:
        return 130


def _error(e: Exception, args: argparse.Namespace) -> None:
    """One line on stderr, however many lines the message had (transformers' often do); a
    JSON record with --log-format json."""
    message = "error: " + " ".join(str(e).split())
    if getattr(args, "log_format", "text") == "json":
        from pdserve.logging_setup import report, setup_logging

        setup_logging(getattr(args, "log_level", "info"), "json")
        report(message, logging.ERROR)
    else:
        print(message, file=sys.stderr)


def run() -> NoReturn:
    """The `pdserve` command: `main`, then the process ends at once (process_exit)."""
    exit_now(main())


if __name__ == "__main__":
    run()
