#!/usr/bin/env bash
# The CUDA path in one command, on any machine with an NVIDIA GPU and pdserve's dependencies:
# the GPU tests (kernels compiled for the device, LLM.generate against transformers, a 1P1D
# cluster against colocated), then the GPU benchmarks. Results go to DIR (default
# benchmarks/results/gpu), each benchmark's JSON with the command that made it.
#
#   bash scripts/gpu_check.sh [tests|bench|all] [DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
dir=${2:-benchmarks/results/gpu}
mkdir -p "$dir"
export PYTHONUNBUFFERED=1
py=${PYTHON:-$(command -v python || command -v python3)}
status=0
if ! "$py" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "gpu_check: no CUDA device here; nothing to do" >&2
  exit 0
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$dir/gpu.txt"
if [[ $what == tests || $what == all ]]; then
  "$py" -m pytest -q -p no:cacheprovider -rs tests/gpu 2>&1 | tee "$dir/tests.log" || status=1
fi
if [[ $what == bench || $what == all ]]; then
  "$py" benchmarks/kernels_gpu.py --dtype bfloat16 --out "$dir/kernels_gpu.bfloat16.json" \
    || status=1
  "$py" benchmarks/kernels_gpu.py --dtype float32 --out "$dir/kernels_gpu.float32.json" \
    || status=1
  "$py" benchmarks/decode_step.py --dtype bfloat16 --out "$dir/decode_step.bfloat16.json" \
    || status=1
  "$py" benchmarks/offline_throughput.py --dtype bfloat16 --hf-caches dynamic \
    --kv-cache-memory-bytes $((8 << 30)) --out "$dir/offline_throughput.bfloat16.json" \
    || status=1
fi
exit $status
