"""Conversions between wire messages and engine objects, at the services' edges only."""

from __future__ import annotations

import json

from pdserve import untrusted_json
from pdserve.kv_transfer.connector import KVHandle
from pdserve.outputs import Logprob
from pdserve.pooling_params import PoolingParams
from pdserve.proto.pdserve.v1 import common_pb2
from pdserve.router.wire_names import check_address
from pdserve.sampling_params import SamplingParams
from pdserve.structured_outputs import StructuredOutputsParams

_OPTIONAL = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
             "frequency_penalty", "repetition_penalty", "seed", "max_tokens", "logprobs",
             "prompt_logprobs", "skip_special_tokens", "spaces_between_special_tokens",
             "detokenize", "truncate_prompt_tokens")


def params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Proto -> SamplingParams; invalid values raise ValueError naming the field."""
    kwargs = {name: getattr(msg, name) for name in _OPTIONAL if msg.HasField(name)}
    for name in ("stop", "stop_token_ids", "allowed_token_ids", "bad_words",
                 "logprob_token_ids"):
        values = list(getattr(msg, name))
        if values:
            kwargs[name] = values
    if msg.logit_bias:
        kwargs["logit_bias"] = dict(msg.logit_bias)
    if msg.HasField("structured_outputs"):
        kwargs["structured_outputs"] = structured_from_proto(msg.structured_outputs)
    params = SamplingParams(ignore_eos=msg.ignore_eos, min_tokens=msg.min_tokens,
                            include_stop_str_in_output=msg.include_stop_str_in_output,
                            flat_logprobs=msg.flat_logprobs, **kwargs)
    params.verify_wire_limits()
    return params


def params_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    """SamplingParams -> proto; a value the wire type cannot hold raises ValueError naming
    the field."""
    fields = dict(ignore_eos=p.ignore_eos, min_tokens=p.min_tokens,
                  include_stop_str_in_output=p.include_stop_str_in_output,
                  stop=p.stop or [], stop_token_ids=p.stop_token_ids or [],
                  allowed_token_ids=p.allowed_token_ids or [], bad_words=p.bad_words or [],
                  logit_bias=p.logit_bias or {}, logprob_token_ids=p.logprob_token_ids or [],
                  flat_logprobs=p.flat_logprobs)
    fields.update((name, getattr(p, name)) for name in _OPTIONAL
                  if getattr(p, name) is not None)
    msg = common_pb2.SamplingParams()
    for name, value in fields.items():
        try:
            msg.MergeFrom(common_pb2.SamplingParams(**{name: value}))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{name}: {e}") from e
    if p.structured_outputs is not None:
        msg.structured_outputs.CopyFrom(structured_to_proto(p.structured_outputs))
    return msg


_POOLING_FIELDS = ("normalize", "dimensions", "truncate_prompt_tokens")


def pooling_from_proto(msg: common_pb2.PoolingParams) -> PoolingParams:
    """Proto -> PoolingParams; invalid values raise ValueError naming the field."""
    try:
        return PoolingParams(**{n: getattr(msg, n) for n in _POOLING_FIELDS if msg.HasField(n)})
    except ValueError as e:
        raise ValueError(f"pooling.{e}") from None


def pooling_to_proto(p: PoolingParams) -> common_pb2.PoolingParams:
    return common_pb2.PoolingParams(**{n: getattr(p, n) for n in _POOLING_FIELDS
                                       if getattr(p, n) is not None})


def structured_from_proto(msg: common_pb2.StructuredOutputs) -> StructuredOutputsParams:
    """Checked like any user's constraint: ValueError naming the field."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured_outputs: no constraint kind is set")
    value = list(msg.choice.choices) if kind == "choice" else getattr(msg, kind)
    return StructuredOutputsParams(**{kind: value},
                                   disable_any_whitespace=msg.disable_any_whitespace)


def structured_to_proto(p: StructuredOutputsParams) -> common_pb2.StructuredOutputs:
    spec = p.spec
    msg = common_pb2.StructuredOutputs(disable_any_whitespace=not spec.any_whitespace)
    if spec.kind == "choice":
        msg.choice.choices.extend(json.loads(spec.source))
    elif spec.kind == "json_object":
        msg.json_object = True
    else:
        setattr(msg, spec.kind, spec.source)
    return msg


def handle_to_proto(h: KVHandle) -> common_pb2.KVHandle:
    return common_pb2.KVHandle(
        request_id=h.request_id, engine_id=h.engine_id, connector=h.connector,
        descriptor_json=json.dumps(h.descriptor), block_ids=list(h.block_ids),
        block_hashes=list(h.block_hashes), num_tokens=h.num_tokens,
        lease_expires_at=h.lease_expires_at, release_address=h.release_address,
        lease_token=h.lease_token)


def handle_from_proto(msg: common_pb2.KVHandle) -> KVHandle:
    try:
        descriptor = untrusted_json.loads(msg.descriptor_json)
    except ValueError as e:
        raise ValueError(f"handle.descriptor_json: not JSON ({e})") from e
    if not isinstance(descriptor, dict):
        raise ValueError(f"handle.descriptor_json: must be a JSON object, got "
                         f"{type(descriptor).__name__}")
    if descriptor.get("kind") != msg.connector:
        raise ValueError(f"handle.connector: {msg.connector!r} does not match the descriptor")
    if msg.release_address:  # the decode side dials it to release the lease
        check_address(msg.release_address, "handle.release_address")
    return KVHandle(msg.request_id, msg.engine_id, descriptor, tuple(msg.block_ids),
                    tuple(msg.block_hashes), msg.num_tokens, msg.lease_expires_at,
                    msg.release_address, msg.lease_token)


def logprobs_to_proto(entry: dict[int, Logprob] | None,
                      sampled: int) -> common_pb2.PositionLogprobs:
    """One position's logprobs, the sampled token first."""
    if not entry:
        return common_pb2.PositionLogprobs()
    order = [sampled] + [t for t in entry if t != sampled]
    return common_pb2.PositionLogprobs(entries=[
        common_pb2.TopLogprob(token_id=t, logprob=entry[t].logprob, rank=entry[t].rank or 0,
                              decoded_token=entry[t].decoded_token or "")
        for t in order if t in entry])


def prompt_logprobs_to_proto(entries: list[dict[int, Logprob] | None] | None,
                             prompt_ids: list[int]) -> list[common_pb2.PositionLogprobs]:
    """A RequestOutput's prompt_logprobs (one per prompt token, None first), the prompt token
    first at each position; [] when none were asked."""
    if entries is None:
        return []
    return [logprobs_to_proto(e, t) for e, t in zip(entries, prompt_ids)]


def prompt_from_proto(msg) -> dict:
    """A Prefill or Decode request's prompt as the engine takes it (a TokensPrompt, with the
    request's cache_salt when it has one: the engine checks it)."""
    prompt: dict = {"prompt_token_ids": list(msg.prompt_token_ids)}
    if msg.cache_salt:
        prompt["cache_salt"] = msg.cache_salt
    return prompt
