"""The Triton paged-attention kernels compiled for the GPU, against the torch reference.

The reference (`pdserve.kernels.attention`) runs in float64 on the same GPU. Errors are
relative, ‖out − ref‖ / ‖ref‖. Cache blocks that no sequence owns, the unwritten tail of each
last block and the padding of the block tables all hold NaN: a kernel that reads anything
outside a sequence's context turns its output into NaN and fails.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import attention as ref
from pdserve.kernels import dispatch
from pdserve.kernels.attention import AttentionMetadata, PrefillSpan

ta = pytest.importorskip("pdserve.kernels.triton_attention")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# float32 runs its dots in IEEE float32; 16-bit inputs accumulate in float32 but round the
# softmax probabilities to the input type (as flash attention does).
MAX_REL_ERR = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
SMOLLM2 = {"h": 9, "kvh": 3, "d": 64, "block_size": 16}  # SmolLM2-135M's attention shape


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    out, expected = out.double(), expected.double()
    return float((out - expected).norm() / expected.norm())


class Batch:
    """A step of decodes and prefills over a NaN-poisoned paged cache, on the GPU.

    decode_lens: context lengths including the new token; prefills: (num_new, context_len).
    Blocks are drawn at random from a pool 1.5x larger than needed, so sequences own
    scattered blocks with unowned ones between them; block 0 is never owned and pads the
    decode block tables.
    """

    def __init__(self, decode_lens, prefills, h, kvh, d, block_size, dtype, seed):
        gen = torch.Generator().manual_seed(seed)
        lens = list(decode_lens) + [ctx for _, ctx in prefills]
        needed = [-(-n // block_size) for n in lens]
        num_blocks = int(sum(needed) * 1.5) + 2
        perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        tables, used = [], 0
        for nb in needed:
            tables.append(perm[used:used + nb])
            used += nb
        shape = (num_blocks, block_size, kvh, d)
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype)
        # Fill each sequence's past (cached) tokens; the new ones come as k, v.
        num_new = [1] * len(decode_lens) + [n for n, _ in prefills]
        past: list[int] = []
        slots: list[int] = []
        for table, n_ctx, n_new in zip(tables, lens, num_new):
            for p in range(n_ctx):
                s = table[p // block_size] * block_size + p % block_size
                (past if p < n_ctx - n_new else slots).append(s)
        past_t = torch.tensor(past, dtype=torch.int64)
        self.k_cache.view(-1, kvh, d)[past_t] = torch.randn(len(past), kvh, d,
                                                            generator=gen).to(dtype)
        self.v_cache.view(-1, kvh, d)[past_t] = torch.randn(len(past), kvh, d,
                                                            generator=gen).to(dtype)
        T = sum(num_new)
        self.q = torch.randn(T, h, d, generator=gen).to(dtype)
        self.k = torch.randn(T, kvh, d, generator=gen).to(dtype)
        self.v = torch.randn(T, kvh, d, generator=gen).to(dtype)
        width = max(needed[:len(decode_lens)], default=0) + 3  # padding: block 0 (all NaN)
        dec_tables = torch.zeros(len(decode_lens), width, dtype=torch.int64)
        for i in range(len(decode_lens)):
            dec_tables[i, :needed[i]] = torch.tensor(tables[i])
        spans, tok = [], len(decode_lens)
        for j, (n, ctx) in enumerate(prefills):
            table = torch.tensor(tables[len(decode_lens) + j], dtype=torch.int64)
            spans.append(PrefillSpan(tok, tok + n, ctx, table))
            tok += n
        self.meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            decode_token_idx=torch.arange(len(decode_lens), dtype=torch.int64),
            decode_block_tables=dec_tables,
            decode_seq_lens=torch.tensor(list(decode_lens), dtype=torch.int64),
            prefills=spans)
        self.scale = d ** -0.5
        self.to("cuda")

    def to(self, device) -> None:
        for name in ("k_cache", "v_cache", "q", "k", "v"):
            setattr(self, name, getattr(self, name).to(device))
        m = self.meta
        for name in ("slot_mapping", "decode_token_idx", "decode_block_tables",
                     "decode_seq_lens"):
            setattr(m, name, getattr(m, name).to(device))
        for span in m.prefills:
            span.block_table = span.block_table.to(device)

    def reference(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(out, k_cache, v_cache) from the torch reference in float64, on a copy of the cache
        with NaN replaced by 0 (the reference's batched products multiply padding by zero
        probabilities, which NaN would survive)."""
        k_cache = self.k_cache.double().nan_to_num(0)
        v_cache = self.v_cache.double().nan_to_num(0)
        out = ref.paged_attention(self.q.double(), self.k.double(), self.v.double(), k_cache,
                                  v_cache, self.meta, self.scale)
        return out, k_cache, v_cache

    def triton(self) -> torch.Tensor:
        return ta.paged_attention(self.q, self.k, self.v, self.k_cache, self.v_cache, self.meta,
                                  self.scale)


def check(batch: Batch, dtype: torch.dtype) -> None:
    expected, k_ref, v_ref = batch.reference()
    out = batch.triton()
    assert out.dtype == dtype and out.is_cuda
    assert torch.isfinite(out).all(), "the kernel read a slot outside a sequence's context"
    # Stores are exact: the cache equals the reference's, NaN (unowned) slots included.
    assert torch.equal(batch.k_cache.double().nan_to_num(0), k_ref)
    assert torch.equal(batch.v_cache.double().nan_to_num(0), v_ref)
    err = rel_err(out, expected)
    assert err < MAX_REL_ERR[dtype], f"relative error {err:.2e}"


def test_dispatch_picks_the_compiled_kernels():
    assert not ta._interpreted()
    b = Batch([5, 17], [(6, 6)], 4, 2, 16, 4, torch.float16, seed=0)
    calls = []
    real = ta.paged_attention
    ta.paged_attention = lambda *a: calls.append(1) or real(*a)
    try:
        dispatch.paged_attention(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, b.scale)
    finally:
        ta.paged_attention = real
    assert calls == [1]


# ----------------------------------------------------------------- the unit tests' shapes

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,block_size", [(16, 4), (32, 8)])
def test_unit_shapes_decode(dtype, d, block_size):
    check(Batch([1, 5, 19, 9], [], 4, 2, d, block_size, dtype, seed=d), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_unit_shapes_mixed_batch(dtype):
    check(Batch([6, 11], [(5, 5), (6, 13)], 4, 2, 16, 4, dtype, seed=7), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_unit_shapes_gqa_group_of_four_small_tiles(dtype):
    b = Batch([], [(9, 21)], 4, 1, 32, 8, dtype, seed=11)
    ref.write_kv(b.k_cache, b.v_cache, b.k, b.v, b.meta.slot_mapping)
    span = b.meta.prefills[0]
    expected = ref.prefill_attention(b.q.double(), b.k.double(), b.v.double(),
                                     b.k_cache.double().nan_to_num(0),
                                     b.v_cache.double().nan_to_num(0), span, 0.2)
    out = ta.prefill_attention(b.q, b.k_cache, b.v_cache, span, 0.2, block_m=4, block_n=16)
    assert rel_err(out, expected) < MAX_REL_ERR[dtype]


# ----------------------------------------------------------------- SmolLM2 at serving sizes

def _lens(n: int, lo: int, hi: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (n,), generator=gen).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 8, 64, 256])
def test_smollm2_decode_mixed_context_lengths(dtype, batch):
    lens = _lens(batch, 1, 2048, seed=batch)
    lens[0] = 2048  # one long context in every batch
    check(Batch(lens, [], seed=batch, dtype=dtype, **SMOLLM2), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_smollm2_mixed_step_prefills_chunks_and_decodes(dtype):
    """32 decodes, a fresh 512-token prompt, a 100-token suffix after a 600-token cached
    prefix, and a 37-token chunk of a long prompt, in one step."""
    decodes = _lens(32, 1, 1500, seed=3)
    check(Batch(decodes, [(512, 512), (100, 700), (37, 1060)], seed=3, dtype=dtype,
                **SMOLLM2), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_smollm2_long_prefill(dtype):
    check(Batch([], [(2048, 2048)], seed=5, dtype=dtype, **SMOLLM2), dtype)


def test_int32_metadata():
    b = Batch([40, 3], [(20, 50)], seed=9, dtype=torch.bfloat16, **SMOLLM2)
    expected, _, _ = b.reference()
    m = b.meta
    m.slot_mapping, m.decode_token_idx = m.slot_mapping.int(), m.decode_token_idx.int()
    m.decode_block_tables, m.decode_seq_lens = m.decode_block_tables.int(), m.decode_seq_lens.int()
    for span in m.prefills:
        span.block_table = span.block_table.int()
    assert rel_err(b.triton(), expected) < MAX_REL_ERR[torch.bfloat16]


def test_write_kv_skips_negative_slots():
    b = Batch([3], [], seed=1, dtype=torch.float16, **SMOLLM2)
    before = b.k_cache.clone()
    k, v = b.k[:1] + 1, b.v[:1] + 1
    ta.write_kv(b.k_cache, b.v_cache, torch.cat([k, k]), torch.cat([v, v]),
                torch.tensor([-1, 2], device="cuda"))
    flat, old = b.k_cache.view(-1, 3, 64), before.view(-1, 3, 64)
    assert torch.equal(flat[2], k[0])
    keep = torch.ones(flat.shape[0], dtype=torch.bool, device="cuda")
    keep[2] = False
    assert torch.equal(flat[keep].nan_to_num(7.0), old[keep].nan_to_num(7.0))
