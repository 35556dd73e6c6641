"""Makes an AVX-512 x86 CPU look AVX2-only to vLLM's kernel choice, for side-by-side runs
(`benchmarks/results/vs_vllm.md`, "Without AVX-512"): with this folder on PYTHONPATH, vLLM's
CPU platform asks torch and loads its `_C_AVX2` kernels. Pair it with ATEN_CPU_CAPABILITY=avx2,
ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2 and CC=benchmarks/avx2_only/cc."""

import torch.cpu

torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
