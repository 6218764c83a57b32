#!/usr/bin/env bash
# The service on one GPU under Ray, recorded (docs/bench/gpu-ray/README.md): a one-node Ray cluster on loopback
# (auth off, stated), then
#   1. batch: jobs/caption_kinetics.py on the toy-m world; jobs/instruct.py on a 7B-config random-weight target
#      (mmspec_ray/bench/scale_models.py) with --gpus-per-actor auto, then 0.5 and 0.25 (rows/s, GPU memory per
#      actor from nvidia-smi against the plan's estimate, the speedup sample, every row answered);
#   2. serve: `python -m mmspec_ray.serve` of deployments/gpu.yaml pointed at that target, a client's plain and
#      streamed answers, and a replica killed mid-request;
#   3. train: `mmspec train-drafter --use-gpu` (Ray Train, one GPU worker, EAGLE-2, a short recipe) on toy-s, then
#      that drafter decoding in jobs/instruct.py.
#
#   bash scripts/gpu_ray.sh pack      here (pip works here): build .gpu-ray/call1, call2 ... (what the GPU machine
#                                     lacks: Ray, PyAV, pydantic, transformers 5.23 ...; and the toy-s world)
#   bash scripts/gpu_ray.sh plan      here: each device call's carry and size against the 64 MiB limit, now
#   bash scripts/gpu_ray.sh install   on the machine: unpack the pieces this call carried (exit 3: more to come)
#   bash scripts/gpu_ray.sh run       on the machine: install (all pieces there), then the three stages
#   bash scripts/gpu_ray.sh dry-run   (or MODE=cpu, or --dry-run) the same sequence on CPU at tiny sizes: no GPU,
#                                     no pack; DRY_TARGET: a small checkpoint (default: a random toy-s-shaped one);
#                                     PY=<a Python 3.12 with the machine's packages> DRY_SITE=<unpacked site folder>:
#                                     the packed packages checked on CPU (docs/bench/gpu-ray/README.md)
#
# Device calls (the machine stays warm about 30 s after a call: make the second call at once):
#   1. carry [".gpu-ray/call1"]  command: bash scripts/gpu_ray.sh install
#   2. carry [".gpu-ray/call2"]  command: bash scripts/gpu_ray.sh run          (timeout_s 560)
# OUT (out/gpu-ray; $OUT on the machine): results.json (every stage's record), log.txt (this output),
# gpu-ray.tar.gz (logs, _summary.json files, serve.json, training history, nvidia-smi samples), nvidia-smi.txt,
# ray-logs.tar.gz (the Ray session's own logs).
# Env: LIMIT (seconds for all stages: 450; dry 480), SLACK (each step's cap times this: 1; dry 2), STAGES
# (batch,serve,train), PY (python3; dry .venv/bin/python), WORK (/tmp/gpu-ray/work), BIG_MODEL
# (llava_next_mistral_7b, or qwen2_5_vl_7b), ROWS (8 instruct rows), TOKENS (32 new tokens a row), CAPTION_ROWS (12),
# TRAIN_ROWS (40), PARALLEL (dry: 1, the stages side by side), TOY_WORLD (pack: the toy-s world folder to carry).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
MODE=${MODE:-}
ARG=${1:-run}
[ "$ARG" = --dry-run ] && ARG=dry-run
[ "$MODE" = cpu ] && ARG=dry-run
PACK=.gpu-ray
GR=/tmp/gpu-ray
PLATFORMS="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64"

now() { date +%s; }

# ---------------------------------------------------------------------------------------------------- pack (here)
pack() {
    local py=${PY:-.venv/bin/python} b=$PACK/build t0 t
    t0=$(now)
    rm -rf "$b" && mkdir -p "$b"
    export PYTHONPATH=$REPO
    # The project's requirements (pyproject), torch left to the machine, resolved for its Python and platform with
    # the versions it is known to have pinned: the closure, less what it has, is what travels.
    $py -c 'import tomllib; d = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print("\n".join(x for x in d if not x.replace(" ", "").startswith("torch")))' > "$b/requirements.txt" || return 1
    $py -m mmspec_ray.bench.gpu_pack constraints --out "$b/constraints.txt" || return 1
    # shellcheck disable=SC2086
    $py -m pip install -q --dry-run --ignore-installed --report "$b/report.json" --target "$b/resolve" $PLATFORMS \
        -c "$b/constraints.txt" -r "$b/requirements.txt" 2>&1 | grep -v "^WARNING: Location" || true
    [ -s "$b/report.json" ] || { echo "pack: pip could not resolve the requirements"; return 1; }
    $py -m mmspec_ray.bench.gpu_pack select --report "$b/report.json" --out "$b/carry.txt" || return 1
    # shellcheck disable=SC2086
    $py -m pip download -q --no-deps $PLATFORMS -d "$b/wheels" -r "$b/carry.txt" 2>&1 | grep -v "^WARNING: Location"
    [ "$(ls "$b"/wheels/*.whl | wc -l)" -eq "$(grep -c . "$b/carry.txt")" ] \
        || { echo "pack: not every distribution of carry.txt was downloaded"; return 1; }
    # shellcheck disable=SC2086
    $py -m pip install -q --no-deps --no-compile --no-index $PLATFORMS --target "$b/site" "$b"/wheels/*.whl || return 1
    $py -m mmspec_ray.bench.gpu_pack prune "$b/site" || return 1
    t=$(now)
    echo "pack: wheels $(du -sb "$b/wheels" | cut -f1) bytes, site $(du -sb "$b/site" | cut -f1) bytes ($((t - t0)) s)"
    tar -C "$b/site" -cf - . | xz -6 -T0 > "$b/site.tar.xz" || return 1
    echo "pack: site.tar.xz $(stat -c %s "$b/site.tar.xz") bytes ($(( $(now) - t )) s)"
    # The toy-s world, pruned to what the run reads: the target, the test and validation splits (their images,
    # clips, rows, Kinetics CSVs) and the shipped suffix drafter if built. toy-m is grown from it on the machine.
    local home=${MMSPEC_HOME:-$HOME/.cache/mmspec} name
    name=$($py -c 'from mmspec_ray.toy.build import world_dir; print(world_dir("toy-s", 0).name)')
    local src=${TOY_WORLD:-$home/toy/$name}
    if [ ! -f "$src/.complete" ]; then
        echo "pack: no toy-s world at $src: building it (about 10 minutes on 2 cores)"
        $py -m mmspec_ray.cli toy build --size toy-s || return 1
        src=$home/toy/$name
    fi
    local parts=(.complete manifest.json target data/test.parquet data/validation.parquet data/kinetics_test.csv
                 data/kinetics_validation.csv data/images/test data/images/validation data/clips/test
                 data/clips/validation)
    [ -f "$src/drafters/suffix/.complete" ] && parts+=(drafters/suffix)
    t=$(now)
    tar -C "$(dirname "$src")" --transform "s,^$(basename "$src"),$name," -cf - "${parts[@]/#/$(basename "$src")/}" \
        | xz -6 -T0 > "$b/world.tar.xz" || return 1
    echo "pack: world.tar.xz $(stat -c %s "$b/world.tar.xz") bytes ($(( $(now) - t )) s)"
    $py -m mmspec_ray.bench.gpu_pack split --pack "$PACK" --archive "site=$b/site.tar.xz:site" \
        --archive "world=$b/world.tar.xz:toy" --report "$b/report.json" --top "$b/requirements.txt" || return 1
    echo "pack: done in $(( $(now) - t0 )) s; the device calls:"
    local n=0
    for d in "$PACK"/call*; do
        n=$((n + 1))
        local last; last=$(ls -d "$PACK"/call* | wc -l)
        if [ "$n" -lt "$last" ]; then
            echo "  $n. carry [\"$d\"]  command: bash scripts/gpu_ray.sh install"
        else
            echo "  $n. carry [\"$d\"]  command: bash scripts/gpu_ray.sh run   (timeout_s 560)"
        fi
    done
}

# ---------------------------------------------------------------------------------------------------- on the machine
install() {  # unpack; once every archive is there, the packed version bounds checked against the machine's
    PYTHONPATH=$REPO python3 -m mmspec_ray.bench.gpu_pack unpack --pack "$PACK" --stash "$GR/pieces" \
        --dest "site=$GR/site" --dest "toy=$GR/home/toy" || return $?
    PYTHONPATH=$GR/site:$REPO python3 -m mmspec_ray.bench.gpu_pack check --stash "$GR/pieces"
    return 0
}

# Ray head of this run only: its processes are those naming its temp dir or holding a file in it (as
# jobs/local_cluster.sh stops its head: `ray stop` would stop every Ray on the host).
head_pids() {
    {
        pgrep -f -- "$RAYTMP" || true
        local fd
        for fd in /proc/[0-9]*/fd; do
            if ls -l "$fd" 2> /dev/null | grep -qF -- "$RAYTMP/"; then fd=${fd#/proc/}; echo "${fd%/fd}"; fi
        done
    } | { grep -vx -- "$$" || true; } | sort -u
}

stop_all() {
    [ -f "${WORK:-}/serve.pid" ] && kill -TERM "$(cat "$WORK/serve.pid")" 2> /dev/null
    [ -n "${SAMPLERS:-}" ] && kill $SAMPLERS 2> /dev/null
    if [ -n "${RAYTMP:-}" ] && [ -d "$RAYTMP" ]; then
        local pids
        pids=$(head_pids)
        [ -n "$pids" ] && kill $pids 2> /dev/null
        sleep 2
        pids=$(head_pids)
        [ -n "$pids" ] && kill -9 $pids 2> /dev/null
        rm -rf "$RAYTMP"
    fi
}

free_port() { $PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# step NAME SECONDS CMD...: CMD under min(SECONDS, what is left of LIMIT), its output in logs/NAME.log (the last
# lines echoed), its rc and seconds in records/stage-NAME.json. Out of time: skipped and recorded so.
step() {
    local name=$1 limit=$2 rc t0 left
    shift 2
    left=$((DEADLINE - $(now)))
    if [ "$left" -lt 15 ]; then
        echo "=== $name: skipped, out of time"
        echo "{\"name\": \"$name\", \"rc\": null, \"seconds\": 0, \"skipped\": \"out of time\"}" \
            > "$WORK/records/stage-$name.json"
        return 124
    fi
    limit=$((limit * SLACK))
    [ "$limit" -gt "$left" ] && limit=$left
    echo "=== $name: start $(date +%T) (limit ${limit} s)"
    t0=$(now)
    timeout -k 10 "$limit" "$@" > "$WORK/logs/$name.log" 2>&1
    rc=$?
    tail -n "${TAIL:-12}" "$WORK/logs/$name.log"
    echo "=== $name: rc $rc, $(( $(now) - t0 )) s"
    echo "{\"name\": \"$name\", \"rc\": $rc, \"seconds\": $(( $(now) - t0 )), \"limit\": $limit}" \
        > "$WORK/records/stage-$name.json"
    return $rc
}

sample_gpu() {  # sample_gpu NAME: nvidia-smi samples every 0.5 s until stop_samples
    SAMPLERS=
    $GPU || return 0
    nvidia-smi --query-gpu=memory.used,memory.total,utilization.gpu --format=csv,noheader,nounits -lms 500 \
        > "$WORK/records/$1-gpu.csv" 2>&1 &
    SAMPLERS="$!"
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader,nounits -lms 500 \
        > "$WORK/records/$1-apps.csv" 2>&1 &
    SAMPLERS="$SAMPLERS $!"
}

stop_samples() {  # stop_samples NAME: end the samplers, peak memory per process -> records/NAME-memory.json
    [ -n "${SAMPLERS:-}" ] && kill $SAMPLERS 2> /dev/null && wait $SAMPLERS 2> /dev/null
    SAMPLERS=
    $GPU && $PY -m mmspec_ray.bench.gpu_ray memory "$WORK/records/$1-gpu.csv" "$WORK/records/$1-apps.csv" \
        --out "$WORK/records/$1-memory.json"
    return 0
}

batch_job() {  # batch_job NAME SECONDS SCRIPT ARGS...: a batch job on the cluster, sampled; its summary checked
    local name=$1 limit=$2
    shift 2
    sample_gpu "$name"
    step "$name" "$limit" $PY "$@" --output "$WORK/jobs/$name" --no-progress-bars
    stop_samples "$name"
    if [ -f "$WORK/jobs/$name/_summary.json" ]; then
        $PY -m mmspec_ray.bench.gpu_ray summary "$WORK/jobs/$name/_summary.json" \
            --memory "$WORK/records/$name-memory.json" --record "$WORK/records/$name.json"
    else
        echo "$name: no _summary.json"
        echo "{\"ok\": false, \"why\": \"no _summary.json\"}" > "$WORK/records/$name.json"
    fi
}

# 1. batch: the caption job on the toy-m world, the instruct job on the 7B-config target at 1, 0.5, 0.25 GPU.
stage_batch() {
    $GPU && step grow-toy-m 150 $PY -m mmspec_ray.cli toy build --size toy-m
    batch_job caption 120 jobs/caption_kinetics.py "${CAPTION_ARGS[@]}" --limit "$CAPTION_ROWS" \
        --max-new-tokens 64 --gpus-per-actor auto --rows-per-block 2 --speedup-sample 4
    local g n
    for g in auto 0.5 0.25; do
        n=1
        [ "$g" = 0.5 ] && n=2
        [ "$g" = 0.25 ] && n=4
        if ! $GPU && [ "$g" != auto ]; then continue; fi  # no GPU to share on a CPU
        batch_job "instruct-g$g" 150 jobs/instruct.py --input "$WORK/rows.parquet" --target "$BIG" \
            --gpus-per-actor "$g" --num-actors "$n" --max-new-tokens "$TOKENS" --rows-per-block 1 --speedup-sample 2
    done
}

# 2. serve: deployments/gpu.yaml pointed at the 7B-config target; a client's plain and streamed answers; the
#    decoder replica killed mid-request (503 + Retry-After, then answers again once Serve replaced it).
serve_up() {  # `python -m mmspec_ray.serve` in the background, until the endpoint answers
    SERVE_PORT=$(free_port)
    if $GPU; then
        $PY -m mmspec_ray.bench.gpu_ray serve-config "$WORK/serve.yaml" --base deployments/gpu.yaml \
            --target "$BIG" --port "$SERVE_PORT" --gpus 1 --cpus 4
    else
        $PY -m mmspec_ray.bench.gpu_ray serve-config "$WORK/serve.yaml" --base deployments/gpu.yaml \
            --target "$BIG" --port "$SERVE_PORT" --gpus 0 --cpus 1 --device cpu --dtype float32
    fi
    cp "$WORK/serve.yaml" "$WORK/records/serve-config.yaml"
    $PY -m mmspec_ray.serve "$WORK/serve.yaml" > "$WORK/logs/serve-run.log" 2>&1 &
    echo $! > "$WORK/serve.pid"
    sample_gpu serve
    step serve-ready 240 $PY -m mmspec_ray.bench.gpu_ray client --port "$SERVE_PORT" --wait-only \
        --out "$WORK/records/serve-ready.json" && SERVE_UP=true
}

stage_serve() {  # the client's checks, then the app shut down (its replica frees the GPU for training)
    ${SERVE_UP:-false} && step serve-client 240 $PY -m mmspec_ray.bench.gpu_ray client --port "$SERVE_PORT" \
        --out "$WORK/records/serve.json" --size "$SIZE" --max-tokens "$TOKENS" --long-tokens "$LONG_TOKENS" \
        --kill-after "$KILL_AFTER"
    stop_samples serve
    step serve-shutdown 60 $PY -c 'import ray; from ray import serve; ray.init(); serve.shutdown()'
    local pid  # `serve run` in the background ignores SIGINT: ended once the app is gone
    pid=$(cat "$WORK/serve.pid" 2> /dev/null) && kill -TERM "$pid" 2> /dev/null
    rm -f "$WORK/serve.pid"
}

# 3. train: an EAGLE-2 drafter by Ray Train (one worker, on the GPU), then the instruct job decoding with it.
stage_train() {
    local gpu_flag=()
    $GPU && gpu_flag=(--use-gpu)
    rm -rf "$WORK/drafter" "$WORK/drafter.work"
    step train 180 $PY -m mmspec_ray.cli train-drafter --target "$TRAIN_TARGET" --data "$WORK/train-rows.parquet" \
        --out "$WORK/drafter" --method eagle2 --epochs 2 --num-workers 1 "${gpu_flag[@]}" --datagen-actors 1 \
        --max-new-tokens 32 --heldout 4 --rows-per-shard 16
    cp "$WORK/drafter/history.json" "$WORK/records/train-history.json" 2> /dev/null
    batch_job drafted 120 jobs/instruct.py --input "$WORK/decode-rows.parquet" --target "$TRAIN_TARGET" \
        --drafter "$WORK/drafter" --gpus-per-actor auto --max-new-tokens 64 --rows-per-block 2 --speedup-sample 4
}

run() {
    local dry=$1
    if $dry; then
        GPU=false
        PY=${PY:-.venv/bin/python}
        LIMIT=${LIMIT:-480}
        SLACK=${SLACK:-2}  # each step's cap doubled: a busy 2-core machine is slow, not broken
        WORK=${WORK:-$(mktemp -d /tmp/gpu-ray-dry-XXXXXX)}
        ROWS=${ROWS:-2}; TOKENS=${TOKENS:-8}; CAPTION_ROWS=${CAPTION_ROWS:-2}; TRAIN_ROWS=${TRAIN_ROWS:-8}
        SIZE=${SIZE:-336x336}; LONG_TOKENS=4000; KILL_AFTER=1.5
        PARALLEL=${PARALLEL:-1}
        export PYTHONPATH=${DRY_SITE:+$DRY_SITE:}$REPO${PYTHONPATH:+:$PYTHONPATH}
    else
        GPU=true
        PY=${PY:-python3}
        LIMIT=${LIMIT:-450}
        SLACK=${SLACK:-1}
        WORK=${WORK:-$GR/work}
        ROWS=${ROWS:-8}; TOKENS=${TOKENS:-32}; CAPTION_ROWS=${CAPTION_ROWS:-12}; TRAIN_ROWS=${TRAIN_ROWS:-40}
        SIZE=${SIZE:-1024x768}; LONG_TOKENS=1500; KILL_AFTER=3
        PARALLEL=0
        install || { echo "run: pieces are missing: make the earlier device calls first (bash scripts/gpu_ray.sh plan)"
                     return 3; }
        export PYTHONPATH=$GR/site:$REPO
        export MMSPEC_HOME=$GR/home
    fi
    STAGES=${STAGES:-batch,serve,train}
    BIG_MODEL=${BIG_MODEL:-llava_next_mistral_7b}
    BIG=$WORK/big-target
    rm -rf "$WORK/logs" "$WORK/records" "$WORK/jobs"
    mkdir -p "$WORK/logs" "$WORK/records" "$WORK/jobs"
    $dry && export MMSPEC_HOME=${MMSPEC_HOME_DRY:-$WORK/home}
    START=$(now)
    DEADLINE=$((START + LIMIT))
    export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false RAY_DATA_DISABLE_PROGRESS_BARS=1
    # Ray: an explicit auth mode; with it off, a single-machine head (node IP 127.0.0.1, servers on loopback only).
    export RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0
    $dry && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    echo "gpu_ray: $($dry && echo 'dry run on CPU' || echo 'GPU run'), stages $STAGES, limit $LIMIT s, work $WORK"
    {
        $GPU && nvidia-smi
        $PY -c 'import sys, torch, ray, transformers, pydantic
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpus", torch.cuda.device_count(), "ray", ray.__version__, "transformers", transformers.__version__,
      "pydantic", pydantic.__version__)
try:
    import av; print("av", av.__version__)
except ImportError as e:
    print("no PyAV:", e)'
    } > "$WORK/records/env.txt" 2>&1
    cat "$WORK/records/env.txt"
    $GPU && cp "$WORK/records/env.txt" "$OUT/nvidia-smi.txt"

    # ---- the cluster: one node, loopback, auth off. What Serve's replicas and proxy read is set before Ray starts
    # (they inherit the raylet's environment): the endpoint's bearer key and the proxy's error middleware.
    MMSPEC_API_KEY=$($PY -c 'import secrets; print("sk-" + secrets.token_hex(16))')
    export MMSPEC_API_KEY RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=mmspec_ray.serve.proxy_errors:middlewares
    RAYTMP=$(mktemp -d /tmp/gr-ray-XXXXXX)
    trap stop_all EXIT
    local port dash client_port res=""
    port=$(free_port); dash=$(free_port); client_port=$(free_port)
    $dry && res="--num-cpus 8 --num-gpus 0"
    # shellcheck disable=SC2086
    step ray-start 90 $PY -m ray.scripts.scripts start --head --node-ip-address 127.0.0.1 --port "$port" \
        --dashboard-host 127.0.0.1 --dashboard-port "$dash" --include-dashboard true --temp-dir "$RAYTMP" \
        --dashboard-agent-listen-port 0 --ray-client-server-port "$client_port" --disable-usage-stats $res \
        || { echo "gpu_ray: Ray did not start"; finish; return 1; }
    export RAY_ADDRESS=127.0.0.1:$port
    step ray-resources 60 $PY -c 'import ray; ray.init(); print(ray.cluster_resources())'

    # ---- inputs, made in one process: the worlds, the targets, the rows
    if $dry; then
        local tiny=${DRY_TARGET:-$WORK/tiny-target}
        step inputs 180 $PY -m mmspec_ray.bench.gpu_ray inputs "$WORK" $([ -n "${DRY_TARGET:-}" ] || echo --tiny) \
            --big-model "$BIG_MODEL" --reduced --rows "$ROWS" --size "$SIZE" --train-rows "$TRAIN_ROWS" \
            --decode-rows "$CAPTION_ROWS"
        CAPTION_ARGS=(--input "$WORK/world/data/kinetics_test.csv" --clip-root "$WORK/world/data/clips/test"
                      --target "$tiny")
        TRAIN_TARGET=$tiny
    else
        local toy_s
        toy_s=$($PY -c 'from mmspec_ray.toy.build import world_dir; print(world_dir("toy-s", 0))')
        step inputs 180 $PY -m mmspec_ray.bench.gpu_ray inputs "$WORK" --world "$toy_s" --big-model "$BIG_MODEL" \
            --device cuda --dtype bfloat16 --rows "$ROWS" --size "$SIZE" --train-rows "$TRAIN_ROWS" \
            --decode-rows "$CAPTION_ROWS"
        CAPTION_ARGS=(--toy toy-m --target toy-m --split test)
        TRAIN_TARGET=toy-s
    fi

    # ---- the stages: one after the other (the GPU is one). The CPU dry run (PARALLEL=1) brings the endpoint up
    # first (Serve's proxy fails its start-up check on a busy 2-core machine), then runs the stages side by side.
    local stage pids=()
    if [ "$PARALLEL" = 1 ] && [[ ,$STAGES, == *,serve,* ]]; then serve_up; fi
    for stage in batch serve train; do
        [[ ,$STAGES, == *,$stage,* ]] || continue
        [ "$stage" = serve ] && [ "$PARALLEL" != 1 ] && serve_up
        if [ "$PARALLEL" = 1 ]; then
            "stage_$stage" 2>&1 | sed -u "s/^/[$stage] /" &
            pids+=($!)
        else
            "stage_$stage"
        fi
    done
    [ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
    finish
}

finish() {  # results.json (exit 1 if a step failed), Ray's logs and the archive of logs and records into OUT
    local rc
    $PY -m mmspec_ray.bench.gpu_ray collect "$WORK" --seconds "$(( $(now) - START ))" --out "$OUT/results.json"
    rc=$?
    if [ -d "${RAYTMP:-/nonexistent}/session_latest/logs" ]; then
        tar -C "$RAYTMP/session_latest" -czf "$OUT/ray-logs.tar.gz" logs 2> /dev/null
        [ "$(stat -c %s "$OUT/ray-logs.tar.gz")" -gt 15000000 ] && rm -f "$OUT/ray-logs.tar.gz" \
            && echo "Ray's logs are over 15 MB: left out"
    fi
    tar -C "$WORK" -czf "$OUT/gpu-ray.tar.gz" logs records \
        $(cd "$WORK" && ls jobs/*/_summary.json 2> /dev/null) 2> /dev/null
    ls -la "$OUT"
    return $rc
}

OUT=${OUT:-out/gpu-ray}
case $ARG in
    pack) pack ;;
    plan) PYTHONPATH=$REPO ${PY:-.venv/bin/python} -m mmspec_ray.bench.gpu_pack plan --pack "$PACK" ;;
    install) install ;;
    run | dry-run)
        mkdir -p "$OUT"
        run "$([ "$ARG" = dry-run ] && echo true || echo false)" 2>&1 | tee "$OUT/log.txt"
        exit "${PIPESTATUS[0]}" ;;
    *) sed -n '2,31p' "$0"; exit 2 ;;
esac
