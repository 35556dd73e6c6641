"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import importlib
import sys

from pdserve.engine.engine_args import EngineArgs


def _generate(args: argparse.Namespace) -> int:
    from pdserve import LLM, SamplingParams

    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.sampling_seed)
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    print(outputs[0].outputs[0].text)
    return 0


# Modules that register a subcommand with `add_cli(subparsers)`.
_SUBCOMMANDS = ["pdserve.services.prefill_server", "pdserve.services.decode_server",
                "pdserve.router.server", "pdserve.cluster", "pdserve.gateway.server"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt with a local engine")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    EngineArgs.add_cli_args(gen)
    gen.set_defaults(func=_generate)
    for module in _SUBCOMMANDS:
        importlib.import_module(module).add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
