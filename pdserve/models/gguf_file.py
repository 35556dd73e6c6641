"""GGUF files: a minimal reader, their weights with Hugging Face names, and their config."""

from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# GGUF `general.architecture` -> (HF model_type, whether llama.cpp permuted q/k rows).
GGUF_ARCHS = {"llama": ("llama", True), "qwen2": ("qwen2", False)}
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class _TensorInfo:
    shape: tuple[int, ...]  # torch order (GGUF stores dims innermost-first)
    qtype: int
    offset: int  # absolute byte offset in the file


def open_gguf(path: str | Path) -> GGUFFile:
    """The file's reader for its metadata, read once per process while the file stays the
    same (resolving a model and reading its config both need it). The weights are read
    through a reader of their own, whose mapping of the file goes once they are read."""
    path = Path(path).resolve()
    stat = path.stat()
    return _open_gguf(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open_gguf(path: Path, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


class GGUFFile:
    """Minimal GGUF (v2/v3, little-endian) reader: metadata dict and raw tensor bytes."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self._pos = 0
        if self._mm[:4] != b"GGUF":
            raise ValueError(f"model: {str(path)!r} is not a GGUF file")
        self._pos = 4
        (version,) = self._unpack("I")
        if version not in (2, 3):
            raise ValueError(f"model: unsupported GGUF version {version} in {str(path)!r}")
        n_tensors, n_kv = self._unpack("QQ")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("I")
            self.metadata[key] = self._value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("I")
            dims = self._unpack(f"{n_dims}Q")
            qtype, offset = self._unpack("IQ")
            infos.append((name, tuple(int(d) for d in reversed(dims)), qtype, offset))
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors = {n: _TensorInfo(s, q, start + o) for n, s, q, o in infos}

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self._mm, self._pos)
        self._pos += struct.calcsize("<" + fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("Q")
        self._pos += n
        return self._mm[self._pos - n : self._pos].decode("utf-8", errors="replace")

    def _strings(self, count: int) -> list[str]:
        mm, pos, length, out = self._mm, self._pos, struct.Struct("<Q").unpack_from, []
        for _ in range(count):
            (n,) = length(mm, pos)
            out.append(mm[pos + 8 : pos + 8 + n].decode("utf-8", errors="replace"))
            pos += 8 + n
        self._pos = pos
        return out

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            item_type, count = self._unpack("IQ")
            if item_type in _SCALARS:
                return list(self._unpack(f"{count}{_SCALARS[item_type]}"))
            if item_type == _STRING:  # a vocabulary: tens of thousands, read in one loop
                return self._strings(count)
            return [self._value(item_type) for _ in range(count)]
        return self._unpack(_SCALARS[vtype])[0]

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes as a uint8 tensor (a view of the file mapping)."""
        import torch
        from gguf import GGML_QUANT_SIZES

        info = self.tensors[name]
        block, type_size = GGML_QUANT_SIZES[info.qtype]
        n_elem = 1
        for d in info.shape:
            n_elem *= d
        nbytes = n_elem // block * type_size
        return torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes, offset=info.offset)


def dequantize_ggml(raw: torch.Tensor, qtype: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Dequantize GGML bytes to float32 (torch fast paths; gguf-py numpy fallback)."""
    import torch
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q

    if qtype == Q.F32:
        return raw.view(torch.float32).reshape(shape).clone()
    if qtype in (Q.F16, Q.BF16):
        half = torch.float16 if qtype == Q.F16 else torch.bfloat16
        return raw.view(half).to(torch.float32).reshape(shape)
    if qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        blocks = raw.view(-1, GGML_QUANT_SIZES[qtype][1])
        d = blocks[:, :2].contiguous().view(torch.float16).to(torch.float32)
        if qtype == Q.Q8_0:
            out = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32) * d
        else:
            qs = blocks[:, 4:] if qtype == Q.Q4_1 else blocks[:, 2:]
            nib = torch.cat([qs & 0x0F, qs >> 4], dim=1)
            if qtype == Q.Q4_0:
                out = (nib.to(torch.int8) - 8).to(torch.float32) * d
            else:
                m = blocks[:, 2:4].contiguous().view(torch.float16).to(torch.float32)
                out = d * nib.to(torch.float32) + m
        return out.reshape(shape)
    from gguf import dequantize

    return torch.from_numpy(dequantize(raw.numpy(), Q(qtype)).copy()).reshape(shape)


_LAYER_PARTS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_SKIPPED = {"rope_freqs.weight"}  # llama3 rope factors: recomputed from the config


def _hf_name(gguf_name: str) -> str:
    base, suffix = gguf_name.rsplit(".", 1)
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part in _LAYER_PARTS:
            return f"model.layers.{layer}.{_LAYER_PARTS[part]}.{suffix}"
    elif base in _TOP_LEVEL:
        return f"{_TOP_LEVEL[base]}.{suffix}"
    raise ValueError(f"model: unexpected GGUF tensor {gguf_name!r}")


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved -> HF rotate-half layout)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def load_gguf_state_dict(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = GGUFFile(path)
    arch = g.metadata["general.architecture"]
    if arch not in GGUF_ARCHS:
        raise ValueError(f"model: GGUF architecture {arch!r} is not supported")
    permuted = GGUF_ARCHS[arch][1]
    heads = int(g.metadata[f"{arch}.attention.head_count"])
    kv_heads = int(g.metadata.get(f"{arch}.attention.head_count_kv", heads))
    out: dict[str, torch.Tensor] = {}
    for name, info in g.tensors.items():
        if name in _SKIPPED:
            continue
        w = dequantize_ggml(g.raw(name), info.qtype, info.shape)
        if permuted and ".attn_q." in name:
            w = _unpermute(w, heads)
        elif permuted and ".attn_k." in name:
            w = _unpermute(w, kv_heads)
        out[_hf_name(name)] = w.to(dtype)
    return out


def gguf_config_kwargs(g: GGUFFile) -> tuple[str, dict[str, Any]]:
    """(model_type, config attributes) from GGUF metadata: the fields transformers maps."""
    md = g.metadata
    arch = md["general.architecture"]
    if arch not in GGUF_ARCHS:
        raise ValueError(f"model: GGUF architecture {arch!r} is not supported")
    a = lambda key, default=None: md.get(f"{arch}.{key}", default)
    heads = int(a("attention.head_count"))
    hidden = int(a("embedding_length"))
    kw: dict[str, Any] = dict(
        vocab_size=g.tensors["token_embd.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=int(a("feed_forward_length")),
        num_hidden_layers=int(a("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(a("attention.head_count_kv", heads)),
        head_dim=int(a("attention.key_length", a("rope.dimension_count", hidden // heads))),
        max_position_embeddings=int(a("context_length")),
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in g.tensors,
    )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(a("rope.freq_base", 10000.0))}
    scaling = a("rope.scaling.type")
    if scaling in ("linear", "yarn"):
        rope.update(rope_type=scaling, factor=float(a("rope.scaling.factor")))
        if a("rope.scaling.original_context_length") is not None:
            rope["original_max_position_embeddings"] = int(a("rope.scaling.original_context_length"))
    kw["rope_parameters"] = rope
    kw["rope_theta"], kw["rope_scaling"] = rope["rope_theta"], None  # transformers 4.x
    if rope["rope_type"] != "default":
        kw["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    for key in ("bos", "eos", "padding"):
        value = md.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            kw["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(value)
    return GGUF_ARCHS[arch][0], kw
