"""One engine instance behind gRPC: the engine on its loop thread, its KV connector, load
reporting, abort, embeddings, and heartbeats to a router. The prefill and decode servers
build on it."""

from __future__ import annotations

import argparse
import logging
import threading
import uuid
from typing import TYPE_CHECKING

import grpc

from pdserve.cpu_budget import add_cpu_args
from pdserve.engine.engine_args import EngineArgs
from pdserve.engine.engine_loop import EngineLoop
from pdserve.logging_setup import add_log_args, announce, setup_from_args
from pdserve.proto.pdserve.v1 import common_pb2, engine_pb2, router_pb2_grpc
from pdserve.router.wire_names import check_instance_id
from pdserve.router.channels import ChannelPool
from pdserve.router.prefix_index import (PrefixIndexConfig, add_redis_prefix_arg,
                                        create_prefix_index)
from pdserve.services.auth import Credentials, add_credential_args, credentials_from_args
from pdserve.services.grpc_server import GrpcServer, load_message
from pdserve.services.kv_event_publisher import KVEventPublisher, RouterSink
from pdserve.services.pooling_server import register as register_pooling

if TYPE_CHECKING:
    from pdserve.kv_transfer.connector import KVConnector, KVHandle

logger = logging.getLogger(__name__)
# The calls that hold a server thread while the engine works (call_slots.py).
LONG_METHODS = ("/pdserve.v1.Prefill/Prefill", "/pdserve.v1.Decode/Decode",
                "/pdserve.v1.Pooling/Embed")
MAX_REQUESTS_IN_FLIGHT = 512
MAX_RELEASE_CHANNELS = 64  # channels to prefill instances kept open for Release calls


class Instance:
    """An engine serving one role ("prefill" or "decode") on a gRPC server."""

    def __init__(self, role: str, engine_args: EngineArgs, connector_kind: str,
                 host: str = "127.0.0.1", port: int = 0, instance_id: str | None = None,
                 router: str | None = None, redis_url: str | None = None,
                 credentials: Credentials = Credentials(),
                 max_requests_in_flight: int = MAX_REQUESTS_IN_FLIGHT,
                 redis_key_prefix: str = PrefixIndexConfig.key_prefix):
        from pdserve.engine.llm_engine import LLMEngine  # torch: not imported for --help

        self.role = role
        self.instance_id = check_instance_id(instance_id or f"{role}-{uuid.uuid4().hex[:8]}",
                                             "--instance-id")
        self.channels = ChannelPool(credentials)
        # Release calls go to the addresses handles name: a caller may name many.
        self.release_channels = ChannelPool(credentials, max_channels=MAX_RELEASE_CHANNELS)
        self._lock = threading.Lock()
        self._releases: set = set()  # Release calls in flight (decode side)
        self.server = GrpcServer(host, port, max_requests_in_flight, LONG_METHODS,
                                 credentials=credentials)
        self.address = self.server.address
        self.connector_kind = connector_kind
        self.connector = self._make_connector(connector_kind, host, credentials)
        # KV events go to Redis when given (shared by every router), else to the router.
        self.index = (create_prefix_index(PrefixIndexConfig("redis", redis_url,
                                                            redis_key_prefix))
                      if redis_url else None)
        sink = self.index or (RouterSink(self.channels.get(router)) if router else None)
        self.engine = LLMEngine.from_engine_args(engine_args, connector=self.connector,
                                                 record_kv_events=sink is not None)
        self.loop = EngineLoop(self.engine, on_failure=self._engine_failed, log_requests=True,
                               log_stats=not engine_args.disable_log_stats)
        self.publisher = (KVEventPublisher(self.loop, sink, self.instance_id)
                          if sink is not None else None)
        self.router = router
        self._stop = threading.Event()
        register_pooling(self)  # embeddings, in either role

    def _make_connector(self, kind: str, host: str, credentials: Credentials) -> KVConnector:
        from pdserve.kv_transfer import make_transport
        from pdserve.kv_transfer.connector import KVConnector, TransportConnector
        from pdserve.kv_transfer.socket_tls import SocketTls

        if kind == "none":
            return KVConnector()
        options = {}
        if kind == "tcp":  # served on the instance's own host, so peers can dial it
            options["host"] = host
            options["cluster_secret"] = credentials.cluster_secret
            if credentials.tls is not None:  # the gRPC plane's certificates, mutual TLS too
                tls = credentials.tls
                options["tls"] = SocketTls.from_pem(tls.cert, tls.key, tls.ca)
        transport = make_transport(kind, self.instance_id, **options)
        return TransportConnector(transport, on_loaded=self._release_remote)

    def _release_remote(self, handle: KVHandle) -> None:
        """Decode side: tell the prefill instance its blocks were read (best effort: its
        lease expires anyway). Not waited for: a frozen prefill instance must not hold up the
        KV loads of other requests, which run on the same threads."""
        if not handle.release_address:
            return
        future = self.release_channels.prefill(handle.release_address).Release.future(
            engine_pb2.ReleaseRequest(request_id=handle.request_id), timeout=2)
        with self._lock:
            self._releases.add(future)  # NOTE: a gRPC future dropped early cancels its call

        def done(f) -> None:
            with self._lock:
                self._releases.discard(f)
            if not f.cancelled() and f.exception() is not None:
                logger.warning("release of %s at %s failed: %s", handle.request_id,
                               handle.release_address, f.exception().code())

        future.add_done_callback(done)

    def _engine_failed(self, error: Exception) -> None:
        """The engine loop died: stop heartbeating (the router drops this instance), report
        NOT_SERVING, and end the process non-zero so that its supervisor restarts it."""
        logger.error("engine loop of %s died: %s: %s; this instance stops serving",
                     self.instance_id, type(error).__name__, error)
        self._stop.set()
        self.server.fail()

    def load(self) -> common_pb2.Load:
        return load_message(self.instance_id, self.role, self.address, self.loop.stats(),
                            self.connector_kind, self.engine.config.cache.block_size)

    def abort(self, request_id: str) -> common_pb2.AbortResponse:
        return common_pb2.AbortResponse(found=self.loop.abort(request_id))

    def start(self) -> None:
        self.loop.start()
        self.server.start()
        if self.router or self.index:
            threading.Thread(target=self._heartbeat, daemon=True, name="heartbeat").start()
        if self.publisher:
            self.publisher.start()

    def _heartbeat(self) -> None:
        stub = router_pb2_grpc.RouterStub(self.channels.get(self.router)) if self.router else None
        interval = 0.0
        while not self._stop.wait(interval):
            interval = 1.0
            load = self.load()
            if self.index:
                self.index.heartbeat(self.instance_id, heartbeat_info(load))
            if stub:
                try:
                    interval = stub.Heartbeat(load, timeout=2).interval_s or 1.0
                except grpc.RpcError:
                    pass  # router not up yet or gone: keep trying

    def stop(self) -> None:
        self._stop.set()
        if self.publisher:
            self.publisher.stop()
        self.server.stop()
        self.loop.stop()
        self.connector.close()
        self.channels.close()
        self.release_channels.close()
        if self.index:
            self.index.close()


def heartbeat_info(load: common_pb2.Load) -> dict:
    """A Load as the prefix index's instance registry keeps it (scorers' InstanceView keys)."""
    return {"role": load.role, "address": load.address,
            "queued_requests": load.waiting_requests, "queued_tokens": load.waiting_tokens,
            "running_requests": load.running_requests, "free_blocks": load.free_blocks,
            "total_blocks": load.total_blocks, "block_size": load.block_size}


def add_instance_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--connector", default="shm", choices=["shm", "tcp", "nixl", "none"])
    parser.add_argument("--router", default=None, help="router address to heartbeat to")
    parser.add_argument("--instance-id", default=None)
    parser.add_argument("--redis-url", default=None,
                        help="publish KV events and heartbeats to this Redis prefix index")
    add_redis_prefix_arg(parser)
    parser.add_argument("--max-requests-in-flight", type=int, default=MAX_REQUESTS_IN_FLIGHT,
                        help="prefills, decodes and embeddings this instance takes at once "
                             "(the engine queues what it cannot batch); more are refused with "
                             "RESOURCE_EXHAUSTED, so health and load calls always get through")
    add_credential_args(parser)
    add_log_args(parser)
    add_cpu_args(parser)
    EngineArgs.add_cli_args(parser)


def run_instance(role: str, args: argparse.Namespace, register) -> int:
    """Build, serve until SIGTERM/SIGINT, stop. `register(instance)` adds the servicer."""
    setup_from_args(args)
    try:
        credentials = credentials_from_args(args)
        PrefixIndexConfig("redis", args.redis_url or "", args.redis_key_prefix)  # checks it
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    instance = Instance(role, EngineArgs.from_cli_args(args), args.connector, args.host,
                        args.port, args.instance_id, args.router, args.redis_url, credentials,
                        args.max_requests_in_flight, args.redis_key_prefix)
    register(instance)
    instance.start()
    logger.info("%s instance %s serving %s; gRPC on %s, KV connector %s, router %s%s", role,
                instance.instance_id, instance.engine.describe(), instance.address,
                args.connector, args.router or "none",
                ", prefix index in Redis" if args.redis_url else "")
    return instance.server.serve_until_signal(on_stop=instance.stop, ready=lambda: announce(
        f"{role} {instance.instance_id} listening on {instance.address}"))
