"""The decode service: pulls a prompt's KV from a prefill instance (or prefills locally),
joins its continuous batch, and streams tokens."""

from __future__ import annotations

import uuid

import grpc

from pdserve.proto.pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from pdserve.router.wire_names import MAX_WIRE_REQUEST_ID_CHARS, check_request_id
from pdserve.sampling_params import RequestOutputKind
from pdserve.structured_outputs import is_constraint_error
from pdserve.services.grpc_server import service_name
from pdserve.services.instance import Instance, add_instance_args, run_instance
from pdserve.services.stream_wait import abort_when_done, next_output



class DecodeServicer(engine_pb2_grpc.DecodeServicer):
    def __init__(self, instance: Instance):
        self.instance = instance
        self.loop = instance.loop

    def Decode(self, request, context):
        # convert imports the KV connector, hence torch: not at import time (pdserve --help)
        from pdserve.services.convert import (
            handle_from_proto,
            params_from_proto,
            prompt_from_proto,
        )

        try:
            rid = check_request_id(request.request_id, MAX_WIRE_REQUEST_ID_CHARS) or \
                uuid.uuid4().hex
            params = params_from_proto(request.sampling)
            if not request.prompt_token_ids:
                raise ValueError("prompt_token_ids: must not be empty")
            kv = {}
            if request.HasField("handle"):
                kv["remote_handle"] = handle_from_proto(request.handle).to_dict()
            if request.output_token_ids:
                kv["output_token_ids"] = list(request.output_token_ids)
            stream = self.loop.submit(rid, prompt_from_proto(request),
                                      params, kv or None, output_kind=RequestOutputKind.DELTA)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        abort_when_done(context, self.loop, rid)
        yield from self._stream(rid, stream, request, context)

    def _stream(self, rid, stream, request, context):
        from pdserve.services.convert import logprobs_to_proto, prompt_logprobs_to_proto

        completion_tokens = 0
        first = True
        while not stream.finished:
            try:
                out = next_output(stream, context)
            except RuntimeError as e:
                context.abort(grpc.StatusCode.INTERNAL, str(e))
            if out.error:
                code = (grpc.StatusCode.INVALID_ARGUMENT if is_constraint_error(out.error)
                        else grpc.StatusCode.UNAVAILABLE)
                context.abort(code, f"request {rid}: {out.error}")
            for i, c in enumerate(out.outputs):
                completion_tokens += len(c.token_ids)
                msg = common_pb2.GenerateResponse(
                    request_id=rid, index=c.index, token_ids=c.token_ids, text=c.text,
                    finish_reason=c.finish_reason or "",
                    stop_reason="" if c.stop_reason is None else str(c.stop_reason),
                    cumulative_logprob=c.cumulative_logprob or 0.0)
                if c.logprobs is not None:
                    msg.logprobs.extend(logprobs_to_proto(e, t)
                                        for e, t in zip(c.logprobs, c.token_ids))
                if first:
                    msg.prompt_token_ids.extend(out.prompt_token_ids)
                    msg.prompt_logprobs.extend(prompt_logprobs_to_proto(
                        out.prompt_logprobs, out.prompt_token_ids))
                    first = False
                if out.finished and i == len(out.outputs) - 1:
                    msg.usage.CopyFrom(common_pb2.Usage(
                        prompt_tokens=len(out.prompt_token_ids),
                        completion_tokens=completion_tokens,
                        cached_tokens=out.num_cached_tokens or 0))
                yield msg

    def GetLoad(self, request, context):
        return self.instance.load()

    def Abort(self, request, context):
        return self.instance.abort(request.request_id)


def register(instance: Instance) -> None:
    instance.server.add(engine_pb2_grpc.add_DecodeServicer_to_server, DecodeServicer(instance),
                        [service_name(engine_pb2, "Decode")])


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("decode", help="serve one engine in the decode role (gRPC)")
    add_instance_args(p)
    p.set_defaults(func=lambda args: run_instance("decode", args, register))
