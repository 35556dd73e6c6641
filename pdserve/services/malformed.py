"""Requests that do not parse get INVALID_ARGUMENT, not INTERNAL.

gRPC turns a request its deserializer rejects (bytes that are not the method's message, or a
string field holding invalid UTF-8, which proto3 forbids) into INTERNAL, as if the server had
failed. The interceptor here parses requests itself and answers such a request
INVALID_ARGUMENT, naming the message it expected.
"""

from __future__ import annotations

import grpc


class _Malformed:
    """What a request that did not parse becomes, so the handler can refuse it."""

    def __init__(self, error: Exception):
        self.error = error


def _tolerant(deserializer):
    def parse(data: bytes):
        try:
            return deserializer(data)
        except Exception as e:  # noqa: BLE001 - any parse failure is the client's
            return _Malformed(e)
    return parse


def _refuse(context, method: str, request: _Malformed) -> None:
    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                  f"request: not a valid message for {method} (a string field with invalid "
                  f"UTF-8, or not this method's message): {request.error}")


class MalformedRequestInterceptor(grpc.ServerInterceptor):
    """Parses unary requests tolerantly; a request that does not parse is INVALID_ARGUMENT."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if (handler is None or handler.request_streaming
                or handler.request_deserializer is None):
            return handler
        method = handler_call_details.method
        if handler.response_streaming:
            behavior = handler.unary_stream

            def checked_stream(request, context):
                if isinstance(request, _Malformed):
                    _refuse(context, method, request)
                yield from behavior(request, context)

            return grpc.unary_stream_rpc_method_handler(
                checked_stream, request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer)
        behavior = handler.unary_unary

        def checked(request, context):
            if isinstance(request, _Malformed):
                _refuse(context, method, request)
            return behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(
            checked, request_deserializer=_tolerant(handler.request_deserializer),
            response_serializer=handler.response_serializer)
