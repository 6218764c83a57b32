#!/usr/bin/env bash
# Create ./.venv (Python 3.11) and install mmspec-ray with its dev extra. Idempotent and quick when up to date.
# torch is pinned to 2.13.0 first: on these machines that is the CPU build already on disk (an unpinned torch
# would pull a multi-GB CUDA build). On a GPU machine, set TORCH_INDEX_URL to the PyTorch wheel index of your CUDA
# (e.g. https://download.pytorch.org/whl/cu128), or install your CUDA torch into .venv before running this.
# The rest is installed by uv (parallel downloads and bytecode compilation: 65-77 s for the whole script against
# 120-143 s with pip on 2 cores, docs/history/benchmarks.md "The first run, faster"), by pip where uv cannot be had or fails
# (MMSPEC_NO_UV=1 forces pip).
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
  if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    # pip compiles bytecode on one core; compileall does it on all of them (a few torch test files are Python 3.12
    # syntax and fail to compile, harmlessly: hence the ignored status).
    .venv/bin/pip install -q --no-compile "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
    .venv/bin/python -m compileall -q -j 0 "$(.venv/bin/python -c 'import importlib.util as u, os; print(os.path.dirname(u.find_spec("torch").origin))')" \
      >/dev/null 2>&1 || true
  fi
  installed=
  if [ -z "${MMSPEC_NO_UV:-}" ] && .venv/bin/pip install -q uv; then
    # uv does not read pip's configuration: pass on a pip index given in the environment
    UV_INDEX_URL=${UV_INDEX_URL:-${PIP_INDEX_URL:-}} UV_EXTRA_INDEX_URL=${UV_EXTRA_INDEX_URL:-${PIP_EXTRA_INDEX_URL:-}} \
      .venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python -e ".[dev]" && installed=uv \
      || echo "bootstrap: uv failed; installing with pip" >&2
  fi
  [ -n "$installed" ] || .venv/bin/pip install -q -e ".[dev]"
  echo "$want" > "$stamp"
fi
