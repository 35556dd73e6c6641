"""RouterBackend: the gateway in front of a disaggregated cluster (`pdserve up`), as a gRPC
client of `Router.Generate` (server streaming).

`generate` waits for the router's first message, so that a rejected request (bad input, no
instance) surfaces as an HTTP error rather than as a broken stream. Closing a stream cancels
the call; the router then cancels its decode call, and the decode instance frees the blocks.
"""

from __future__ import annotations

import os

import grpc

from pdserve.gateway.backend import (
    Backend,
    BackendError,
    BackendOverloaded,
    BackendStats,
    BackendTimeout,
    BackendUnavailable,
    Delta,
    DeltaStream,
    ModelInfo,
    PositionLogprobs,
    ServedBy,
    TokenLogprob,
    Usage,
)
from pdserve.pooling_params import PoolingParams
from pdserve.proto.pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from pdserve.sampling_params import SamplingParams
from pdserve.services.auth import CHANNEL_OPTIONS, SECRET_ENV, Credentials
from pdserve.services.convert import params_to_proto, pooling_to_proto

_ERRORS = {
    grpc.StatusCode.UNAVAILABLE: BackendUnavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: BackendOverloaded,
    grpc.StatusCode.DEADLINE_EXCEEDED: BackendTimeout,
}
CONTROL_TIMEOUT_S = 2.0


def map_rpc_error(e: grpc.RpcError) -> Exception:
    """A router status as the exception the gateway turns into an HTTP status."""
    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return ValueError(e.details())
    return _ERRORS.get(e.code(), BackendError)(f"router: {e.code().name}: {e.details()}")


def _add_token_ids(msg: router_pb2.TokenIds, ids: list[int]) -> None:
    """The prompt's ids into `msg`; the router checks them against the vocabulary."""
    try:
        msg.ids.extend(ids)
    except (ValueError, TypeError) as e:
        raise ValueError(f"prompt: a token id does not fit the wire's int32 ({e})") from e


class RouterBackend(Backend):
    supports_prompt_logprobs = True  # on the router's first message
    def __init__(self, address: str, model: str, max_model_len: int | None = None,
                 timeout_s: float | None = None, credentials: Credentials | None = None,
                 sampling_defaults: tuple = (), max_tokens_cap: int | None = None,
                 revision: str | None = None):
        """`model`: the name or path the instances serve (its tokenizer and context length);
        `sampling_defaults`, `max_tokens_cap`: its recommended settings, as ModelInfo's."""
        self.sampling_defaults = tuple(sampling_defaults)
        self.max_tokens_cap = max_tokens_cap
        if max_model_len is None:
            from pdserve.models.loader import load_arch, resolve_model

            max_model_len = load_arch(resolve_model(model, revision)).max_position_embeddings
        self.address = address
        self.model = model
        self.max_model_len = max_model_len
        self.timeout_s = timeout_s
        self._channel: grpc.aio.Channel | None = None
        # Inside the cluster: the cluster secret on every call (default: from the environment),
        # over mutual TLS when the credentials have certificates.
        self._credentials = credentials or Credentials.load(env={
            SECRET_ENV: os.environ.get(SECRET_ENV, "")})
        self._metadata = self._credentials.call_metadata()
        self._calls: dict[str, grpc.aio.UnaryStreamCall] = {}

    @property
    def stub(self) -> router_pb2_grpc.RouterStub:
        # NOTE: an aio channel belongs to the event loop that made it: make it on first use.
        if self._channel is None:
            tls = self._credentials.tls
            # Short reconnect backoff: a restarted router is reachable again within a second.
            self._channel = (
                grpc.aio.secure_channel(self.address, tls.channel_credentials(), CHANNEL_OPTIONS)
                if tls is not None else grpc.aio.insecure_channel(self.address, CHANNEL_OPTIONS))
        return router_pb2_grpc.RouterStub(self._channel)

    async def embed(self, request_id: str, prompt_ids: list[int],
                    pooling: PoolingParams) -> list[float]:
        req = router_pb2.EmbedRequest(request_id=request_id, pooling=pooling_to_proto(pooling))
        _add_token_ids(req.token_ids, prompt_ids)
        try:
            resp = await self.stub.Embed(req, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            raise map_rpc_error(e) from None
        return list(resp.embedding)

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams, priority: int = 0,
                       cache_salt: str | None = None) -> DeltaStream:
        if priority:  # NOTE: the router and its instances schedule first come, first served
            raise ValueError(f"priority: {priority} is not supported through the router "
                             f"(only 0)")
        req = router_pb2.GenerateRequest(request_id=request_id, sampling=params_to_proto(params),
                                         cache_salt=cache_salt or "")
        if isinstance(prompt, str):
            req.text = prompt
        else:
            _add_token_ids(req.token_ids, prompt)
        call = self.stub.Generate(req, timeout=self.timeout_s, metadata=self._metadata)
        self._calls[request_id] = call
        stream = _RouterStream(self, request_id, call, params)
        try:
            await stream.peek()
        except BaseException:
            await stream.aclose()
            raise
        return stream

    async def abort(self, request_id: str) -> None:
        call = self._calls.pop(request_id, None)
        if call is not None:
            call.cancel()

    async def _list_response(self) -> router_pb2.ListInstancesResponse:
        try:
            return await self.stub.ListInstances(router_pb2.ListInstancesRequest(),
                                                 timeout=CONTROL_TIMEOUT_S,
                                                 metadata=self._metadata)
        except grpc.RpcError as e:
            raise BackendUnavailable(f"router at {self.address}: {e.code().name}") from e

    async def _list(self) -> list[common_pb2.Load]:
        return list((await self._list_response()).instances)

    async def health(self) -> bool:
        try:
            loads = await self._list()
        except BackendError:
            return False
        return any(load.role in ("decode", "colocated") for load in loads)

    def models(self) -> list[ModelInfo]:
        return [ModelInfo(self.model, self.model, self.max_model_len,
                          sampling_defaults=self.sampling_defaults,
                          max_tokens_cap=self.max_tokens_cap)]

    async def stats(self) -> BackendStats:
        listed = await self._list_response()
        loads = list(listed.instances)
        roles: dict[str, int] = {}
        for load in loads:
            roles[load.role] = roles.get(load.role, 0) + 1
        drafting = [x for x in loads if x.speculative]
        return BackendStats(
            running_requests=sum(x.running_requests for x in loads),
            waiting_requests=sum(x.waiting_requests for x in loads),
            free_blocks=sum(x.free_blocks for x in loads),
            total_blocks=sum(x.total_blocks for x in loads),
            prefix_queries=_sum(loads, "prefix_queries"),
            prefix_hits=_sum(loads, "prefix_hits"),
            kv_transfer_bytes=_sum(loads, "kv_bytes_received"),
            kv_transfer_seconds=_sum(loads, "kv_transfer_seconds"),
            spec_drafts=_sum(drafting, "spec_drafts") if drafting else None,
            spec_draft_tokens=_sum(drafting, "spec_draft_tokens") if drafting else None,
            spec_accepted_tokens=_sum(drafting, "spec_accepted_tokens") if drafting else None,
            prefix_index_errors=listed.prefix_index_errors, instances=roles)

    async def close(self) -> None:
        for call in list(self._calls.values()):
            call.cancel()
        if self._channel is not None:
            await self._channel.close()


def _sum(loads: list[common_pb2.Load], name: str):
    """Sum of a Load field, or None when this proto version has no such field."""
    if name not in common_pb2.Load.DESCRIPTOR.fields_by_name:
        return None
    return sum(getattr(x, name) for x in loads)


class _RouterStream(DeltaStream):
    def __init__(self, backend: RouterBackend, request_id: str, call, params: SamplingParams):
        self._backend = backend
        self._request_id = request_id
        self._call = call
        self._stop_token_ids = set(params.stop_token_ids or ())
        self._peeked: Delta | None = None
        self._done = False

    async def peek(self) -> None:
        self._peeked = await self._read()

    async def _read(self) -> Delta | None:
        try:
            msg = await self._call.read()
        except grpc.RpcError as e:
            self._finish()
            raise map_rpc_error(e) from e
        if msg is grpc.aio.EOF:
            self._finish()
            return None
        return self._delta(msg)

    async def __anext__(self) -> Delta:
        if self._peeked is not None:
            delta, self._peeked = self._peeked, None
            return delta
        if self._done:
            raise StopAsyncIteration
        delta = await self._read()
        if delta is None:
            raise StopAsyncIteration
        return delta

    def _delta(self, msg: common_pb2.GenerateResponse) -> Delta:
        logprobs = _positions(msg.logprobs) if msg.logprobs else None
        stop_reason: int | str | None = msg.stop_reason or None
        if stop_reason and stop_reason.isdigit() and int(stop_reason) in self._stop_token_ids:
            stop_reason = int(stop_reason)
        served_by = None
        if msg.HasField("served_by"):
            s = msg.served_by
            served_by = ServedBy(s.prefill_instance, s.decode_instance, s.disaggregated,
                                 s.prefill_attempts, s.kv_connector)
        usage = None
        if msg.HasField("usage"):
            usage = Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens,
                          msg.usage.cached_tokens)
        return Delta(msg.index, list(msg.token_ids), msg.text, logprobs,
                     finish_reason=msg.finish_reason or None, stop_reason=stop_reason,
                     prompt_token_ids=list(msg.prompt_token_ids) or None, usage=usage,
                     served_by=served_by,
                     prompt_logprobs=_positions(msg.prompt_logprobs) or None)

    def _finish(self) -> None:
        self._done = True
        self._backend._calls.pop(self._request_id, None)

    async def aclose(self) -> None:
        if not self._done:
            self._call.cancel()
        self._finish()


def _positions(msgs) -> list[PositionLogprobs]:
    """PositionLogprobs messages as the gateway's (an empty position is None)."""
    return [[TokenLogprob(e.token_id, e.logprob, e.rank or None, e.decoded_token)
             for e in pos.entries] or None for pos in msgs]
