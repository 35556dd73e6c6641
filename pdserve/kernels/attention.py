"""Paged attention over the block-structured KV cache: torch reference ops.

Cache layout, per layer: k_cache, v_cache of shape (num_blocks, block_size, num_kv_heads,
head_dim), contiguous. Token t of a sequence lives in block `block_table[t // block_size]` at
offset `t % block_size`; its flat slot is `block * block_size + offset`.

A step's tokens are flattened into one batch of T tokens. Sequences that add exactly one token
("decodes") are attended together; sequences that add several ("prefills", whole or chunked,
maybe after a cached prefix) are attended one by one with a causal mask offset by their context.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_decode, cpu_prefill


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
    # Some decode rows are drafts after another row of the same sequence (ngram_drafts.py):
    # each reads the keys and values that the rows before it write in the same step.
    drafts: bool = False
    # Derived once per step from the fields above, on first use, then shared by every layer.
    _decode_plan: SparseDecodePlan | DecodePlan | None = field(default=None, init=False,
                                                               repr=False)
    _decode_rows: torch.Tensor | None = field(default=None, init=False, repr=False)

    @property
    def num_decodes(self) -> int:
        return int(self.decode_token_idx.numel())

    def decode_plan(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
                    ) -> tuple[SparseDecodePlan | DecodePlan, torch.Tensor]:
        """The decode plan and the batch positions of its rows (in plan order); made by the
        first layer, as every layer has the same shapes."""
        if self._decode_plan is None:
            self._decode_plan = _make_plan(q, k_cache, v_cache, self.decode_block_tables,
                                           self.decode_seq_lens)
            self._decode_rows = self.decode_token_idx.index_select(0, self._decode_plan.order)
        return self._decode_plan, self._decode_rows


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
    return cache.index_select(0, block_table[:num_blocks]).flatten(0, 1)[:length]


# Decode attention reads every sequence's whole context from scattered cache blocks, and on
# CPU that read is what costs. Two implementations, both over the decodes sorted by context
# length and cut into groups of similar lengths (`_group_by_length`):
#
# * sparse (CPU, float32/float64): the scores are a sampled dense-dense product, q times the
#   keys each query may see, read straight from the cache: `sampled_addmm` over a CSR pattern
#   whose row (sequence, head) lists the cache rows (slot, kv head) of the sequence's tokens;
#   the output is the CSR probabilities times the cache's values (`CSR @ dense`, MKL). No
#   context is copied, and each key is dotted only with the heads that use it. Rows of a
#   group are padded to the group's longest context with -inf scores, so the softmax runs on
#   dense (rows, length) views.
# * dense (other devices and dtypes): each group gathers its blocks once with `index_select`
#   (a chunk small enough to stay in cache) and runs two bmms on the gathered (n, L, kvh * d)
#   keys/values in place, with the query heads laid out block-diagonally over the KV heads
#   (multiplying zeros is cheaper than permuting, i.e. copying, the keys).
_DENSE_CHUNK_TOKENS = 8192  # padded context tokens per dense chunk
_MAX_PADDING = 1.25  # at most this many (padded) tokens per real one in a group


def _group_by_length(lens: list[int], max_tokens: int | None
                     ) -> tuple[list[int], list[tuple[int, int]]]:
    """Rows sorted by length, and [start, end) bounds of groups of similar lengths."""
    order = sorted(range(len(lens)), key=lens.__getitem__)
    bounds, start, real = [], 0, 0
    for i, row in enumerate(order):
        n, longest = i - start + 1, lens[row]
        if i > start and ((max_tokens is not None and n * longest > max_tokens)
                          or n * longest > _MAX_PADDING * (real + longest)):
            bounds.append((start, i))
            start, real = i, 0
        real += longest
    bounds.append((start, len(order)))
    return order, bounds


def _sorted_slots(block_tables: torch.Tensor, order: torch.Tensor, start: int, end: int,
                  length: int, block_size: int) -> torch.Tensor:
    """(n, length) cache slots of positions 0..length-1 of sorted rows [start, end); past a
    row's context they point at other allocated or padding blocks (valid, never attended)."""
    rows = order[start:end]
    nb = -(-length // block_size)
    tables = block_tables.index_select(0, rows)[:, :nb]  # (n, nb)
    offsets = torch.arange(block_size, device=tables.device)
    return (tables[:, :, None] * block_size + offsets).view(len(rows), -1)[:, :length]


@dataclass
class SparseDecodePlan:
    """CSR pattern of one step's decode attention (the same for every layer)."""

    order: torch.Tensor  # (Bd,) int64: decode rows sorted by context length
    pattern: torch.Tensor  # (Bd * h, cache rows) CSR: 0 where attended, -inf on padding
    groups: list[tuple[int, int, int]]  # (first value, rows, padded length) per group


def plan_sparse_decode(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                       num_heads: int, num_kv_heads: int, num_cache_rows: int
                       ) -> SparseDecodePlan:
    lens = seq_lens.tolist()
    order_list, bounds = _group_by_length(lens, None)
    device = block_tables.device
    order = torch.tensor(order_list, dtype=torch.long, device=device)
    kv_of_head = torch.arange(num_heads, device=device) // (num_heads // num_kv_heads)
    cols, inits, row_lens, groups = [], [], [], []
    first = 0
    for s, e in bounds:
        length = lens[order_list[e - 1]]
        n = e - s
        slots = _sorted_slots(block_tables, order, s, e, length, block_size)  # (n, L)
        cols.append((slots[:, None, :] * num_kv_heads + kv_of_head[None, :, None]).reshape(-1))
        init = torch.zeros(n, 1, length, device=device)
        if lens[order_list[s]] != length:
            row_len = torch.tensor([lens[r] for r in order_list[s:e]], device=device)
            pad = torch.arange(length, device=device)[None, :] >= row_len[:, None]
            init.masked_fill_(pad[:, None, :], float("-inf"))
        inits.append(init.expand(n, num_heads, length).reshape(-1))
        row_lens.append(torch.full((n * num_heads,), length, dtype=torch.int32))
        groups.append((first, n * num_heads, length))
        first += n * num_heads * length
    crow = torch.zeros(len(lens) * num_heads + 1, dtype=torch.int32)
    torch.cumsum(torch.cat(row_lens), 0, out=crow[1:])
    with warnings.catch_warnings():  # "CSR support is in beta", once per process
        warnings.simplefilter("ignore", UserWarning)
        pattern = torch.sparse_csr_tensor(
            crow.to(device), torch.cat(cols).to(torch.int32), torch.cat(inits),
            size=(len(lens) * num_heads, num_cache_rows), check_invariants=False)
    return SparseDecodePlan(order, pattern, groups)


def _sparse_decode(q_sorted: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   plan: SparseDecodePlan, scale: float) -> torch.Tensor:
    """q_sorted: (Bd, h, d) in plan order -> (Bd, h, d) in plan order."""
    B, h, d = q_sorted.shape
    pattern = plan.pattern
    if pattern.dtype != q_sorted.dtype:
        pattern = pattern.to(q_sorted.dtype)
    keys = k_cache.view(-1, d)  # (cache rows = slot * kvh + kv head, d)
    scores = torch.sparse.sampled_addmm(pattern, q_sorted.reshape(B * h, d), keys.t(),
                                        beta=1.0, alpha=scale).values()
    probs = [scores[first:first + rows * length].view(rows, length).softmax(dim=-1).view(-1)
             for first, rows, length in plan.groups]
    probs = probs[0] if len(probs) == 1 else torch.cat(probs)
    p = torch.sparse_csr_tensor(pattern.crow_indices(), pattern.col_indices(), probs,
                                size=pattern.shape, check_invariants=False)
    return (p @ v_cache.view(-1, d)).view(B, h, d)


def _use_sparse(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)
            and k_cache.is_contiguous() and v_cache.is_contiguous())


@dataclass
class DecodeChunk:
    """Rows [start, end) of the length-sorted decode batch, attended together."""

    start: int
    end: int
    length: int  # the longest context in the chunk
    blocks: torch.Tensor  # (n * num_blocks,) int64: each row's first num_blocks blocks
    pad_mask: torch.Tensor | None  # (n, 1, length) bool, True past a row's context


@dataclass
class DecodePlan:
    order: torch.Tensor  # (Bd,) int64: decode rows sorted by context length
    chunks: list[DecodeChunk]


def plan_decode(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                chunk_tokens: int = _DENSE_CHUNK_TOKENS) -> DecodePlan:
    """Sort the decodes by context length and cut them into chunks (dense path)."""
    lens = seq_lens.tolist()
    order, bounds = _group_by_length(lens, chunk_tokens)
    order_t = torch.tensor(order, dtype=torch.long, device=block_tables.device)
    sorted_tables = block_tables.index_select(0, order_t)
    sorted_lens = seq_lens.index_select(0, order_t)
    chunks = []
    for s, e in bounds:
        length = lens[order[e - 1]]
        nb = -(-length // block_size)
        pad_mask = None
        if lens[order[s]] != length:
            pos = torch.arange(length, device=seq_lens.device)
            pad_mask = (pos[None, :] >= sorted_lens[s:e, None])[:, None, :]
        chunks.append(DecodeChunk(s, e, length, sorted_tables[s:e, :nb].reshape(-1), pad_mask))
    return DecodePlan(order_t, chunks)


def _block_diagonal(q: torch.Tensor, num_kv_heads: int, scale: float) -> torch.Tensor:
    """(n, h, d) -> (n, h, kvh * d), times scale: head j keeps its d values in the columns of
    its KV head, zeros elsewhere."""
    n, h, d = q.shape
    eye = torch.eye(num_kv_heads, dtype=q.dtype, device=q.device) * scale
    blocks = q.view(n, num_kv_heads, h // num_kv_heads, 1, d) * eye.view(
        1, num_kv_heads, 1, num_kv_heads, 1)  # (n, kvh, g, kvh', d)
    return blocks.view(n, h, num_kv_heads * d)


def _attend_chunk(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  chunk: DecodeChunk, scale: float) -> torch.Tensor:
    """q: (n, h, d) of the chunk's rows -> (n, h, d)."""
    n, h, d = q.shape
    kvh = k_cache.shape[2]
    length = chunk.length
    k = k_cache.index_select(0, chunk.blocks).view(n, -1, kvh * d)[:, :length]  # (n, L, kvh*d)
    v = v_cache.index_select(0, chunk.blocks).view(n, -1, kvh * d)[:, :length]
    scores = torch.bmm(_block_diagonal(q, kvh, scale), k.transpose(1, 2))  # (n, h, L)
    if chunk.pad_mask is not None:
        scores.masked_fill_(chunk.pad_mask, float("-inf"))
    probs = scores.softmax(dim=-1)
    out = torch.bmm(probs, v).view(n, kvh, h // kvh, kvh, d)  # (n, kvh, g, kvh', d)
    return out.diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(n, h, d)


def _dense_decode(q_sorted: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  plan: DecodePlan, scale: float) -> torch.Tensor:
    """Decode attention for queries already in `plan.order`; output in the same order."""
    if len(plan.chunks) == 1:
        return _attend_chunk(q_sorted, k_cache, v_cache, plan.chunks[0], scale)
    out = torch.empty_like(q_sorted)
    for chunk in plan.chunks:
        s, e = chunk.start, chunk.end
        out[s:e] = _attend_chunk(q_sorted[s:e], k_cache, v_cache, chunk, scale)
    return out


def _make_plan(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor
               ) -> SparseDecodePlan | DecodePlan:
    block_size, kvh, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    if _use_sparse(q, k_cache, v_cache):
        return plan_sparse_decode(block_tables, seq_lens, block_size, q.shape[1], kvh,
                                  k_cache.numel() // d)
    return plan_decode(block_tables, seq_lens, block_size)


def _decode(q_sorted: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            plan: SparseDecodePlan | DecodePlan, scale: float) -> torch.Tensor:
    if isinstance(plan, SparseDecodePlan):
        return _sparse_decode(q_sorted, k_cache, v_cache, plan, scale)
    return _dense_decode(q_sorted, k_cache, v_cache, plan, scale)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query per sequence. q: (B, h, d) -> (B, h, d)."""
    plan = _make_plan(q, k_cache, v_cache, block_tables, seq_lens)
    out_sorted = _decode(q.index_select(0, plan.order), k_cache, v_cache, plan, scale)
    return torch.empty_like(q).index_copy_(0, plan.order, out_sorted)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, span: PrefillSpan, scale: float) -> torch.Tensor:
    """Causal attention for one sequence's new tokens. q: (n, h, d), k/v: (n, kvh, d).

    With no cached context the new keys are used as they are; otherwise the whole context is
    read back from the cache (the new tokens were written there already). SDPA gets 4-D
    (batch of one) inputs: on CPU its fused kernel only serves those, and the 3-D fallback is
    several times slower.
    """
    n = q.shape[0]
    past = span.context_len - n
    if past == 0:
        k_all, v_all = k, v
        mask = None
    else:
        k_all = gather_kv(k_cache, span.block_table, span.context_len)
        v_all = gather_kv(v_cache, span.block_table, span.context_len)
        rows = torch.arange(n, device=q.device)[:, None] + past
        mask = torch.arange(span.context_len, device=q.device)[None, :] <= rows  # (n, ctx)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k_all.transpose(0, 1)[None], v_all.transpose(0, 1)[None],
        attn_mask=mask, is_causal=mask is None, scale=scale,
        enable_gqa=k_all.shape[1] != q.shape[1])  # (1, h, n, d)
    return out[0].transpose(0, 1)


def masked_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_table: torch.Tensor, context_len: int, scale: float,
                     softcap: float | None, sliding_window: int | None) -> torch.Tensor:
    """Attention of one sequence's last n = q.shape[0] tokens over its cached context, with
    explicit scores: (q . k) * scale, then softcap * tanh(scores / softcap) when set, then
    the mask (key j is seen by the query at position p when j <= p and, with a window W,
    j > p - W), softmax in float32, times v. q: (n, h, d) -> (n, h, d)."""
    n, h, d = q.shape
    k_all = gather_kv(k_cache, block_table, context_len)  # (L, kvh, d)
    v_all = gather_kv(v_cache, block_table, context_len)
    group = h // k_all.shape[1]
    k_all = k_all.repeat_interleave(group, dim=1).transpose(0, 1)  # (h, L, d)
    v_all = v_all.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(q.transpose(0, 1), k_all.transpose(1, 2)) * scale  # (h, n, L)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    pos = torch.arange(context_len - n, context_len, device=q.device)[:, None]  # (n, 1)
    keys = torch.arange(context_len, device=q.device)[None, :]  # (1, L)
    visible = keys <= pos
    if sliding_window is not None:
        visible &= keys > pos - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v_all.dtype)
    return torch.matmul(probs, v_all).transpose(0, 1)  # (n, h, d)


def _masked_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: AttentionMetadata, scale: float, softcap: float | None,
                            sliding_window: int | None) -> torch.Tensor:
    """Every decode and prefill span through `masked_attention`, one sequence at a time."""
    out = torch.empty_like(q)
    lens = meta.decode_seq_lens.tolist()
    for i, row in enumerate(meta.decode_token_idx.tolist()):
        out[row:row + 1] = masked_attention(q[row:row + 1], k_cache, v_cache,
                                            meta.decode_block_tables[i], lens[i], scale,
                                            softcap, sliding_window)
    for span in meta.prefills:
        s, e = span.token_start, span.token_end
        out[s:e] = masked_attention(q[s:e], k_cache, v_cache, span.block_table,
                                    span.context_len, scale, softcap, sliding_window)
    return out


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    softcap: float | None = None, sliding_window: int | None = None
                    ) -> torch.Tensor:
    """Write this step's K/V into the cache and attend. q: (T, h, d), k/v: (T, kvh, d).

    With `softcap` (scores -> softcap * tanh(scores / softcap)) or `sliding_window` (a query
    at position p sees keys p - sliding_window + 1 .. p) set, attention takes the simple
    explicit-score path (`masked_attention`); otherwise the fast paths below: decodes and
    prefills through the native CPU kernels where they apply (cpu_decode.py, cpu_prefill.py),
    else the torch plans and SDPA above."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    if softcap is not None or sliding_window is not None:
        return _masked_paged_attention(q, k_cache, v_cache, meta, scale, softcap,
                                       sliding_window)
    native = cpu_decode.supports(q, k_cache, v_cache)
    if meta.num_decodes and native:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        cpu_decode.decode_into(out, q, k_cache, v_cache, meta.decode_block_tables,
                               meta.decode_seq_lens, meta.decode_token_idx, scale)
    elif meta.num_decodes:
        plan, rows = meta.decode_plan(q, k_cache, v_cache)
        decoded = _decode(q.index_select(0, rows), k_cache, v_cache, plan, scale)
        if not meta.prefills:
            return torch.empty_like(q).index_copy_(0, rows, decoded)
        out = torch.empty_like(q)
        out.index_copy_(0, rows, decoded)
    else:
        out = torch.empty_like(q)
    for span in meta.prefills:
        s, e = span.token_start, span.token_end
        if native:
            cpu_prefill.prefill_into(out[s:e], q[s:e], k_cache, v_cache, span.block_table,
                                     span.context_len, scale)
        else:
            out[s:e] = prefill_attention(q[s:e], k[s:e], v[s:e], k_cache, v_cache, span, scale)
    return out
