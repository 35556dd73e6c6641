"""A bound on the long calls a threaded gRPC server runs at once, below its thread count.

A call holds one of the server's threads until it ends: a Decode or Generate stream for its
whole generation. Were every thread held by such calls, the short ones (health checks, load
reports, heartbeats, KV releases, aborts) would queue behind them, and a loaded but healthy
instance would look dead to its router, which would then fail requests it could serve. Long
calls beyond the bound are refused at once with RESOURCE_EXHAUSTED ("full": the router tries
another instance or tells its client to retry); short calls always find a thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import grpc

SHORT_CALL_THREADS = 32  # threads no long call may take


class CallSlots:
    """At most `limit` long calls at once; `take` is non-blocking."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"max_requests_in_flight must be >= 1, got {limit}")
        self.limit = limit
        self._lock = threading.Lock()
        self.in_use = 0

    def take(self) -> bool:
        with self._lock:
            if self.in_use >= self.limit:
                return False
            self.in_use += 1
            return True

    def give_back(self) -> None:
        with self._lock:
            self.in_use -= 1


class CallSlotsInterceptor(grpc.ServerInterceptor):
    """Runs the methods named in `long_methods` ("/package.Service/Method") within `slots`."""

    def __init__(self, slots: CallSlots, long_methods: Iterable[str]):
        self.slots = slots
        self.long_methods = frozenset(long_methods)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self.long_methods:
            return handler
        if handler.request_streaming:
            raise TypeError(f"{handler_call_details.method}: request streams are not bounded")
        slots, method = self.slots, handler_call_details.method

        def refuse(context) -> None:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{method}: {slots.limit} calls already running here; retry later "
                          f"or elsewhere")

        if handler.response_streaming:
            stream = handler.unary_stream

            def bounded_stream(request, context):
                if not slots.take():
                    refuse(context)
                try:
                    yield from stream(request, context)
                finally:  # also when the client cancels and the generator is closed
                    slots.give_back()

            return grpc.unary_stream_rpc_method_handler(
                bounded_stream, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        unary = handler.unary_unary

        def bounded(request, context):
            if not slots.take():
                refuse(context)
            try:
                return unary(request, context)
            finally:
                slots.give_back()

        return grpc.unary_unary_rpc_method_handler(
            bounded, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)
