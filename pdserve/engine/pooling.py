"""Embeddings for a causal LM: a pooling request prefills its prompt (chunked prefill and the
prefix cache apply as for any request) and, when its last chunk reaches the last prompt token,
the runner keeps that token's final hidden state (after the model's final norm) instead of
sampling. The request then finishes ("stop") and frees its blocks.

Here: the pooling itself (`pool_hidden`), the Request record of a pooling request, and the
pieces of LLM.embed / LLM.encode.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pdserve.engine.request import Request
from pdserve.outputs import EmbeddingRequestOutput, PoolingRequestOutput
from pdserve.pooling_params import PoolingParams
from pdserve.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine


def pool_hidden(hidden: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """One token's hidden state (hidden_size,) -> its embedding (float32, on the CPU): the
    first `dimensions` values (Matryoshka), then L2-normalized unless normalize=False."""
    x = hidden.detach().float()
    if params.dimensions is not None:
        x = x[:params.dimensions]
    if params.use_normalize:
        x = torch.nn.functional.normalize(x, p=2, dim=-1)
    return x.cpu()


def _internal_sampling_params() -> SamplingParams:
    """What the scheduler and output processor read of a pooling request: no sampling, no
    prompt logprobs, no detokenization, one final output."""
    params = SamplingParams(max_tokens=1, detokenize=False)
    params.output_kind = RequestOutputKind.FINAL_ONLY
    return params


def make_pooling_request(engine: LLMEngine, request_id: str, prompt_ids: list[int],
                         params: PoolingParams, arrival_time: float | None = None,
                         priority: int = 0) -> Request:
    """The Request record of an embedding; raises ValueError on bad input."""
    if not isinstance(params, PoolingParams):
        raise ValueError(f"pooling_params: expected PoolingParams, got {type(params).__name__}")
    params.verify(engine.config.model.arch.hidden_size)
    prompt_ids = params.truncate_prompt(prompt_ids, engine.config.model.max_model_len)
    max_len = engine.input_processor.max_len
    if len(prompt_ids) > max_len:
        raise ValueError(f"prompt: {len(prompt_ids)} tokens exceed max_model_len={max_len}")
    return Request(
        request_id=request_id, prompt_token_ids=list(prompt_ids),
        sampling_params=_internal_sampling_params(),
        eos_token_id=engine.input_processor.eos_token_id, priority=priority,
        arrival_time=time.monotonic() if arrival_time is None else arrival_time,
        pooling_params=params.clone())


def pooling_params_list(params: PoolingParams | Sequence[PoolingParams] | None,
                        count: int) -> list[PoolingParams]:
    """One PoolingParams per prompt from LLM.embed's `pooling_params` argument."""
    if params is None:
        params = PoolingParams()
    values = [params] * count if isinstance(params, PoolingParams) else list(params)
    if len(values) != count:
        raise ValueError(f"pooling_params: {len(values)} given for {count} prompts")
    for value in values:
        if not isinstance(value, PoolingParams):
            raise ValueError(f"pooling_params: expected PoolingParams, "
                             f"got {type(value).__name__}")
    return values


def add_pooling_prompts(engine: LLMEngine, prompts: list, pooling_params,
                        priority: list[int] | None = None) -> list[str]:
    """Queue every prompt as a pooling request; returns their ids (all or none queued)."""
    params = pooling_params_list(pooling_params, len(prompts))
    ids: list[str] = []
    try:
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            rid = engine.next_request_id()
            engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0)
            ids.append(rid)
    except Exception:
        engine.abort_request(ids)
        raise
    return ids


def to_embedding_outputs(outputs: list[PoolingRequestOutput]) -> list[EmbeddingRequestOutput]:
    return [EmbeddingRequestOutput.from_base(o) for o in outputs]
