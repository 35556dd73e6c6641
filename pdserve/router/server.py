"""The router's gRPC server (`pdserve router`): Generate, Embed, Heartbeat, ListInstances,
the KV event feed of its prefix index (PublishKVEvents, ResyncKVState), health and
reflection.

    pdserve router --model M --grpc-port 50051 --prefill 127.0.0.1:7001 --decode 127.0.0.1:7002

Instances given with --prefill/--decode are polled; others register with heartbeats (their
`--router` flag). Instances started with `--router` also publish their KV events here, into
an in-process prefix index; with --redis-url the router reads the shared Redis index instead
(the instances then publish there). The request flows are in generate_flow.py and
embed_flow.py, the routing decision in routing.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from pdserve.logging_setup import add_log_args, announce, setup_from_args
from pdserve.models.loader import DEFAULT_MODEL, load_arch, load_tokenizer, resolve_model
from pdserve.process_exit import exit_now
from pdserve.proto.pdserve.v1 import router_pb2, router_pb2_grpc
from pdserve.router.channels import ChannelPool
from pdserve.router.core import RouterCore
from pdserve.router.kv_events import check_hashes
from pdserve.router.kv_events_wire import batch_from_proto
from pdserve.router.prefix_index import (
    PrefixIndex,
    PrefixIndexConfig,
    add_redis_prefix_arg,
    create_prefix_index,
)
from pdserve.router.registry import Registry, RegistryFull, StaticPoller
from pdserve.router.routing import Planner, RouterConfig
from pdserve.router.wire_names import check_instance_id, check_medium, check_request_id
from pdserve.services.auth import Credentials, add_credential_args, credentials_from_args
from pdserve.services.grpc_server import GrpcServer, service_name
from pdserve.services.instance import heartbeat_info

DEFAULT_PORT = 50051
logger = logging.getLogger(__name__)


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, core: RouterCore, index: PrefixIndex):
        self.core = core
        self.index = index
        self.heartbeat_interval_s = min(1.0, core.config.ttl_s / 3)

    def Generate(self, request, context):
        from pdserve.router.generate_flow import GenerateFlow

        _check_request_id(request, context)
        yield from GenerateFlow(self.core, request, context).run()

    def Embed(self, request, context):
        from pdserve.router.embed_flow import EmbedFlow

        _check_request_id(request, context)
        return EmbedFlow(self.core, request, context).run()

    def Heartbeat(self, request, context):
        try:
            inst = self.core.registry.observe(request)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RegistryFull as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        self.index.heartbeat(inst.id, heartbeat_info(inst.to_load()))
        return router_pb2.HeartbeatResponse(interval_s=self.heartbeat_interval_s)

    def ListInstances(self, request, context):
        """Instances the router would route to now."""
        loads = [i.to_load() for i in self.core.registry.live()]
        for load in loads:
            load.indexed_blocks = self.index.num_blocks(load.instance_id)
        return router_pb2.ListInstancesResponse(instances=loads,
                                                prefix_index_errors=self.index.errors)

    def PublishKVEvents(self, request, context):
        try:
            batch = batch_from_proto(request)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return router_pb2.PublishKVEventsResponse(applied=self.index.apply(batch))

    def ResyncKVState(self, request, context):
        try:
            applied = self.index.resync(check_instance_id(request.instance_id),
                                        list(check_hashes(tuple(request.block_hashes))),
                                        request.seq,
                                        check_medium(request.medium or "gpu"))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return router_pb2.PublishKVEventsResponse(applied=applied)


def _check_request_id(request, context) -> None:
    try:
        check_request_id(request.request_id)
    except ValueError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))


class RouterServer:
    """Router core + gRPC server + static-instance poller, started and stopped together."""

    def __init__(self, config: RouterConfig, host: str = "127.0.0.1", port: int = 0,
                 prefill: Sequence[str] = (), decode: Sequence[str] = (),
                 index: PrefixIndex | None = None, tokenizer: Any = None,
                 credentials: Credentials = Credentials()):
        for address in (*prefill, *decode):
            if ":" not in address:
                raise ValueError(f"--prefill/--decode: expected HOST:PORT, got {address!r}")
        if tokenizer is None:
            tokenizer = load_tokenizer(resolve_model(config.model, config.revision))
        if not config.max_model_len:  # the instances' context length: the model's
            arch = load_arch(resolve_model(config.model, config.revision))
            config = dataclasses.replace(config, max_model_len=arch.max_position_embeddings)
        self.index = index or create_prefix_index(
            PrefixIndexConfig(max_instances=config.max_instances))
        channels = ChannelPool(credentials)
        registry = Registry(ttl_s=config.ttl_s, on_forget=channels.discard,
                            max_instances=config.max_instances)
        self.core = RouterCore(config, registry, Planner(config, registry, self.index.match),
                               channels, tokenizer)
        targets = [(a, "prefill") for a in prefill] + [(a, "decode") for a in decode]
        self.poller = StaticPoller(registry, targets, channels.stub, config.poll_interval_s)
        self.grpc = GrpcServer(host, port, config.max_requests_in_flight,
                               ("/pdserve.v1.Router/Generate", "/pdserve.v1.Router/Embed"),
                               credentials=credentials)
        self.grpc.add(router_pb2_grpc.add_RouterServicer_to_server,
                      RouterServicer(self.core, self.index), [service_name(router_pb2, "Router")])
        self.address = self.grpc.address

    def start(self) -> RouterServer:
        self.grpc.start()
        self.poller.start()
        return self

    def stop(self) -> None:
        self.grpc.stop()
        self._close()

    def _close(self) -> None:
        self.poller.stop()
        self.core.close()
        self.index.close()

    def serve_until_signal(self, ready: Callable[[], None] = lambda: None) -> None:
        self.grpc.serve_until_signal(on_stop=self._close, ready=ready)


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("router", help="serve the gRPC router in front of prefill and "
                                             "decode instances")
    p.add_argument("--model", default=DEFAULT_MODEL, help="the served model (its tokenizer)")
    p.add_argument("--revision", default=None,
                   help="the model's revision, for a Hugging Face repo id in the local cache")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--grpc-port", type=int, default=DEFAULT_PORT, help="0 picks a free port")
    p.add_argument("--prefill", action="append", default=[], metavar="ADDR",
                   help="a prefill instance to poll (repeatable)")
    p.add_argument("--decode", action="append", default=[], metavar="ADDR",
                   help="a decode instance to poll (repeatable)")
    p.add_argument("--disagg-threshold", type=int, default=RouterConfig.disagg_threshold,
                   help="uncached prompt tokens from which a prompt is prefilled on a prefill "
                        "instance (0: always)")
    p.add_argument("--disagg-min-running", type=int, default=RouterConfig.disagg_min_running,
                   help="requests a decode instance must already run for a prompt to go "
                        "through a prefill instance; below, it prefills the prompt itself "
                        "(0: however few)")
    p.add_argument("--prefill-attempts", type=int, default=RouterConfig.prefill_attempts)
    p.add_argument("--prefill-timeout-s", type=float, default=RouterConfig.prefill_timeout_s,
                   help="how often a running prefill's instance, or that of a decode stream "
                        "silent this long, is probed for liveness; a live instance is waited "
                        "for up to the request's deadline, a dead one's requests go elsewhere")
    p.add_argument("--max-migrations", type=int, default=RouterConfig.max_migrations,
                   help="times a request whose decode instance dies mid-stream continues on "
                        "another one (n = 1 requests)")
    p.add_argument("--max-model-len", type=int, default=RouterConfig.max_model_len,
                   help="context length requests must fit, as the instances' (0: the model's)")
    p.add_argument("--max-logprobs", type=int, default=RouterConfig.max_logprobs,
                   help="most logprobs per position a request may ask for (-1: no cap)")
    p.add_argument("--max-requests-in-flight", type=int,
                   default=RouterConfig.max_requests_in_flight,
                   help="Generate and Embed calls served at once; more are refused with "
                        "RESOURCE_EXHAUSTED (heartbeats and listings always get through)")
    p.add_argument("--max-instances", type=int, default=RouterConfig.max_instances,
                   help="instances the router and its prefix index track; heartbeats of one "
                        "more are refused with RESOURCE_EXHAUSTED")
    p.add_argument("--redis-url", default=None,
                   help="read the prefix index from this Redis (default: in-process, fed by "
                        "the instances' KV events)")
    add_redis_prefix_arg(p)
    add_credential_args(p, api_keys=True)
    add_log_args(p)
    p.set_defaults(func=run_router)


def run_router(args: argparse.Namespace) -> int:
    setup_from_args(args)
    try:
        config = RouterConfig(model=args.model, revision=args.revision,
                              disagg_threshold=args.disagg_threshold,
                              disagg_min_running=args.disagg_min_running,
                              prefill_attempts=args.prefill_attempts,
                              prefill_timeout_s=args.prefill_timeout_s,
                              max_model_len=args.max_model_len, max_logprobs=args.max_logprobs,
                              max_migrations=args.max_migrations,
                              max_requests_in_flight=args.max_requests_in_flight,
                              max_instances=args.max_instances)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    try:
        index = (create_prefix_index(PrefixIndexConfig(
            "redis", args.redis_url, args.redis_key_prefix, max_instances=args.max_instances))
            if args.redis_url else None)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    try:
        credentials = credentials_from_args(args, api_keys=True)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    router = RouterServer(config, args.host, args.grpc_port, args.prefill, args.decode, index,
                          credentials=credentials)
    router.start()
    logger.info("router serving %s; gRPC on %s, prefix index %s, instances %s", args.model,
                router.address, "in Redis" if args.redis_url else "in memory",
                " ".join(args.prefill + args.decode) or "by heartbeat")
    router.serve_until_signal(ready=lambda: announce(f"router listening on {router.address}"))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m pdserve.router.server ...`: the same as `pdserve router ...`."""
    from pdserve.cli import main as cli_main

    return cli_main(["router", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    exit_now(main())
