"""One `Router.Generate` call: validate, route, prefill on P (with retries), decode on D, relay.

    client --Generate--> router --Prefill--> P          (first token + KV handle)
           <--first token--
                                --Decode(handle)--> D   (pulls the KV, streams the rest)
           <--tokens (D's first token stripped)--

Every wait is bounded by the request's deadline (the client's, else `request_timeout_s`) and
by per-call timeouts; when the client goes away, the call in flight is cancelled (D aborts
and frees its blocks) and a lease taken on P but not handed to a decode is released.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote

import grpc

from pdserve.block_hash import check_cache_salt
from pdserve.proto.pdserve.v1 import common_pb2, engine_pb2, router_pb2
from pdserve.router.core import DOWN_CODES, RouterCore
from pdserve.router.prompts import prompt_ids
from pdserve.router.registry import Instance
from pdserve.router.relay import BrokenDecodeStream, Continuation, Relay
from pdserve.router.request_log import RouterRequestLog
from pdserve.router.routing import NoDecodeInstance, Plan
from pdserve.sampling_params import SamplingParams
from pdserve.services.convert import params_from_proto

logger = logging.getLogger(__name__)
# Initial metadata of a Generate call the router accepted and routed: the request's id,
# percent-encoded (UTF-8; metadata values are ASCII), which leaves ids of letters, digits,
# "-", "_", "." and "~" as they are.
REQUEST_ID_HEADER = "pdserve-request-id"
Code = grpc.StatusCode


class _ClientGone(Exception):
    """The RPC ended (client cancelled or its deadline passed): stop quietly."""


class _InstanceDead(Exception):
    """An instance stopped answering its liveness probe while a call to it was running."""


class GenerateFlow:
    """Runs one Generate call; `run()` yields the client's GenerateResponses."""

    def __init__(self, core: RouterCore, request: router_pb2.GenerateRequest,
                 context: grpc.ServicerContext):
        self.core = core
        self.config = core.config
        self.request = request
        self.context = context
        self.rid = request.request_id or uuid.uuid4().hex  # the id the client sees
        self.wire_id = f"{self.rid}-{uuid.uuid4().hex[:12]}"  # what instances see (ids may clash)
        budget = min(context.time_remaining(), self.config.request_timeout_s)
        self.deadline = time.monotonic() + budget
        self.served = common_pb2.ServedBy()
        self._lock = threading.Lock()
        self._over = False  # the RPC has ended
        self._inflight: Any = None  # the outgoing call to cancel when it does
        self._lease: tuple[str, str] | None = None  # (P address, id) the router must release
        self._error: str | None = None  # the status the router ended the call with
        self.log = RouterRequestLog(self.rid) if self.config.log_requests else None
        if not context.add_callback(self._on_rpc_done):
            self._on_rpc_done()  # the RPC had ended already

    # ------------------------------------------------------------------ the flow
    def run(self) -> Iterator[common_pb2.GenerateResponse]:
        status, error = None, None
        try:
            for msg in self._generate():
                if self.log is not None:
                    self.log.sent(msg)
                yield msg
        except _ClientGone:
            status = "abort"
            logger.info("request %s: client went away", self.rid)
        except GeneratorExit:  # gRPC closed the stream (the client went away)
            status = "abort"
            raise
        except BaseException as e:  # context.abort's exception, or a bug: logged, re-raised
            status = "error"
            error = self._error or f"{type(e).__name__}: {e}"
            raise
        finally:
            self._on_rpc_done()  # also when the generator is closed without the callback
            if self.log is not None:
                self.log.ended(self.served, status, error)

    def _generate(self) -> Iterator[common_pb2.GenerateResponse]:
        prompt_ids, params = self._validate()
        try:
            plan = self.core.planner.plan(prompt_ids, params.n, self.request.cache_salt)
        except NoDecodeInstance as e:
            self._abort(Code.UNAVAILABLE, str(e))
        # Accepted and routed: the client learns so, and the request's id, before any token.
        self.context.send_initial_metadata(((REQUEST_ID_HEADER, quote(self.rid, safe="")),))
        with self.core.planner.open_requests.holding(plan.decode.id):
            first = self._prefill(plan, prompt_ids) if plan.disaggregate else None
            if first is not None:
                yield self._first_message(first, prompt_ids, params, plan.decode.id)
            if first is None or not first.finish_reason:
                yield from self._decode(plan, prompt_ids, params, first)

    def _validate(self) -> tuple[list[int], SamplingParams]:
        try:
            params = params_from_proto(self.request.sampling)
        except ValueError as e:
            self._abort(Code.INVALID_ARGUMENT, str(e))
        try:
            ids = prompt_ids(self.request, self.core.encode)
        except ValueError as e:
            self._abort(Code.INVALID_ARGUMENT, str(e))
        try:  # before routing: the prefix index and the instances see the same prompt
            ids = params.truncate_prompt(ids, self.config.max_model_len or 1 << 62)
        except ValueError as e:
            self._abort(Code.INVALID_ARGUMENT, f"sampling.{e}")
        try:
            check_cache_salt(self.request.cache_salt or None)
        except ValueError as e:
            self._abort(Code.INVALID_ARGUMENT, str(e))
        if self.log is not None:
            self.log.prompt_tokens = len(ids)
        self._check_caps(len(ids), params)
        return ids, params

    def _check_caps(self, prompt_len: int, params: SamplingParams) -> None:
        """The gateway's caps: prompt and max_tokens fit the context, logprobs max_logprobs."""
        limit = self.config.max_model_len  # 0: unknown, not checked here
        if limit and prompt_len >= limit:
            self._abort(Code.INVALID_ARGUMENT, f"prompt: {prompt_len} tokens leave no room to "
                        f"generate within the model's context length of {limit} tokens")
        if limit and params.max_tokens is not None and prompt_len + params.max_tokens > limit:
            self._abort(Code.INVALID_ARGUMENT, f"sampling.max_tokens: {params.max_tokens} with "
                        f"a {prompt_len}-token prompt exceeds the context length of {limit}")
        try:
            params.verify_max_logprobs(self.config.max_logprobs, len(self.core.tokenizer))
        except ValueError as e:
            self._abort(Code.INVALID_ARGUMENT, f"sampling.{e}")

    def _prefill(self, plan: Plan, prompt_ids: list[int]) -> engine_pb2.PrefillResponse | None:
        """First token and KV handle from a prefill instance; None: prefill on D instead."""
        req = engine_pb2.PrefillRequest(request_id=self.wire_id, prompt_token_ids=prompt_ids,
                                        sampling=self.request.sampling,
                                        cache_salt=self.request.cache_salt)
        tried: set[str] = set()
        for _ in range(self.config.prefill_attempts):
            p = self.core.planner.pick_prefill(plan.request, plan.decode, tried)
            if p is None:
                break
            tried.add(p.id)
            self.served.prefill_attempts += 1
            try:
                stub = self.core.channels.prefill(p.address)
                future = self._call(stub.Prefill.future, req, timeout=self._remaining())
                resp = self._await_alive(future, p)
            except _InstanceDead:
                self.core.forget_on_prefill(p.address, self.wire_id)
                self._check_client()
                self.core.registry.mark_down(p.id)
                logger.warning("request %s: prefill instance %s stopped answering", self.rid, p.id)
                continue
            except (grpc.RpcError, grpc.FutureCancelledError) as e:
                self.core.forget_on_prefill(p.address, self.wire_id)
                self._check_client()
                code = e.code() if isinstance(e, grpc.RpcError) else Code.CANCELLED
                if code == Code.INVALID_ARGUMENT:
                    self._abort(code, e.details())
                if code == Code.DEADLINE_EXCEEDED:
                    # The request's own deadline (the only one on the call): no retry.
                    self._abort(code, f"request {self.rid}: deadline passed during prefill")
                if code in DOWN_CODES:
                    self.core.registry.mark_down(p.id)
                logger.warning("request %s: prefill on %s failed (%s: %s)", self.rid, p.id,
                               code.name, _details(e))
                continue
            if not resp.HasField("handle") and not resp.finish_reason:
                logger.warning("request %s: %s answered without a KV handle", self.rid, p.id)
                continue
            if resp.prompt_logprobs and len(resp.prompt_logprobs) != len(prompt_ids):
                logger.warning("request %s: %s sent prompt_logprobs for %d of %d prompt "
                               "tokens", self.rid, p.id, len(resp.prompt_logprobs),
                               len(prompt_ids))
                self.core.forget_on_prefill(p.address, self.wire_id)  # its lease, if any
                continue
            if resp.HasField("handle"):
                if resp.handle.release_address not in (p.address, p.load.address):
                    resp.handle.release_address = p.address  # D releases only where P is
                self._set_lease((p.address, self.wire_id))
            self.served.prefill_instance = resp.instance_id or p.id
            self.served.disaggregated = True
            self.served.kv_connector = resp.handle.connector
            return resp
        return None

    def _first_message(self, first: engine_pb2.PrefillResponse, prompt_ids: list[int],
                       params: SamplingParams, decode_id: str) -> common_pb2.GenerateResponse:
        """The prefill's first token, sent at once; also the last message when it finished."""
        msg = common_pb2.GenerateResponse(
            request_id=self.rid, index=0, token_ids=[first.first_token_id], text=first.first_text,
            cumulative_logprob=first.first_logprob, prompt_token_ids=prompt_ids,
            prompt_logprobs=first.prompt_logprobs)
        if params.logprobs is not None:
            msg.logprobs.append(first.first_logprobs)
        if first.finish_reason:
            msg.finish_reason, msg.stop_reason = first.finish_reason, first.stop_reason
            msg.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(prompt_ids), completion_tokens=1,
                                                cached_tokens=first.num_cached_tokens))
        else:
            self.served.decode_instance = decode_id  # planned; the last message says who did
        msg.served_by.CopyFrom(self.served)
        return msg

    def _decode(self, plan: Plan, prompt_ids: list[int], params: SamplingParams,
                first: engine_pb2.PrefillResponse | None) -> Iterator[common_pb2.GenerateResponse]:
        """Stream D's generation to the client. While D has sent nothing, a dead D is retried
        elsewhere; once it has, a dead D's request migrates: another D recomputes the prompt
        and the tokens the client has, and the stream goes on where it stopped."""
        req = engine_pb2.DecodeRequest(request_id=self.wire_id, prompt_token_ids=prompt_ids,
                                       sampling=self.request.sampling,
                                       cache_salt=self.request.cache_salt)
        # A continuation (of P's prefill, or migrated) does not recompute the prompt's
        # logprobs: the client has them from the first message.
        continuing = common_pb2.SamplingParams()
        continuing.CopyFrom(self.request.sampling)
        continuing.ClearField("prompt_logprobs")
        sent, cached, connector = None, 0, ""
        if first is not None:
            req.sampling.CopyFrom(continuing)
            req.handle.CopyFrom(first.handle)
            req.output_token_ids.append(first.first_token_id)
            sent = Continuation([first.first_token_id], first.first_text, first.first_logprob)
            cached, connector = first.num_cached_tokens, first.handle.connector
        decode, tried, attempts = plan.decode, set(), 0
        while True:
            attempts += 1
            tried.add(decode.id)
            self.served.decode_instance = decode.id
            if first is None and not self.served.migrations:
                self.served.prefill_instance = decode.id
            relay = Relay(self.rid, prompt_ids, params.n, self.served, sent, cached)
            watch = None
            try:
                stub = self.core.channels.decode(decode.address)
                call = self._call(stub.Decode, req, timeout=self._remaining())
                with self.core.stream_watch.watching(call, decode) as watch:
                    for msg in call:
                        watch.seen()
                        out = relay.forward(msg)
                        if out is not None:
                            yield out
            except BrokenDecodeStream as e:
                call.cancel()
                self._abort(Code.UNAVAILABLE, f"decode instance {decode.id} sent {e}")
            except grpc.RpcError as e:
                self._check_client()
                if e.code() == Code.INVALID_ARGUMENT:  # the request's fault, on any D
                    self._abort(Code.INVALID_ARGUMENT, e.details())
                full = e.code() == Code.RESOURCE_EXHAUSTED  # busy, not down: try another
                down = not full and (watch is not None and watch.dead
                                     or self.core.is_down(decode))
                if down:
                    self.core.registry.mark_down(decode.id)
                retry = None
                if (down or full) and not relay.received and attempts < self.config.decode_attempts:
                    retry = self.core.planner.pick_decode(plan.request, tried, connector)
                elif down and relay.received and self._may_migrate(params):
                    retry = self.core.planner.pick_decode(plan.request, tried)
                    if retry is not None:
                        self.served.migrations += 1
                        sent = relay.sent
                        req, connector = sent.decode_request(self.wire_id, prompt_ids,
                                                             continuing), ""
                        req.cache_salt = self.request.cache_salt
                if retry is not None:
                    logger.warning("request %s: decode %s is %s %s, continuing on %s", self.rid,
                                   decode.id, "full" if full else "down", "mid-stream"
                                   if relay.received else "before streaming", retry.id)
                    decode = retry
                    continue
                where = "mid-stream" if relay.received else "before streaming"
                code = e.code() if e.code() in (Code.DEADLINE_EXCEEDED,
                                                Code.RESOURCE_EXHAUSTED) else Code.UNAVAILABLE
                self._abort(code, f"decode instance {decode.id} failed {where}: "
                                  f"{e.code().name}: {e.details()} (after "
                                  f"{self.served.migrations} migrations)")
            if not relay.complete:
                self._abort(Code.UNAVAILABLE, f"decode instance {decode.id} ended the stream "
                                              f"before finishing completions {relay.missing}")
            self._set_lease(None)  # D read the blocks and released them itself
            return

    def _may_migrate(self, params: SamplingParams) -> bool:
        """A request continues elsewhere when it has one sequence (the tokens the client has
        say where it stopped) and the migration budget is not spent."""
        return params.n == 1 and self.served.migrations < self.config.max_migrations

    # ------------------------------------------------------------------ plumbing
    def _await_alive(self, future: Any, instance: Instance) -> Any:
        """The call's result, however long the work takes, as long as its instance answers a
        liveness probe every `prefill_timeout_s` (a queued prefill is slow, not dead); the
        call's own deadline is the request's."""
        while True:
            try:
                return future.result(timeout=self.config.prefill_timeout_s)
            except grpc.FutureTimeoutError:
                self._check_client()
                if self.core.is_down(instance, "prefill"):
                    future.cancel()
                    raise _InstanceDead(instance.id) from None
                logger.info("request %s: prefill on %s still running; %s answers", self.rid,
                            instance.id, instance.id)

    def _remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            self._abort(Code.DEADLINE_EXCEEDED, f"request {self.rid}: deadline passed")
        return left

    def _call(self, start: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Start an outgoing call, registered for cancellation if the RPC ends."""
        with self._lock:
            if self._over:
                raise _ClientGone
            self._inflight = start(*args, **kwargs)
            return self._inflight

    def _check_client(self) -> None:
        with self._lock:
            if self._over:
                raise _ClientGone

    def _set_lease(self, lease: tuple[str, str] | None) -> None:
        with self._lock:
            self._lease = lease

    def _release_lease(self) -> None:
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is not None:
            self.core.forget_on_prefill(*lease)

    def _on_rpc_done(self) -> None:
        """gRPC calls this when the RPC ends for any reason (cancellation included): cancel
        the outgoing call (a no-op once it completed) and release a lease left on P."""
        with self._lock:
            self._over = True
            call, self._inflight = self._inflight, None
        if call is not None:
            call.cancel()
        self._release_lease()

    def _abort(self, code: grpc.StatusCode, message: str):
        logger.info("request %s: %s %s", self.rid, code.name, message)
        self._error = f"{code.name}: {message}"
        self.context.abort(code, message)


def _details(e: BaseException) -> str:
    return e.details() if isinstance(e, grpc.RpcError) else "cancelled"
