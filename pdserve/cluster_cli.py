"""`pdserve up`: a router, N prefill and M decode instances as separate processes on this host.

    pdserve up --num-prefill 1 --num-decode 1 --connector shm [ENGINE FLAGS]

It takes every engine flag of `pdserve serve` (`--dtype`, `--max-num-seqs`, ...) and passes
those that differ from their defaults to each instance. It makes a fresh cluster secret for its
children and prints its log directory first, then the endpoints; Ctrl-C stops everything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import secrets
import signal
import sys
import time

from pdserve.cluster import (
    CPU_SHARING,
    SHARED_CORES_DISAGG_MIN_RUNNING,
    Cluster,
    ClusterError,
    ClusterSpec,
)
from pdserve.cpu_budget import parse_cores
from pdserve.engine.engine_args import EngineArgs
from pdserve.gateway.server import tool_parser_from_args
from pdserve.gateway.tool_parsers import TOOL_PARSERS
from pdserve.logging_setup import add_log_args, announce, report, setup_from_args
from pdserve.process_exit import exit_now
from pdserve.router.prefix_index import add_redis_prefix_arg
from pdserve.services.auth import SECRET_ENV

MAX_RESTARTS = 5  # times `up` restarts one child that exited before it gives up

# The engine flags the HTTP gateway in front of the router reads (tokenization and limits).
_GATEWAY_ENGINE_FLAGS = frozenset({"tokenizer", "tokenizer_mode", "chat_template",
                                   "served_model_name", "max_logprobs", "max_model_len",
                                   "revision"})


def engine_flags(args: argparse.Namespace, names: frozenset[str] | None = None) -> list[str]:
    """The engine flags of `args` that differ from their defaults (only `names`, if given),
    as an instance's argv (`--model` goes to each instance on its own)."""
    flags: list[str] = []
    for f in dataclasses.fields(EngineArgs):
        value = getattr(args, f.name)
        if f.name == "model" or value == f.default or (names and f.name not in names):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (list, tuple)):
            flags += [flag, *map(str, value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def gateway_flags(args: argparse.Namespace) -> list[str]:
    """The gateway's argv beyond its address: the engine flags it reads, tool calling."""
    flags = engine_flags(args, _GATEWAY_ENGINE_FLAGS)
    if args.enable_auto_tool_choice:
        tool_parser_from_args(args)  # fails now, not in a child
        flags += ["--enable-auto-tool-choice", "--tool-call-parser", args.tool_call_parser]
    return flags


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("up", help="start a router with prefill and decode instances on "
                                         "this machine")
    p.add_argument("--num-prefill", type=int, default=1)
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument("--connector", default="shm", choices=["shm", "tcp", "nixl"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000,
                   help="the OpenAI-format HTTP API (0 picks a free one; -1: no HTTP)")
    p.add_argument("--api-key", default=None, help="require this Bearer key on /v1/*")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='the gateway allows tool_choice "auto" (needs --tool-call-parser)')
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the gateway's tool-call parser for tool_choice \"auto\" "
                        "(default: none)")
    p.add_argument("--grpc-port", type=int, default=ClusterSpec.grpc_port,
                   help="the router's port (0 picks a free one)")
    p.add_argument("--disagg-threshold", type=int, default=ClusterSpec.disagg_threshold)
    p.add_argument("--disagg-min-running", type=int, default=None,
                   help="requests the decode instance must already run for a prompt to go "
                        "through a prefill instance (default: "
                        f"{SHARED_CORES_DISAGG_MIN_RUNNING} when the engines share cores, "
                        "0 with --cpu-sharing split)")
    p.add_argument("--redis-url", default=None)
    add_redis_prefix_arg(p)
    p.add_argument("--startup-timeout-s", type=float, default=ClusterSpec.startup_timeout_s)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--cpu-cores", default=None,
                   help="the cores the engine processes share out (e.g. 0-7; default: every "
                        "core this process may use)")
    p.add_argument("--cpu-sharing", choices=CPU_SHARING, default=ClusterSpec.cpu_sharing,
                   help="how the prefill/decode processes share the cores: turns (each "
                        "computes a step on all of them, one process at a time), split (each "
                        "its own cores, one compute thread per core) or shared (all of them, "
                        "no turns)")
    add_log_args(p)
    EngineArgs.add_cli_args(p)  # passed on to every instance (the model to the router too)
    p.set_defaults(func=run_up)


def default_min_running(given: int | None, cpu_sharing: str) -> int:
    """--disagg-min-running as given, else by how the engines share the cores: where a prompt
    on the prefill instance would take the decode instance's cores anyway, one beside a few
    decodes is cheaper there."""
    if given is not None:
        return given
    return 0 if cpu_sharing == "split" else SHARED_CORES_DISAGG_MIN_RUNNING


def run_up(args: argparse.Namespace) -> int:
    setup_from_args(args)
    # A fresh secret for this cluster's internal plane, unless the caller set one.
    secret = os.environ.get(SECRET_ENV) or secrets.token_hex(32)
    spec = ClusterSpec(
        model=args.model, num_prefill=args.num_prefill, num_decode=args.num_decode,
        connector=args.connector, host=args.host, grpc_port=args.grpc_port,
        disagg_threshold=args.disagg_threshold,
        disagg_min_running=default_min_running(args.disagg_min_running, args.cpu_sharing),
        redis_url=args.redis_url, redis_key_prefix=args.redis_key_prefix,
        startup_timeout_s=args.startup_timeout_s,
        log_dir=args.log_dir, http_port=None if args.port < 0 else args.port,
        api_key=args.api_key, cluster_secret=secret, log_level=args.log_level,
        log_format=args.log_format, instance_args=tuple(engine_flags(args)),
        gateway_args=tuple(gateway_flags(args)),
        router_args=("--revision", args.revision) if args.revision else (),
        cpu_cores=tuple(parse_cores(args.cpu_cores)) if args.cpu_cores else None,
        cpu_sharing=args.cpu_sharing)
    cluster = Cluster(spec)
    announce(f"logs       {cluster.log_dir}")  # first, so a slow or failed start can be read
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # SIGHUP: the terminal closed
        signal.signal(sig, lambda *_: setattr(cluster, "interrupted", True))
    try:
        cluster.start()
    except ClusterError as e:
        report(f"error: {e}", logging.ERROR)
        return 1
    for line in cluster.describe().splitlines():
        announce(line)
    announce("ready; Ctrl-C stops everything")
    code = supervise(cluster)
    cluster.stop()
    announce("stopped")
    return code


def supervise(cluster: Cluster) -> int:
    """Until a signal: restart every child that exits (an engine whose loop died exits 1 for
    this), up to MAX_RESTARTS times each; one that keeps dying stops everything, exit 1."""
    while not cluster.interrupted:
        time.sleep(0.1)  # a signal sets `interrupted` without waking the sleep
        for child in cluster.dead():
            report(f"warning: {child.name} exited with code {child.proc.returncode}; "
                   f"last lines:\n{child.tail()}")
            if child.restarts >= MAX_RESTARTS:
                report(f"error: {child.name} exited {child.restarts + 1} times; stopping",
                       logging.ERROR)
                return 1
            cluster.restart(child)
            report(f"restarted {child.name} ({child.restarts} of {MAX_RESTARTS} restarts)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m pdserve.cluster_cli ...`: the same as `pdserve up ...`."""
    from pdserve.cli import main as cli_main

    return cli_main(["up", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    exit_now(main())
