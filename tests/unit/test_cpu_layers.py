"""The decoder's layers in one native call (kernels/cpu_layers.py): bit for bit the module
path's hidden states and KV cache on mixed decode + prefill steps and on decode steps run in
lanes, and bad metadata refused before any cache write (tests/engine/test_native_layers_hf.py
compares with transformers)."""

import pytest
import torch

from pdserve.kernels import cpu_layers, native
from pdserve.kernels.attention import AttentionMetadata, PrefillSpan
from pdserve.kernels.cpu_layers import LANE_MAX_THREADS, LANE_MIN_ROWS, NativeLayers, lane_bounds
from pdserve.models.arch import ModelArch
from pdserve.models.llama import LlamaForCausalLM
from pdserve.models.tiny import tiny_arch

pytestmark = pytest.mark.skipif(native.load() is None, reason="native kernels not built")

BLOCK, NUM_BLOCKS = 8, 40


def arch(**kw) -> ModelArch:
    """Head size 64 (the native loop's smallest), 3 layers, room for the mixed step's cache."""
    return tiny_arch(**({"hidden_size": 256, "intermediate_size": 192, "num_hidden_layers": 3,
                         "head_dim": 64, "max_position_embeddings": 512} | kw))


def packed_model(a: ModelArch) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(a).eval()
    with torch.no_grad():
        for p in model.parameters():  # norms and biases away from their 1 / 0 defaults
            p.add_(torch.randn_like(p) * 0.05)
    model.pack_for_cpu()
    return model


def mixed_step(a: ModelArch):
    """Three decodes (contexts 9, 17 and 30 tokens) around two prefill spans (5 new tokens
    over 12, and 7 new over 7), in scattered blocks; the earlier context already cached."""
    g = torch.Generator().manual_seed(1)
    blocks = torch.randperm(NUM_BLOCKS, generator=g)
    tables = [blocks[0:2], blocks[2:5], blocks[5:9], blocks[9:11], blocks[11:12]]
    lens = [9, 17, 30, 12, 7]  # each sequence's context after this step
    new = [1, 1, 1, 5, 7]
    # batch rows: decode, prefill of 5, decode, decode, prefill of 7
    kinds, seqs = ["d", "p", "d", "d", "p"], [0, 3, 1, 2, 4]
    slots, positions, rows, spans, t = [], [], [], [], 0
    dec_tables, dec_lens = [], []
    for kind, s in zip(kinds, seqs):
        n, length, table = new[s], lens[s], tables[s]
        for pos in range(length - n, length):
            slots.append(int(table[pos // BLOCK]) * BLOCK + pos % BLOCK)
            positions.append(pos)
        if kind == "d":
            rows.append(t)
            dec_tables.append(torch.nn.functional.pad(table, (0, 4 - table.numel())))
            dec_lens.append(length)
        else:
            spans.append(PrefillSpan(t, t + n, length, table))
        t += n
    meta = AttentionMetadata(torch.tensor(slots), torch.tensor(rows), torch.stack(dec_tables),
                             torch.tensor(dec_lens), spans)
    cache = torch.randn(a.num_hidden_layers, 2, NUM_BLOCKS, BLOCK, a.num_key_value_heads,
                        a.head_dim, generator=g)
    ids = torch.randint(1, a.vocab_size, (t,), generator=g)
    return ids, torch.tensor(positions), cache, meta


@pytest.mark.parametrize("bias", [False, True])
def test_native_layers_equal_the_modules_bit_for_bit(bias, monkeypatch):
    a = arch(attention_bias=bias, architecture="Qwen2ForCausalLM" if bias else
             "LlamaForCausalLM")
    model = packed_model(a)
    assert model.native_layers is not None
    ids, positions, cache, meta = mixed_step(a)
    calls = []
    run = NativeLayers.__call__
    monkeypatch.setattr(NativeLayers, "__call__", lambda *args: calls.append(1) or run(*args))
    native_cache, module_cache = cache.clone(), cache.clone()
    with torch.inference_mode():
        got = model(ids, positions, native_cache, meta)
        layers, model.native_layers = model.native_layers, None
        want = model(ids, positions, module_cache, meta)
        model.native_layers = layers
    assert calls == [1]  # the first forward took the native loop
    assert torch.equal(got, want)
    assert torch.equal(native_cache, module_cache)
    assert not torch.equal(native_cache, cache)  # the step's keys and values were written


@pytest.mark.parametrize("rows", [[0, 3, 4, 5, 6], [14], [5, 14], []])
def test_output_rows_get_the_full_steps_states_bit_for_bit(rows):
    """With output rows, the native loop's last layer runs for them alone: a prefill span's
    attention from its first output row (rows 3-5 of the span 1-5), none for a span without
    one (8-14 in the first case), a decode left out (row 7). Those rows' states, and every
    token's keys and values, are the full step's bit for bit."""
    model = packed_model(arch())
    ids, positions, cache, meta = mixed_step(model.arch)
    native_cache, module_cache, pruned_cache = cache.clone(), cache.clone(), cache.clone()
    asked = torch.tensor(rows, dtype=torch.long)
    with torch.inference_mode():
        got = model(ids, positions, native_cache, meta, asked)
        layers, model.native_layers = model.native_layers, None
        want = model(ids, positions, module_cache, meta)
        module = model(ids, positions, pruned_cache, meta, asked)  # the module path's own
        model.native_layers = layers
    assert got.shape == module.shape == (len(rows), model.arch.hidden_size)
    assert torch.equal(got, want[rows])
    assert torch.equal(module, want[rows])
    assert torch.equal(native_cache, module_cache)
    assert torch.equal(pruned_cache, module_cache)


@pytest.mark.parametrize("path", ["native", "module"])
@pytest.mark.parametrize("rows", [[3, 3], [4, 2], [-1], [15]])
def test_bad_output_rows_are_refused(rows, path):
    model = packed_model(arch())
    if path == "module":
        model.native_layers = None
    ids, positions, cache, meta = mixed_step(model.arch)
    with torch.inference_mode(), pytest.raises(ValueError, match="output rows"):
        model(ids, positions, cache, meta, torch.tensor(rows, dtype=torch.long))


def test_coded_weights_give_the_float32_panels_results_bit_for_bit(monkeypatch):
    """Projections dequantized from GGUF Q4_1 blocks are coded (kernels/coded_weights.py):
    the mixed step's 15 rows then take linear_coded.c, with the same hidden states and cache
    as on the float32 panels (on 4-lane builds too, whose engine keeps to the panels)."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from pdserve.kernels import cpu_linear
    from pdserve.models.gguf_file import dequantize_ggml

    for module in (cpu_linear, cpu_layers):
        monkeypatch.setattr(module, "coded_max_rows", lambda: cpu_linear.CODED_MAX_ROWS)

    a = arch()
    torch.manual_seed(0)
    model = LlamaForCausalLM(a).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                raw = quants.quantize(p.numpy() * 0.1, GGMLQuantizationType.Q4_1)
                p.copy_(dequantize_ggml(torch.from_numpy(raw.reshape(-1).view(np.uint8).copy()),
                                    GGMLQuantizationType.Q4_1, tuple(p.shape)))
    model.pack_for_cpu()
    layers = model.native_layers
    assert all(w.qkv_codes and w.o_codes and w.gate_up_codes and w.down_codes
               for w in layers.weights)
    assert all(w.qkv_bits == w.o_bits == w.gate_up_bits == w.down_bits == 4  # Q4_1: nibbles
               for w in layers.weights)
    ids, positions, cache, meta = mixed_step(a)
    assert len(ids) <= layers.shape.coded_max_rows
    coded_cache, panels_cache = cache.clone(), cache.clone()
    with torch.inference_mode():
        coded = model(ids, positions, coded_cache, meta)
        layers.shape.coded_max_rows = 0
        panels = model(ids, positions, panels_cache, meta)
    assert torch.equal(coded, panels)
    assert torch.equal(coded_cache, panels_cache)


@pytest.mark.parametrize("field,message", [("slot", "cache slot"), ("row", "decode"),
                                           ("table", "decode"), ("span", "prefill")])
def test_bad_metadata_is_refused_before_any_write(field, message):
    a = arch()
    model = packed_model(a)
    ids, positions, cache, meta = mixed_step(a)
    if field == "slot":
        meta.slot_mapping[2] = NUM_BLOCKS * BLOCK
    elif field == "row":
        meta.decode_token_idx[1] = len(ids)
    elif field == "table":
        meta.decode_block_tables[0, 0] = NUM_BLOCKS
    else:
        meta.prefills[0].token_end = len(ids) + 3
    before = cache.clone()
    with torch.inference_mode(), pytest.raises(ValueError, match=message):
        model(ids, positions, cache, meta)
    if field in ("slot", "row", "span"):  # checked before the first layer
        assert torch.equal(cache, before)


def test_models_with_extras_keep_the_module_path():
    assert NativeLayers.build(packed_model(arch(head_dim=32, hidden_size=128))) is None
    qk_norm = packed_model(arch(architecture="Qwen3ForCausalLM", qk_norm=True))
    assert qk_norm.native_layers is None
    unpacked = LlamaForCausalLM(arch()).eval()  # projections not packed
    assert NativeLayers.build(unpacked) is None


LANE_BLOCKS = 256  # room for 29 contexts of up to 8 blocks


def decode_step(a: ModelArch, batch: int):
    """`batch` decodes alone, contexts of 3-60 tokens in scattered blocks, cache random."""
    g = torch.Generator().manual_seed(2)
    blocks = torch.randperm(LANE_BLOCKS, generator=g).tolist()
    lens = torch.randint(3, 61, (batch,), generator=g)
    tables, slots, used = [], [], 0
    for length in lens.tolist():
        n = -(-length // BLOCK)
        table = blocks[used:used + n]
        used += n
        tables.append(table + [0] * (8 - n))
        slots.append(table[(length - 1) // BLOCK] * BLOCK + (length - 1) % BLOCK)
    meta = AttentionMetadata(torch.tensor(slots), torch.arange(batch), torch.tensor(tables),
                             lens, [])
    cache = torch.randn(a.num_hidden_layers, 2, LANE_BLOCKS, BLOCK, a.num_key_value_heads,
                        a.head_dim, generator=g)
    return torch.randint(1, a.vocab_size, (batch,), generator=g), lens - 1, cache, meta


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("num_threads,batch",
                         [(2, 2 * LANE_MIN_ROWS), (3, 3 * LANE_MIN_ROWS + 5)])
def test_decode_steps_in_lanes_equal_the_step_wide_loop_bit_for_bit(num_threads, batch,
                                                                    threads, monkeypatch):
    threads(num_threads)
    monkeypatch.setattr(cpu_layers, "LANE_MAX_THREADS", 3)  # three lanes: the C side's general case
    model = packed_model(arch())
    ids, positions, cache, meta = decode_step(model.arch, batch)
    lanes = lane_bounds(meta.decode_seq_lens, num_threads)
    assert lanes is not None and lanes.numel() == num_threads + 1
    lib, seen = native.load(), []
    run = lib.decoder_lanes_f32
    monkeypatch.setattr(lib, "decoder_lanes_f32",
                        lambda *args: seen.append(args[-1]) or run(*args))
    in_lanes, step_wide, module = cache.clone(), cache.clone(), cache.clone()
    with torch.inference_mode():
        got = model(ids, positions, in_lanes, meta)
        monkeypatch.setattr(cpu_layers, "LANE_MIN_ROWS", batch + 1)
        wide = model(ids, positions, step_wide, meta)
        layers, model.native_layers = model.native_layers, None
        want = model(ids, positions, module, meta)
        model.native_layers = layers
    assert seen == [num_threads]  # the first forward ran in lanes, the second did not
    assert torch.equal(got, wide) and torch.equal(got, want)
    assert torch.equal(in_lanes, step_wide) and torch.equal(in_lanes, module)
    assert not torch.equal(in_lanes, cache)


def test_lanes_split_by_rows_and_context():
    assert lane_bounds(torch.full((2 * LANE_MIN_ROWS - 1,), 100), 2) is None  # too few rows
    assert lane_bounds(torch.full((64,), 100), 1) is None  # one thread
    assert lane_bounds(torch.full((64,), 100), LANE_MAX_THREADS + 1) is None  # many threads
    assert lane_bounds(torch.full((24,), 300), 2).tolist() == [0, 12, 24]
    # the long contexts go to a lane of fewer rows
    uneven = lane_bounds(torch.tensor([50] * 12 + [2000] * 12), 2).tolist()
    assert uneven[0] == 0 and uneven[2] == 24 and 12 < uneven[1] < 24
    # whatever the contexts, every lane keeps at least one row
    assert lane_bounds(torch.tensor([10**6] + [1] * 15), 2).tolist() == [0, 1, 16]


def test_lanes_never_split_a_sequence_and_its_drafts():
    """Rows bound to the row before them (drafts after their sequence's token) stay in its
    lane: the cut moves to the next free row, and with none left the step runs step-wide."""
    lens = torch.full((24,), 300)
    joined = torch.zeros(24, dtype=torch.bool)
    joined[10:14] = True  # rows 9-13: one sequence
    assert lane_bounds(lens, 2, joined).tolist() == [0, 14, 24]
    joined[1:] = True
    assert lane_bounds(lens, 2, joined) is None


@pytest.mark.parametrize("field,message", [("slot", "cache slot"), ("table", "decode")])
def test_bad_metadata_in_lanes_is_refused(field, message, threads):
    threads(2)
    a = arch()
    model = packed_model(a)
    ids, positions, cache, meta = decode_step(a, 2 * LANE_MIN_ROWS)
    if field == "slot":
        meta.slot_mapping[-1] = LANE_BLOCKS * BLOCK  # in the second lane
    else:
        meta.decode_block_tables[-1, 0] = LANE_BLOCKS
    before = cache.clone()
    with torch.inference_mode(), pytest.raises(ValueError, match=message):
        model(ids, positions, cache, meta)
    if field == "slot":  # checked for the whole step before any lane starts
        assert torch.equal(cache, before)
