"""The model runner: owns the model and the KV cache tensor, executes one scheduled batch.

It turns a `SchedulerOutput` into flat input tensors and attention metadata, runs the model,
and samples the requests whose chunk reached their last known token (a pooling request's last
prompt token is pooled instead, pooling.py). It changes no request.
"""

from __future__ import annotations

import torch

from pdserve.config import EngineConfig
from pdserve.engine.draft_verifier import verify_drafts
from pdserve.engine.host_memory import keep_freed_memory
from pdserve.engine.pooling import pool_hidden
from pdserve.engine.sampler import Sampler, prompt_logprobs
from pdserve.engine.step_records import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from pdserve.kernels import native
from pdserve.kernels.attention import AttentionMetadata, PrefillSpan
from pdserve.kv_transfer.connector import KVConnector
from pdserve.kv_transfer.transport import prefault
from pdserve.models.llama import LlamaForCausalLM


def allocate_kv_cache(config: EngineConfig, num_blocks: int,
                      connector: KVConnector) -> torch.Tensor:
    """Zeroed cache of shape (layers, 2, num_blocks, block_size, kv_heads, head_dim), in
    memory the KV connector can serve from; every page faulted in with kv_cache_prefault."""
    arch = config.model.arch
    shape = (arch.num_hidden_layers, 2, num_blocks, config.cache.block_size,
             arch.num_key_value_heads, arch.head_dim)
    cache = connector.allocate_kv_cache(shape, config.model.dtype, config.device.device)
    if config.cache.kv_cache_prefault:
        prefault(cache)
    return cache


class ModelRunner:
    """Executes batches of scheduled chunks on one model replica."""

    def __init__(self, config: EngineConfig, model: LlamaForCausalLM, kv_cache: torch.Tensor):
        self.config = config
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = config.cache.block_size
        self.device = torch.device(config.device.device)
        self.sampler = Sampler(config.model.arch.vocab_size, config.model.seed)
        if self.device.type == "cpu":
            native.load()  # built (once per machine) now, not on the first request
            keep_freed_memory()  # steps reuse their activations' pages (host_memory.py)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        if not sched.chunks:
            return ModelRunnerOutput()
        input_ids, positions, meta = self._prepare(sched.chunks)
        rows = output_rows(sched.chunks)
        asked = None if len(rows) == len(input_ids) else self._tensor(rows)  # None: every row
        hidden = self.model(input_ids, positions, self.kv_cache, meta, asked)  # (len(rows), hidden)
        at = {row: i for i, row in enumerate(rows)}  # step row -> row of hidden
        out = ModelRunnerOutput()
        self._prompt_logprobs(sched.chunks, hidden, at, out)
        sampled, last_idx, verified, verify_idx = [], [], [], []
        end = 0
        for chunk in sched.chunks:
            end += chunk.num_tokens
            if chunk.completes_sequence and chunk.request.pooling_params is not None:
                out.pooled[chunk.request.request_id] = pool_hidden(
                    hidden[at[end - 1]], chunk.request.pooling_params)
            elif chunk.draft_token_ids:
                verified.append(chunk)
                verify_idx.extend(at[row] for row in range(end - 1 - len(chunk.draft_token_ids),
                                                           end))
            elif chunk.completes_sequence:
                sampled.append(chunk.request)
                last_idx.append(at[end - 1])
        if sampled or verified:
            logits = self.model.compute_logits(hidden[last_idx + verify_idx])  # (B + D, V)
            for request, result in zip(sampled, self.sampler(logits[:len(sampled)], sampled)):
                out.sampled[request.request_id] = result
            drafted = verify_drafts(verified, logits[len(sampled):], self.sampler)
            for chunk, (kept, result) in zip(verified, drafted):
                out.accepted[chunk.request.request_id] = kept
                out.sampled[chunk.request.request_id] = result
        return out

    def _prepare(self, chunks: list[ScheduledChunk]):
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        decode_idx: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSpan] = []
        bs = self.block_size
        for chunk in chunks:
            request, start, n = chunk.request, chunk.start, chunk.num_tokens
            t0 = len(ids)
            tokens = request.all_token_ids  # a new list: drafts may go on its end
            tokens += chunk.draft_token_ids
            ids.extend(tokens[start:start + n])
            table = chunk.block_table
            for p in range(start, start + n):
                pos.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            if n == 1 or chunk.draft_token_ids:  # a drafted chunk's rows: one decode each
                decode_idx.extend(range(t0, t0 + n))
                decode_tables.extend([table] * n)
                decode_lens.extend(range(start + 1, start + n + 1))
            else:
                prefills.append(PrefillSpan(t0, t0 + n, start + n, self._tensor(table)))
        width = max((len(t) for t in decode_tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in decode_tables]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            decode_token_idx=self._tensor(decode_idx),
            decode_block_tables=self._tensor(padded).view(len(padded), width),
            decode_seq_lens=self._tensor(decode_lens),
            prefills=prefills,
            drafts=any(chunk.draft_token_ids for chunk in chunks),
        )
        return self._tensor(ids), self._tensor(pos), meta

    def _prompt_logprobs(self, chunks: list[ScheduledChunk], hidden: torch.Tensor,
                         at: dict[int, int], out: ModelRunnerOutput) -> None:
        """Logprobs of prompt tokens 1..P-1 for requests that asked (positions in this chunk)."""
        t0 = 0
        for chunk in chunks:
            request, start, stop = chunk.request, chunk.start, _prompt_logprob_stop(chunk)
            k = request.sampling_params.prompt_logprobs
            if k is not None and start < stop:
                targets = request.prompt_token_ids[start + 1:stop + 1]
                first = at[t0]  # the chunk's rows up to stop are consecutive rows of hidden
                logits = self.model.compute_logits(hidden[first:first + stop - start])  # (n', V)
                out.prompt_logprobs[request.request_id] = (start, prompt_logprobs(logits,
                                                                                  targets, k))
            t0 += chunk.num_tokens

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


def _prompt_logprob_stop(chunk: ScheduledChunk) -> int:
    """The end of the chunk's positions whose next prompt token has a logprob to report."""
    return min(chunk.start + chunk.num_tokens, chunk.request.num_prompt_tokens - 1)


def output_rows(chunks: list[ScheduledChunk]) -> list[int]:
    """The step's rows whose final hidden states it uses, increasing: each chunk's rows with a
    prompt logprob to report, and the last row of a chunk that completes its sequence (to
    sample or pool). The model computes the last layer for these rows alone."""
    rows: list[int] = []
    t0 = 0
    for chunk in chunks:
        if chunk.request.sampling_params.prompt_logprobs is not None:
            rows.extend(range(t0, t0 + max(_prompt_logprob_stop(chunk) - chunk.start, 0)))
        if chunk.completes_sequence:  # with drafts: the last token's row and theirs
            rows.extend(range(t0 + chunk.num_tokens - 1 - len(chunk.draft_token_ids),
                              t0 + chunk.num_tokens))
        t0 += chunk.num_tokens
    return sorted(set(rows))
