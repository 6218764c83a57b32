#!/usr/bin/env bash
# Create ./.venv (Python 3.11) and install mmspec-ray with its dev extra. Idempotent and quick when up to date.
# torch is pinned to 2.13.0 first: on these machines that is the CPU build already on disk (an unpinned torch
# would pull a multi-GB CUDA build). On a GPU machine, set TORCH_INDEX_URL to the PyTorch wheel index of your CUDA
# (e.g. https://download.pytorch.org/whl/cu128), or install your CUDA torch into .venv before running this.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
stamp=.venv/.mmspec-installed
want=$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -c "import torch" 2>/dev/null || \
    .venv/bin/pip install -q "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  .venv/bin/pip install -q -e ".[dev]"
  echo "$want" > "$stamp"
fi
