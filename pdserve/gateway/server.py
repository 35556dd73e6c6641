"""`pdserve serve`: one colocated engine behind the OpenAI-format HTTP API, until SIGTERM or
Ctrl-C.

    pdserve serve [MODEL | --model MODEL] --port 8000 [--api-key K] [--max-concurrency N]
    pdserve serve --model M --router 127.0.0.1:50051      # only the HTTP front of a cluster

The engine flags are EngineArgs' (vLLM's names: --served-model-name, --chat-template,
--max-logprobs, --enforce-eager, ...).

Also `python -m pdserve.gateway.server [flags]`. `add_gateway_args` and `serve_http` are
shared with `pdserve up`, which puts the same app in front of a router.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys

from pdserve.cpu_budget import add_cpu_args
from pdserve.engine.engine_args import EngineArgs
from pdserve.gateway.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CONCURRENCY
from pdserve.gateway.tool_parsers import TOOL_PARSERS
from pdserve.gateway.vllm_serve_args import (add_cors, add_vllm_serve_args,
                                             check_vllm_serve_args, install_middleware,
                                             load_middleware, uvicorn_options)
from pdserve.logging_setup import add_log_args, announce, setup_from_args
from pdserve.models.loader import DEFAULT_MODEL
from pdserve.process_exit import exit_now
from pdserve.services.auth import API_KEY_ENV, Credentials, add_credential_args

DEFAULT_PORT = 8000
VLLM_API_KEY_ENV = "VLLM_API_KEY"  # what vLLM users set: protects the API here too
GRACEFUL_SHUTDOWN_S = 5
logger = logging.getLogger(__name__)


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    """The HTTP front's flags (not the engine's)."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 picks a free port")
    parser.add_argument("--api-key", action="extend", nargs="+", default=[], metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on /v1/* (several: any of "
                             f"them; also ${API_KEY_ENV} or $VLLM_API_KEY, comma-separated; "
                             "off by default)")
    parser.add_argument("--api-key-file", default=None, metavar="PATH",
                        help="file of accepted API keys, one per line (keeps them off the "
                             "command line)")
    parser.add_argument("--max-concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY,
                        help="backend requests in flight (one per prompt, beam or embedding "
                             "input) beyond which new requests get HTTP 429")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="larger request bodies get HTTP 413")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='allow tool_choice "auto" (needs --tool-call-parser)')
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                        help="how tool calls are read from a model's free text for "
                             "tool_choice \"auto\": hermes (<tool_call> JSON blocks) or "
                             "llama3_json (default: none)")
    add_log_args(parser)
    add_vllm_serve_args(parser)


def gateway_api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """The keys /v1/* accepts: $PDSERVE_API_KEY's, --api-key's and --api-key-file's; vLLM's
    $VLLM_API_KEY when no --api-key is given (as vLLM, where the flag wins)."""
    names = (API_KEY_ENV,) if args.api_key else (API_KEY_ENV, VLLM_API_KEY_ENV)
    env = ",".join(os.environ.get(name, "") for name in names)
    return Credentials.load(None, tuple(args.api_key), args.api_key_file,
                            env={API_KEY_ENV: env}).api_keys


def tool_parser_from_args(args: argparse.Namespace) -> str | None:
    """The tool-call parser for tool_choice "auto", or None when it is not enabled."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("tool_call_parser: --enable-auto-tool-choice needs --tool-call-parser")
    return args.tool_call_parser if args.enable_auto_tool_choice else None


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (so the real port is known, and early clients wait in the backlog)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(512)
    sock.set_inheritable(True)
    return sock


def serve_http(app, host: str, port: int, log_level: str = "info", **options) -> int:
    """Serve `app` until SIGTERM/SIGINT (uvicorn handles both, then runs app shutdown).
    uvicorn logs through pdserve's handler (logging_setup), in its format; `options` are more
    uvicorn.Config arguments (vllm_serve_args.uvicorn_options)."""
    import uvicorn

    sock = bind(host, port)
    scheme = "https" if options.get("ssl_keyfile") else "http"
    url = f"{scheme}://{host}:{sock.getsockname()[1]}"
    description = getattr(app.state, "description", None)
    if description:
        logger.info("serving %s; OpenAI API on %s/v1", description, url)
    options = {"log_level": log_level, **options}
    config = uvicorn.Config(app, access_log=options["log_level"] in ("debug", "trace"),
                            log_config=None, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                            **options)
    server = uvicorn.Server(config)

    def stop(*_) -> None:
        server.should_exit = True

    # A SIGTERM/SIGINT before uvicorn takes the signals over stops it as soon as it has
    # started (app startup, then shutdown); uvicorn re-sends the signals it caught to this
    # handler when it ends, where they change nothing: a requested stop exits 0 like the
    # other pdserve servers.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    announce(f"pdserve gateway listening on {url}")
    server.run(sockets=[sock])
    return 0


def serve_engine_args(args: argparse.Namespace) -> EngineArgs:
    """The engine options of `pdserve serve`; the model given as `pdserve serve MODEL` (as
    `vllm serve MODEL`) or as --model."""
    engine_args = EngineArgs.from_cli_args(args)
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if engine_args.model not in (DEFAULT_MODEL, tag):
            raise ValueError(f"model: given twice, as {tag!r} and as --model "
                             f"{engine_args.model!r}")
        engine_args.model = tag
    return engine_args


def build_serve_app(args: argparse.Namespace):
    """The app `pdserve serve` serves: over a local engine, or over a cluster's router."""
    from pdserve.engine import vllm_args
    from pdserve.gateway.app import build_app
    from pdserve.models.loader import load_tokenizer, resolve_model

    check_vllm_serve_args(args)
    middleware = load_middleware(args.middleware)
    engine_args = serve_engine_args(args)
    if args.router:
        from pdserve.gateway.router_backend import RouterBackend

        resolved = resolve_model(engine_args.model, engine_args.revision)
        vllm_args.check_args(engine_args, resolved)
        tok = engine_args.create_tokenizer_config(resolved)
        from pdserve.services.auth import credentials_from_args

        from pdserve.engine.generation_defaults import max_tokens_cap, sampling_defaults

        defaults = sampling_defaults(resolved, engine_args.generation_config,
                                     engine_args.override_generation_config)
        cap = max_tokens_cap(defaults, engine_args.generation_config,
                             engine_args.override_generation_config)
        backend = RouterBackend(args.router, engine_args.model, engine_args.max_model_len,
                                credentials=credentials_from_args(args),
                                sampling_defaults=defaults, max_tokens_cap=cap,
                                revision=engine_args.revision)
        tokenizer = load_tokenizer(tok.source, tok.mode, tok.chat_template)
        names = vllm_args.served_names(engine_args.served_model_name) or (engine_args.model,)
        description = f"{names[0]} through the router at {args.router}"
    else:
        from pdserve.gateway.local_backend import LocalBackend

        backend = LocalBackend.from_engine_args(engine_args)
        tokenizer = None  # the backend's: the engine's tokenizer and chat template
        names = backend.engine.config.model.served_model_name or (backend.model,)
        description = backend.engine.describe()
    app = build_app(backend, names, gateway_api_keys(args), tokenizer=tokenizer,
                    max_logprobs=engine_args.max_logprobs,
                    tool_parser=tool_parser_from_args(args),
                    max_concurrency=args.max_concurrency, max_body_bytes=args.max_body_bytes,
                    return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                    response_role=args.response_role)
    add_cors(app, args)
    install_middleware(app, middleware)
    app.state.description = description  # serve_http's startup line
    return app


def run_serve(args: argparse.Namespace) -> int:
    setup_from_args(args)
    options = uvicorn_options(args)
    level = options.pop("log_level", args.log_level)  # --uvicorn-log-level, else --log-level
    return serve_http(build_serve_app(args), args.host, args.port, level, **options)


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve one colocated engine behind the "
                                            "OpenAI-format HTTP API")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model (as `vllm serve MODEL`); the same as --model")
    add_gateway_args(p)
    p.add_argument("--router", default=None, metavar="ADDR",
                   help="no local engine: serve a cluster's router at ADDR (host:port); "
                        "of the engine flags only --model, --max-model-len and the "
                        "gateway's (--tokenizer, --tokenizer-mode, --chat-template, "
                        "--served-model-name, --max-logprobs) are then used")
    add_credential_args(p)  # for --router: the cluster's secret
    add_cpu_args(p)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_serve)


def main(argv: list[str] | None = None) -> int:
    """`python -m pdserve.gateway.server ...`: the same as `pdserve serve ...`."""
    from pdserve.cli import main as cli_main

    return cli_main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    exit_now(main())
