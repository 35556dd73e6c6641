"""The Pooling service that every instance serves, whatever its role: a prompt's embedding,
computed as a pooling request on the instance's engine (engine/pooling.py) beside its other
requests. The router sends embeddings here (router/embed_flow.py)."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import grpc

from pdserve.proto.pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from pdserve.router.wire_names import MAX_WIRE_REQUEST_ID_CHARS, check_request_id
from pdserve.services.grpc_server import service_name
from pdserve.services.stream_wait import abort_when_done, next_output

if TYPE_CHECKING:
    from pdserve.services.instance import Instance


class PoolingServicer(engine_pb2_grpc.PoolingServicer):
    def __init__(self, instance: Instance):
        self.instance = instance
        self.loop = instance.loop

    def Embed(self, request, context):
        # convert imports the KV connector, hence torch: not at import time (pdserve --help)
        from pdserve.services.convert import pooling_from_proto

        try:
            rid = check_request_id(request.request_id, MAX_WIRE_REQUEST_ID_CHARS) or \
                uuid.uuid4().hex
            pooling = pooling_from_proto(request.pooling)
            if not request.prompt_token_ids:
                raise ValueError("prompt_token_ids: must not be empty")
            stream = self.loop.submit(rid, {"prompt_token_ids": list(request.prompt_token_ids)},
                                      pooling)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        abort_when_done(context, self.loop, rid)
        try:
            out = next_output(stream, context)
        except RuntimeError as e:  # the engine loop died
            context.abort(grpc.StatusCode.INTERNAL, str(e))
        if out.error:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"request {rid}: {out.error}")
        return common_pb2.EmbedResponse(
            request_id=rid, embedding=out.outputs.data.tolist(),
            prompt_tokens=len(out.prompt_token_ids), instance_id=self.instance.instance_id)


def register(instance: Instance) -> None:
    instance.server.add(engine_pb2_grpc.add_PoolingServicer_to_server, PoolingServicer(instance),
                        [service_name(engine_pb2, "Pooling")])
