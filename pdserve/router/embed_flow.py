"""One `Router.Embed` call: validate, pick an instance, embed there (its Pooling service).

Prefill instances are preferred (prompt compute stays off the decode instances, as
disaggregation keeps it), with the prefix cache counted as for any prompt; decode instances
serve embeddings when no prefill instance is live. An instance that fails (down, or its
engine gone) is marked down and the next one is tried, up to `embed_attempts`. The wait is
bounded by the request's deadline (the client's, else `request_timeout_s`); a slow
instance is waited for while it answers a liveness probe every `prefill_timeout_s`, as a
prefill is. When the client goes away, the call to the instance is cancelled and the
instance aborts the request.
"""

from __future__ import annotations

import logging
import time
import uuid

import grpc

from pdserve.proto.pdserve.v1 import common_pb2, engine_pb2, router_pb2
from pdserve.router.core import DOWN_CODES, RouterCore
from pdserve.router.prompts import prompt_ids
from pdserve.router.registry import Instance
from pdserve.services.convert import pooling_from_proto

logger = logging.getLogger("pdserve.request.router")
Code = grpc.StatusCode


class EmbedFlow:
    """Runs one Embed call; `run()` returns the client's EmbedResponse."""

    def __init__(self, core: RouterCore, request: router_pb2.EmbedRequest,
                 context: grpc.ServicerContext):
        self.core = core
        self.config = core.config
        self.request = request
        self.context = context
        self.rid = request.request_id or uuid.uuid4().hex
        self.wire_id = f"{self.rid}-{uuid.uuid4().hex[:12]}"  # what instances see (ids may clash)
        self.start = time.monotonic()
        self.deadline = self.start + min(context.time_remaining(), self.config.request_timeout_s)

    def run(self) -> common_pb2.EmbedResponse:
        ids = self._validate()
        routing = self.core.planner.routing_request(ids)
        req = engine_pb2.EmbedPromptRequest(request_id=self.wire_id, prompt_token_ids=ids,
                                            pooling=self.request.pooling)
        tried: list[str] = []
        failures: list[str] = []
        while len(tried) < self.config.embed_attempts:
            instance = self.core.planner.pick_pooling(routing, tried)
            if instance is None:
                break
            tried.append(instance.id)
            resp = self._embed_on(instance, req, failures)
            if resp is not None:
                self._log(len(ids), resp.instance_id or instance.id)
                return resp
        self._abort(Code.UNAVAILABLE, f"request {self.rid}: no instance could embed it ("
                    + ("; ".join(failures) or "no healthy instance") + ")")

    def _embed_on(self, instance: Instance, req: engine_pb2.EmbedPromptRequest,
                  failures: list[str]) -> common_pb2.EmbedResponse | None:
        """The instance's answer; None (the failure noted) when it failed or stopped
        answering its liveness probe, so that the next instance is tried."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            self._abort(Code.DEADLINE_EXCEEDED, f"request {self.rid}: deadline passed")
        future = self.core.channels.pooling(instance.address).Embed.future(req, timeout=left)
        self.context.add_callback(future.cancel)  # the client left: so does the call
        role = "prefill" if instance.view.role == "prefill" else "decode"
        try:
            while True:  # slow is not dead: wait while the instance answers its probe
                try:
                    return future.result(timeout=self.config.prefill_timeout_s)
                except grpc.FutureTimeoutError:
                    if not self.context.is_active():
                        future.cancel()
                    elif self.core.is_down(instance, role):
                        future.cancel()
                        self.core.registry.mark_down(instance.id)
                        failures.append(f"{instance.id}: stopped answering")
                        logger.warning("request %s: embedding on %s failed: it stopped "
                                       "answering", self.rid, instance.id)
                        return None
                    else:
                        logger.info("request %s: embedding on %s still running; it answers",
                                    self.rid, instance.id)
        except (grpc.RpcError, grpc.FutureCancelledError) as e:
            code = e.code() if isinstance(e, grpc.RpcError) else Code.CANCELLED
            details = e.details() if isinstance(e, grpc.RpcError) else "cancelled"
        if not self.context.is_active():
            self._abort(Code.CANCELLED, f"request {self.rid}: the client went away")
        if code in (Code.INVALID_ARGUMENT, Code.DEADLINE_EXCEEDED):
            self._abort(code, details)
        if code in DOWN_CODES:
            self.core.registry.mark_down(instance.id)
        failures.append(f"{instance.id}: {code.name}: {details}")
        logger.warning("request %s: embedding on %s failed (%s: %s)", self.rid, instance.id,
                       code.name, details)
        return None

    def _validate(self) -> list[int]:
        """The prompt's ids as the instance embeds them (truncated); INVALID_ARGUMENT naming
        the field when the prompt or the pooling parameters are bad."""
        try:
            pooling = pooling_from_proto(self.request.pooling)
            ids = prompt_ids(self.request, self.core.encode)
        except ValueError as e:
            self._abort(Code.INVALID_ARGUMENT, str(e))
        limit = self.config.max_model_len  # 0: unknown, checked by the instance
        try:  # before routing: the prefix index and the instance see the same prompt
            ids = pooling.truncate_prompt(ids, limit or 1 << 62)
        except ValueError as e:
            self._abort(Code.INVALID_ARGUMENT, f"pooling.{e}")
        if limit and len(ids) > limit:
            self._abort(Code.INVALID_ARGUMENT, f"prompt: {len(ids)} tokens exceed the model's "
                        f"context length of {limit} tokens")
        return ids

    def _log(self, prompt_tokens: int, instance_id: str) -> None:
        if not self.config.log_requests:
            return
        e2e = time.monotonic() - self.start
        fields = {"request_id": self.rid, "task": "embed", "prompt_tokens": prompt_tokens,
                  "e2e_s": round(e2e, 4), "instance": instance_id}
        logger.info("request %s embedded: %d prompt tokens, %.3f s end to end; on %s",
                    self.rid, prompt_tokens, e2e, instance_id, extra={"fields": fields})

    def _abort(self, code: grpc.StatusCode, message: str):
        logger.info("request %s: %s %s", self.rid, code.name, message)
        self.context.abort(code, message)
