"""Paged attention over the block-structured KV cache: torch reference ops.

Cache layout, per layer: k_cache, v_cache of shape (num_blocks, block_size, num_kv_heads,
head_dim), contiguous. Token t of a sequence lives in block `block_table[t // block_size]` at
offset `t % block_size`; its flat slot is `block * block_size + offset`.

A step's tokens are flattened into one batch of T tokens. Sequences that add exactly one token
("decodes") are attended together; sequences that add several ("prefills", whole or chunked,
maybe after a cached prefix) are attended one by one with a causal mask offset by their context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """Tokens [token_start, token_end) of the batch; the sequence then holds `context_len`."""

    token_start: int
    token_end: int
    context_len: int
    block_table: torch.Tensor  # (num_blocks_of_seq,) int64

    @property
    def num_new(self) -> int:
        return self.token_end - self.token_start


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) int64 flat cache slot for every token
    decode_token_idx: torch.Tensor  # (Bd,) int64 positions in the batch of decode tokens
    decode_block_tables: torch.Tensor  # (Bd, max_blocks) int64, padded with 0
    decode_seq_lens: torch.Tensor  # (Bd,) int64 context length including the new token
    prefills: list[PrefillSpan]

    @property
    def num_decodes(self) -> int:
        return int(self.decode_token_idx.numel())


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new keys/values. k, v: (T, kvh, d); caches: (num_blocks, block_size, kvh, d)."""
    kvh, d = k.shape[1], k.shape[2]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence: (length, kvh, d)."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    return cache[block_table[:num_blocks]].flatten(0, 1)[:length]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query per sequence. q: (B, h, d) -> (B, h, d).

    Written as two batched matmuls over the query heads grouped by KV head: on CPU this is an
    order of magnitude faster than SDPA's masked GQA path for single-token queries.
    """
    B, h, d = q.shape
    block_size, kvh = k_cache.shape[1], k_cache.shape[2]
    max_len = int(seq_lens.max())
    tables = block_tables[:, :-(-max_len // block_size)]
    k = k_cache[tables].flatten(1, 2)[:, :max_len]  # (B, L, kvh, d)
    v = v_cache[tables].flatten(1, 2)[:, :max_len]  # (B, L, kvh, d)
    qg = q.view(B, kvh, h // kvh, d)  # (B, kvh, g, d)
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)) * scale  # (B, kvh, g, L)
    pad = torch.arange(max_len, device=q.device)[None, :] >= seq_lens[:, None]  # (B, L)
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    out = torch.matmul(probs, v.transpose(1, 2))  # (B, kvh, g, d)
    return out.reshape(B, h, d)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, span: PrefillSpan, scale: float) -> torch.Tensor:
    """Causal attention for one sequence's new tokens. q: (n, h, d), k/v: (n, kvh, d).

    With no cached context the new keys are used as they are; otherwise the whole context is
    read back from the cache (the new tokens were written there already).
    """
    n, h, _ = q.shape
    past = span.context_len - n
    if past == 0:
        k_all, v_all = k, v
        mask = None
    else:
        k_all = gather_kv(k_cache, span.block_table, span.context_len)
        v_all = gather_kv(v_cache, span.block_table, span.context_len)
        rows = torch.arange(n, device=q.device)[:, None] + past
        mask = torch.arange(span.context_len, device=q.device)[None, :] <= rows  # (n, ctx)
    group = h // k_all.shape[1]
    k_all = k_all.transpose(0, 1).repeat_interleave(group, dim=0)  # (h, ctx, d)
    v_all = v_all.transpose(0, 1).repeat_interleave(group, dim=0)  # (h, ctx, d)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k_all, v_all, attn_mask=mask,
                                         is_causal=mask is None, scale=scale)  # (h, n, d)
    return out.transpose(0, 1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Write this step's K/V into the cache and attend. q: (T, h, d), k/v: (T, kvh, d)."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    if meta.num_decodes:
        idx = meta.decode_token_idx
        out[idx] = decode_attention(q[idx], k_cache, v_cache, meta.decode_block_tables,
                                    meta.decode_seq_lens, scale)
    for span in meta.prefills:
        s, e = span.token_start, span.token_end
        out[s:e] = prefill_attention(q[s:e], k[s:e], v[s:e], k_cache, v_cache, span, scale)
    return out
