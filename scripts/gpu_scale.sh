#!/usr/bin/env bash
# Real scale in one command (docs/bench/gpu-scale): Qwen2.5-VL-7B and LLaVA-NeXT-7B built from their published
# configs with random weights, measured by `python -m mmspec_ray.bench.gpu_scale` (its docstring lists the
# sections). Under 8 minutes on one H100 / H200; nothing is downloaded.
# Needs torch with CUDA and this repo's Python packages; where the machine's transformers or pydantic differ from
# pyproject.toml's, put their wheels in .whl/ (they are installed to /tmp/site first).
# OUT (out/gpu-scale): results.json (rewritten after every section), log.txt. LIMIT (480): seconds for the whole run;
# every section done by then is kept. Extra arguments go to the module (e.g. --device cpu --reduced for a dry run).
set -uo pipefail
OUT=${OUT:-out/gpu-scale}
PY=${PY:-python3}
LIMIT=${LIMIT:-480}
mkdir -p "$OUT"
if ls .whl/*.whl > /dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TOKENIZERS_PARALLELISM=false
command -v nvidia-smi > /dev/null && nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
timeout -s INT -k 20 "$LIMIT" $PY -m mmspec_ray.bench.gpu_scale --out "$OUT" --static "$@" 2>&1 | tee "$OUT/log.txt"
