"""A Llama-style decoder's layers in one native call on CPU (csrc/decoder_layers.c).

Layer by layer, a step calls about ten kernels per layer from Python, and each call pays for
its checks, its output allocation and the interpreter while the other compute threads wait:
a few milliseconds per step on a 30-layer model, as much as a decode step's attention. The
native loop runs the same kernels in the same order on the same buffers, so its results are
the same bit for bit; it serves float32 models whose every projection is packed in panels and
whose layers have no extras (no q/k norm, soft-cap or sliding window), and `serves` says for
which steps (head sizes 64 and 128, native attention metadata). Everything else keeps the
module path. On two compute threads, a step of decodes alone with enough rows runs in lanes,
one a thread (csrc/decoder_lanes.c), with the same results.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from pdserve.kernels import native
from pdserve.kernels.attention import AttentionMetadata
from pdserve.kernels.cpu_decode import HEAD_SIZES
from pdserve.kernels.cpu_linear import PackedLinear, coded_max_rows

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float

# A step of decodes alone runs in lanes, one per compute thread (csrc/decoder_lanes.c), when
# every lane gets at least this many rows: each lane streams every weight, so a lane of a few
# rows is mostly that stream. Alone, on two threads: 6 and 8 rows level with the step-wide
# loop (within 3%), 12 and 14 rows 0-11% faster (benchmarks/results/disagg_vs_colocated.md).
LANE_MIN_ROWS = 6
# Lanes are measured on two compute threads only. Each lane streams every weight, so more lanes
# multiply the weight traffic of a step that several threads would otherwise share.
LANE_MAX_THREADS = 2
# A decode row's projections cost about as much as its attention over this many tokens of
# context: lanes are split to even out rows * this + their contexts.
LANE_ROW_COST_TOKENS = 350


class _Shape(ctypes.Structure):
    _fields_ = [("layers", _i64), ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64),
                ("head_dim", _i64), ("intermediate", _i64), ("eps", _f32), ("scale", _f32),
                ("coded_max_rows", _i64)]


_PROJECTIONS = ("qkv", "o", "gate_up", "down")


class _LayerWeights(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in (
        "input_norm", "post_norm", "qkv", "qkv_bias", "o", "gate_up", "down",
        *(f"{p}_codes" for p in _PROJECTIONS), *(f"{p}_params" for p in _PROJECTIONS))] + [
        (f"{p}_bits", _i64) for p in _PROJECTIONS]


class _StepBatch(ctypes.Structure):
    _fields_ = [("slots", _ptr), ("num_decodes", _i64), ("decode_max_blocks", _i64),
                ("decode_rows", _ptr), ("decode_lens", _ptr), ("decode_tables", _ptr),
                ("num_prefills", _i64), ("prefill_max_blocks", _i64),
                ("prefill_start", _ptr), ("prefill_end", _ptr), ("prefill_context", _ptr),
                ("prefill_table_lens", _ptr), ("prefill_tables", _ptr), ("num_outputs", _i64),
                ("output_rows", _ptr)]


_ERRORS = {
    -1: "head size or head counts the native attention does not serve",
    -3: "a token's cache slot lies outside the KV cache",
    -4: "a decode does not fit its block table or the KV cache",
    -5: "a prefill span does not fit its block table or the KV cache",
    -6: "output rows are not strictly increasing rows of the step",
}


def _panels(linear: nn.Module) -> bool:
    return isinstance(linear, PackedLinear) and linear.layout == "panels"


def _f32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def _plain(layer: nn.Module) -> bool:
    """A llama.DecoderLayer with nothing the native loop lacks, all its weights float32."""
    from pdserve.models.llama import DecoderLayer, RMSNorm

    if type(layer) is not DecoderLayer:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    return (attn.q_norm is None and attn.softcap is None and attn.window is None
            and attn.head_dim in HEAD_SIZES and all(map(_panels, projections))
            and all(p.bias is None for p in projections[1:])
            and (attn.qkv_proj.bias is None or _f32(attn.qkv_proj.bias))
            and all(type(n) is RMSNorm and _f32(n.weight) and n.eps == norms[0].eps
                    for n in norms))


class NativeLayers:
    """Every decoder layer of a model in one call; build with `NativeLayers.build`."""

    def __init__(self, layers: nn.ModuleList, eps: float):
        first = layers[0].self_attn
        self.num_layers = len(layers)
        self.hidden = layers[0].input_layernorm.weight.numel()
        self.heads, self.kv_heads, self.head_dim = (first.num_heads, first.num_kv_heads,
                                                    first.head_dim)
        intermediate = layers[0].mlp.down_proj.in_features
        self.shape = _Shape(self.num_layers, self.hidden, self.heads, self.kv_heads,
                            self.head_dim, intermediate, eps, first.scale, coded_max_rows())
        self.weights = (_LayerWeights * self.num_layers)()
        self._keep = []  # the tensors the table points into
        for w, layer in zip(self.weights, layers):
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            tensors = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                       attn.qkv_proj.packed_weight, attn.qkv_proj.bias,
                       attn.o_proj.packed_weight, mlp.gate_up_proj.packed_weight,
                       mlp.down_proj.packed_weight, *(p.codes for p in projections),
                       *(p.code_params for p in projections))
            for (name, _), t in zip(_LayerWeights._fields_, tensors):
                setattr(w, name, None if t is None else t.data_ptr())
            for name, p in zip(_PROJECTIONS, projections):
                setattr(w, f"{name}_bits", p.code_bits)
            self._keep.extend(t for t in tensors if t is not None)

    @classmethod
    def build(cls, model: nn.Module) -> NativeLayers | None:
        """The native loop for `model` (a LlamaForCausalLM whose projections are packed), or
        None where it does not apply."""
        layers = getattr(model, "layers", None)
        if native.load() is None or not layers or not all(map(_plain, layers)):
            return None
        eps = {layer.input_layernorm.eps for layer in layers}
        return cls(layers, eps.pop()) if len(eps) == 1 else None

    def serves(self, x: torch.Tensor, cos: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """x: (T, hidden) float32 of the caller's own; cos: (T, 1, head_dim / 2); kv_cache:
        (layers, 2, blocks, block_size, kv_heads, head_dim) float32, contiguous."""
        return (_f32(x) and x.dim() == 2 and x.shape[1] == self.hidden and _f32(cos)
                and cos.numel() * 2 == x.shape[0] * self.head_dim and _f32(kv_cache)
                and kv_cache.dim() == 6 and kv_cache.shape[0] == self.num_layers
                and kv_cache.shape[1] == 2 and kv_cache.shape[4:] == (self.kv_heads,
                                                                        self.head_dim))

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_cache: torch.Tensor, meta: AttentionMetadata,
                 output_rows: torch.Tensor | None = None) -> None:
        """Run every layer on x (updated in place); `serves` must hold. With output_rows (R,),
        strictly increasing, the last layer runs for those rows alone and leaves their states
        in x[:R] (the other rows' keys and values still reach the cache). Raises ValueError
        for a slot, decode or prefill span that does not fit the cache, or bad output rows."""
        i64 = torch.int64
        slots = meta.slot_mapping.to(i64).contiguous()
        rows = meta.decode_token_idx.to(i64).contiguous()
        lens = meta.decode_seq_lens.to(i64).contiguous()
        tables = meta.decode_block_tables.to(i64).contiguous()
        if slots.numel() != x.shape[0] or rows.numel() != lens.numel() or (
                rows.numel() and tables.shape[0] != rows.numel()):
            raise ValueError("attention metadata: sizes do not match the step's tokens")
        spans = meta.prefills
        bounds = torch.tensor([[s.token_start, s.token_end, s.context_len, s.block_table.numel()]
                               for s in spans], dtype=i64).reshape(len(spans), 4).t().contiguous()
        width = max((s.block_table.numel() for s in spans), default=0)
        span_tables = torch.zeros(len(spans), max(width, 1), dtype=i64)
        for i, s in enumerate(spans):
            span_tables[i, :s.block_table.numel()] = s.block_table
        outputs = None if output_rows is None else output_rows.to(i64).contiguous()
        batch = _StepBatch(slots.data_ptr(), rows.numel(), tables.shape[-1], rows.data_ptr(),
                           lens.data_ptr(), tables.data_ptr(), len(spans), span_tables.shape[1],
                           *(bounds[i].data_ptr() for i in range(4)), span_tables.data_ptr(),
                           0 if outputs is None else outputs.numel(),
                           None if outputs is None else outputs.data_ptr())
        _, _, num_blocks, block_size = kv_cache.shape[:4]
        args = (x.data_ptr(), x.shape[0], ctypes.byref(self.shape), self.weights,
                kv_cache.data_ptr(), num_blocks, block_size, cos.data_ptr(), sin.data_ptr(),
                ctypes.byref(batch))
        threads = torch.get_num_threads()
        decodes_alone = not spans and outputs is None and rows.numel() == x.shape[0]
        joined = None
        if decodes_alone and meta.drafts:
            # NOTE: a lane must not split a sequence's rows: a draft reads the keys and values
            # the rows before it write in the same layer. A row whose length and first block
            # follow the row before it may be such a draft (paged_decode.c's runs).
            joined = torch.zeros(len(lens), dtype=torch.bool)
            joined[1:] = (lens[1:] == lens[:-1] + 1) & (tables[1:, 0] == tables[:-1, 0])
        lanes = lane_bounds(lens, threads, joined) if decodes_alone else None
        if lanes is None:
            code = native.load().decoder_layers_f32(*args, threads)
        else:
            code = native.load().decoder_lanes_f32(*args, lanes.data_ptr(), lanes.numel() - 1)
        if code == -2:
            raise MemoryError("decoder layers: no memory for the scratch buffers")
        if code < 0:
            raise ValueError(f"decoder layers: {_ERRORS.get(code, f'error {code}')}")


def lane_bounds(lens: torch.Tensor, threads: int,
                joined: torch.Tensor | None = None) -> torch.Tensor | None:
    """Where a step of decodes alone with contexts `lens` (B,) splits into one lane a thread:
    (threads + 1,) increasing offsets from 0 to B, never at a row that `joined` (B,) bool
    marks as bound to the row before it; or None to run it step-wide (one thread, more than
    LANE_MAX_THREADS, fewer than LANE_MIN_ROWS rows a lane, or no place left to cut)."""
    num_lanes, B = threads, lens.numel()
    if not 2 <= num_lanes <= LANE_MAX_THREADS or B < num_lanes * LANE_MIN_ROWS:
        return None
    costs = [n + LANE_ROW_COST_TOKENS for n in lens.tolist()]
    bound = [False] * B if joined is None else joined.tolist()
    total, bounds, done = sum(costs), [0], 0
    for row in range(1, B):  # cut where the cost so far reaches the next share of the total
        done += costs[row - 1]
        left = num_lanes - len(bounds)  # lanes still to start
        if left and not bound[row] and (done * num_lanes >= total * len(bounds)
                                        or B - row == left):
            bounds.append(row)  # (the second test keeps a row for every lane)
    if len(bounds) < num_lanes:
        return None
    bounds.append(B)
    return torch.tensor(bounds, dtype=torch.int64)
