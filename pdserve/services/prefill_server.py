"""The prefill service: computes a prompt's KV and first token, and keeps the blocks pinned
under a lease until the decode side has read them (`Release`) or the lease expires."""

from __future__ import annotations

import dataclasses
import uuid

import grpc

from pdserve.proto.pdserve.v1 import engine_pb2, engine_pb2_grpc
from pdserve.router.wire_names import MAX_WIRE_REQUEST_ID_CHARS, check_request_id
from pdserve.sampling_params import RequestOutputKind
from pdserve.structured_outputs import is_constraint_error
from pdserve.services.grpc_server import service_name
from pdserve.services.instance import Instance, add_instance_args, run_instance
from pdserve.services.stream_wait import abort_when_done, next_output



class PrefillServicer(engine_pb2_grpc.PrefillServicer):
    def __init__(self, instance: Instance):
        self.instance = instance
        self.loop = instance.loop

    def Prefill(self, request, context):
        from pdserve.services.convert import params_from_proto, prompt_from_proto

        try:
            rid = check_request_id(request.request_id, MAX_WIRE_REQUEST_ID_CHARS) or \
                uuid.uuid4().hex
            params = params_from_proto(request.sampling)
            if not request.prompt_token_ids:
                raise ValueError("prompt_token_ids: must not be empty")
            if params.n != 1:
                raise ValueError(f"sampling.n: a prefill serves n=1, got {params.n}")
            user_max_tokens = params.max_tokens
            first_only = params.clone()
            first_only.max_tokens = 1
            first_only.min_tokens = min(params.min_tokens, 1)
            stream = self.loop.submit(rid, prompt_from_proto(request),
                                      first_only, {"do_remote_decode": True},
                                      output_kind=RequestOutputKind.FINAL_ONLY)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        abort_when_done(context, self.loop, rid)
        try:
            out = next_output(stream, context)
        except RuntimeError as e:
            context.abort(grpc.StatusCode.INTERNAL, str(e))
        if out.error and is_constraint_error(out.error):  # the request's own constraint
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request {rid}: {out.error}")
        return self._response(rid, out, user_max_tokens, bool(params.stop))

    def _response(self, rid, out, user_max_tokens, has_stop_strings):
        from pdserve.kv_transfer.connector import KVHandle  # imports torch: not for --help
        from pdserve.services.convert import (
            handle_to_proto,
            logprobs_to_proto,
            prompt_logprobs_to_proto,
        )

        c = out.outputs[0]
        first = c.token_ids[0]
        # Finished here: stopped, failed, asked for one token, or no room for a second one
        # within this engine's context length.
        room = self.instance.engine.scheduler.max_model_len - len(out.prompt_token_ids) - 1
        finished = (c.finish_reason in ("stop", "error", "abort") or user_max_tokens == 1
                    or room <= 0)
        resp = engine_pb2.PrefillResponse(
            first_token_id=first, num_cached_tokens=out.num_cached_tokens or 0,
            instance_id=self.instance.instance_id,
            prompt_logprobs=prompt_logprobs_to_proto(out.prompt_logprobs, out.prompt_token_ids),
            # Unless the request ends here, text that could still turn out to start a stop
            # string, or half a character, is left for the decode side to send.
            first_text=c.text if finished or not (has_stop_strings or c.text.endswith("\ufffd"))
            else "")
        if c.logprobs:
            resp.first_logprobs.CopyFrom(logprobs_to_proto(c.logprobs[0], first))
            resp.first_logprob = c.cumulative_logprob or 0.0
        handle = (out.kv_transfer_params or {}).get("handle")
        if finished:
            self.loop.release_kv(rid)
            resp.finish_reason = "length" if c.finish_reason == "length" else c.finish_reason
            resp.stop_reason = "" if c.stop_reason is None else str(c.stop_reason)
        elif handle:
            h = dataclasses.replace(KVHandle.from_dict(handle),
                                    release_address=self.instance.address)
            resp.handle.CopyFrom(handle_to_proto(h))
        return resp

    def Release(self, request, context):
        return engine_pb2.ReleaseResponse(released=self.loop.release_kv(request.request_id))

    def GetLoad(self, request, context):
        return self.instance.load()

    def Abort(self, request, context):
        return self.instance.abort(request.request_id)


def register(instance: Instance) -> None:
    instance.server.add(engine_pb2_grpc.add_PrefillServicer_to_server, PrefillServicer(instance),
                        [service_name(engine_pb2, "Prefill")])


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("prefill", help="serve one engine in the prefill role (gRPC)")
    add_instance_args(p)
    p.set_defaults(func=lambda args: run_instance("prefill", args, register))
