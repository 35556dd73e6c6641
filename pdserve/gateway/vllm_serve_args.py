"""`vllm serve`'s HTTP-server flags on `pdserve serve`: those with a meaning here do what they
do in vLLM (uvicorn's log level, root path and TLS; CORS; extra ASGI middleware), those that
change nothing here are accepted with one log line saying why, and those asking for what
pdserve does not do are a ValueError naming the flag."""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import logging
from typing import Any

logger = logging.getLogger("pdserve")
UVICORN_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# Flags accepted and changing nothing here: flag -> why.
_NO_OPS = {
    "enable_log_requests": "pdserve logs every request's end (id, tokens, finish reason)",
    "disable_log_requests": "pdserve logs every request's end, one line each; raise "
                            "--log-level to warning to silence them",
    "enable_prompt_tokens_details": "usage always has prompt_tokens_details (cached tokens)",
}


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError("expected a JSON list of strings")
    return value


def add_vllm_serve_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's serve flags for the HTTP server (the engine's are EngineArgs')."""
    parser.add_argument("--uvicorn-log-level", type=str.lower, choices=UVICORN_LEVELS,
                        default=None, help="uvicorn's log level (default: --log-level)")
    parser.add_argument("--root-path", default=None,
                        help="the path prefix a proxy in front serves the API under")
    parser.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this key")
    parser.add_argument("--ssl-certfile", default=None, help="... and this certificate")
    parser.add_argument("--ssl-ca-certs", default=None,
                        help="the CA file of client certificates to accept")
    parser.add_argument("--ssl-cert-reqs", type=int, default=0, choices=(0, 1, 2),
                        help="client certificates: 0 not asked for, 1 optional, 2 required "
                             "(Python's ssl.CERT_*), as vLLM's")
    parser.add_argument("--allowed-origins", type=_json_list, default=None, metavar="JSON",
                        help="CORS: origins browsers may call from, e.g. '[\"*\"]' (default: "
                             "no CORS headers, unlike vLLM, whose default allows any origin)")
    parser.add_argument("--allowed-methods", type=_json_list, default=["*"], metavar="JSON",
                        help="CORS: methods allowed (with --allowed-origins)")
    parser.add_argument("--allowed-headers", type=_json_list, default=["*"], metavar="JSON",
                        help="CORS: headers allowed (with --allowed-origins)")
    parser.add_argument("--allow-credentials", action="store_true",
                        help="CORS: allow credentials (with --allowed-origins)")
    for name, why in _NO_OPS.items():
        parser.add_argument("--" + name.replace("_", "-"), action="store_true",
                            help=f"accepted for vLLM compatibility: {why}")
    parser.add_argument("--response-role", default="assistant",
                        help="the role of chat completions' messages (when the request adds a "
                             "generation prompt; else the last message's role)")
    parser.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help="logprobs name tokens \"token_id:<id>\" instead of their text (a "
                             "request's return_tokens_as_token_ids wins)")
    parser.add_argument("--middleware", action="append", default=[], metavar="MODULE.NAME",
                        help="extra ASGI middleware, by import path (repeatable): a class is "
                             "added with app.add_middleware, an async function (request, "
                             "call_next) as an HTTP middleware; the last given runs first, "
                             "before the API-key check and body limit, as in vLLM")


def check_vllm_serve_args(args: argparse.Namespace) -> None:
    """ValueError naming a flag pdserve cannot honour; one log line per accepted no-op."""
    if not args.response_role or len(args.response_role) > 64:
        raise ValueError(f"--response-role: expected a role name, got {args.response_role!r}")
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile: give both, or neither")
    if args.ssl_cert_reqs and not args.ssl_ca_certs:
        raise ValueError("--ssl-cert-reqs: needs --ssl-ca-certs (the CA of client "
                         "certificates)")
    for name, why in _NO_OPS.items():
        if getattr(args, name):
            logger.info("--%s changes nothing here: %s", name.replace("_", "-"), why)


def load_middleware(paths: list[str]) -> list[Any]:
    """The objects `--middleware` names ("package.module.Name"), imported now so that a wrong
    path stops the server before it loads a model; ValueError naming the flag and the path."""
    loaded = []
    for path in paths:
        module_name, _, name = path.rpartition(".")
        if not module_name or not name:
            raise ValueError(f"--middleware: expected an import path 'module.Name', got {path!r}")
        try:
            obj = getattr(importlib.import_module(module_name), name)
        except Exception as e:  # noqa: BLE001 - the operator's module may raise anything
            raise ValueError(f"--middleware {path}: cannot import it: "
                             f"{type(e).__name__}: {e}") from e
        if not (inspect.isclass(obj) or inspect.iscoroutinefunction(obj)):
            raise ValueError(f"--middleware {path}: expected an ASGI middleware class or an "
                             f"async function (request, call_next), got {type(obj).__name__}")
        loaded.append(obj)
    return loaded


def install_middleware(app, middleware: list[Any]) -> None:
    """Wrap `app` in `middleware` (from `load_middleware`), in order: the last is outermost."""
    for obj in middleware:
        if inspect.isclass(obj):
            app.add_middleware(obj)
        else:
            app.middleware("http")(obj)


def uvicorn_options(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn.Config keyword arguments from the flags."""
    options: dict[str, Any] = {"root_path": args.root_path or ""}
    if args.uvicorn_log_level:
        options["log_level"] = args.uvicorn_log_level
    if args.ssl_keyfile:
        options.update(ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                       ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs)
    return options


def add_cors(app, args: argparse.Namespace) -> None:
    """CORS headers for the origins --allowed-origins names (none: no CORS)."""
    if args.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins,
                           allow_credentials=args.allow_credentials,
                           allow_methods=args.allowed_methods,
                           allow_headers=args.allowed_headers)
