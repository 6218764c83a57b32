#!/usr/bin/env bash
# The GPU bench of docs/benchmarks.md ("On a GPU"), in one run on a GPU machine (a lent one has 15 minutes in all).
# Needs, besides this repo and its Python packages (transformers 5.23, pydantic: carried as wheels where missing):
#   MMSPEC_HOME  holding the toy-s world (target, test split, drafters/eagle2): toy-m is grown from it here
#   HIVIS        toy-m's HiViS drafter (its shipped one; not with DEFAULT_RUN=1)
# Optional: RNG_STATE, EXPECT for scripts/gpu_grow_toy_m.py: grow the very toy-m measured on the CPU, and check it
# (without them toy-m is grown as a sibling: other random weights in its new layers);
# DEVICE (cuda), DTYPE (float32), PROMPTS (per workload, 4), REPEATS (3), PROMPTS_M / REPEATS_M (toy-m's, 2 / 2),
# COSTS_STEPS (1: measure what a verify costs; 0: skip), DEFAULT_RUN (1: the default drafter of each world and the
# peers, toy-s's EAGLE-2 beside it, T = 0 and 1, instead of the fixed / calibrated HiViS and EAGLE-2 runs),
# PY (python3), OUT (out/gpu).
# A step that fails or runs out of its time is logged and the next one runs; the smoke test alone stops the run.
set -uo pipefail
: "${MMSPEC_HOME:?}"  # needed: fail now, not half-way
RNG_STATE=${RNG_STATE:-}
EXPECT=${EXPECT:-}
COSTS_STEPS=${COSTS_STEPS:-1}
DEFAULT_RUN=${DEFAULT_RUN:-0}
[ "$DEFAULT_RUN" = 1 ] || : "${HIVIS:?}"  # the trained-head runs need it
OUT=${OUT:-out/gpu}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-float32}
PROMPTS=${PROMPTS:-4}
REPEATS=${REPEATS:-3}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # run from the repo root
$PY -c "import av" 2> /dev/null || export PYTHONPATH=$PYTHONPATH:$PWD/scripts/no_pyav  # no PyAV: images only
mkdir -p "$OUT"
S=$MMSPEC_HOME/toy/toy-s-seed0-v5
COSTS="--sizes 1,2,4,8,16,32,64 --tasks caption,detail,question,instruction"  # image prompts: video needs PyAV

step() {  # step NAME SECONDS CMD...: run CMD under a time limit, its output in $OUT/NAME.log
    local name=$1 limit=$2 rc
    shift 2
    echo "=== $name: start $(date +%T)"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    tail -n 40 "$OUT/$name.log"
    echo "=== $name: rc $rc, end $(date +%T)"
    return $rc
}

bench() {  # bench NAME SECONDS TARGET WORKLOADS DRAFTERS TEMPERATURES...
    local name=$1 limit=$2 target=$3 workloads=$4 drafters=$5
    shift 5
    step "$name" "$limit" $PY -m mmspec_ray.cli bench --target "$target" --device "$DEVICE" --dtype "$DTYPE" \
        --workloads "$workloads" --drafter "$drafters" --prompts "$PROMPTS" --repeats "$REPEATS" \
        --temperatures "$@" --out "$OUT/$name"
}

{ command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"

# 1. Does the engine run on this device at all, and give AR's answers? (2 prompts, toy-s, eagle2)
PROMPTS=2 REPEATS=1 bench smoke 150 toy-s instructions "eagle2=$S/drafters/eagle2" 0 || exit 1
$PY - "$OUT/smoke/bench.json" <<'PYEOF' || exit 1
import json, sys
rows = json.load(open(sys.argv[1]))["summary"]["0.0"]
bad = {m: f"{r['identical']}/{r['runs']}" for m, r in rows.items() if r.get("identical") != r.get("runs")}
print("smoke: every greedy run is AR's answer" if not bad else f"smoke: answers differ from AR's: {bad}")
sys.exit(1 if bad else 0)
PYEOF

# 2. What a verify costs against an AR step (the reason trees pay on a GPU and barely on a CPU).
[ "$COSTS_STEPS" = 1 ] && step costs_toy_s 60 $PY -m mmspec_ray.bench.costs --target toy-s --device "$DEVICE" \
    --dtype "$DTYPE" $COSTS
ATEN_CPU_CAPABILITY=avx2 step grow_toy_m 90 $PY scripts/gpu_grow_toy_m.py ${RNG_STATE:+--rng-state "$RNG_STATE"} \
    ${EXPECT:+--expect "$EXPECT"} \
    || echo "=== toy-m's grow failed or gave other weights than the CPU's (grow_toy_m.log): compare with care"
if [ "$COSTS_STEPS" = 1 ]; then
    step costs_toy_m 60 $PY -m mmspec_ray.bench.costs --target toy-m --device "$DEVICE" --dtype "$DTYPE" $COSTS
    step costs_toy_m_bf16 60 $PY -m mmspec_ray.bench.costs --target toy-m --device "$DEVICE" --dtype bfloat16 $COSTS
fi

# 3'. The default drafter of each world (`auto`: toy-s as toy-m's draft model; toy-s's suffix drafter) and the
#     peers, beside the toy-s world's EAGLE-2 (a head trained on the CPU's toy-m fits a toy-m grown here only with
#     RNG_STATE / EXPECT: add it to the toy-m line then), every tree calibrated here, T = 0 and 1 in one run each.
if [ "$DEFAULT_RUN" = 1 ]; then
    PROMPTS=${PROMPTS_M:-2} REPEATS=${REPEATS_M:-2} \
        bench toy-m-default 330 toy-m instructions,long_images "auto=auto@auto" 0 1
    bench toy-s-default 150 toy-s instructions,long_images "auto=auto@auto,eagle2=$S/drafters/eagle2@auto" 0 1
    echo "=== done $(date +%T)"
    exit 0
fi

# 3. The bench: every method interleaved, a fixed tree and the tree calibrated on this device. Video workloads need
#    PyAV, which a lent machine lacks: long_images is the long-answer workload without video.
#    toy-m is slower (15-21 ms a step on an H200): 4 prompts x 3 repeats overran 240 s there,
#    so it runs 2 x 2 unless PROMPTS_M / REPEATS_M say otherwise.
PROMPTS=${PROMPTS_M:-2} REPEATS=${REPEATS_M:-2} \
    bench toy-m-t0 240 toy-m instructions,long_images "hivis=$HIVIS,hivis_auto=$HIVIS@auto" 0
bench toy-s-t0 120 toy-s instructions,long_images "eagle2=$S/drafters/eagle2,eagle2_auto=$S/drafters/eagle2@auto" 0
PROMPTS=${PROMPTS_M:-2} REPEATS=${REPEATS_M:-2} \
    bench toy-m-t1 180 toy-m instructions,long_images "hivis=$HIVIS,hivis_auto=$HIVIS@auto" 1
echo "=== done $(date +%T)"
