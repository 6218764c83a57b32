#!/usr/bin/env bash
# Run a batch job the way a cluster runs it: start a local Ray head, `ray job submit --working-dir .` the job to it,
# then stop that head (only its own processes: other Ray instances on this host are left alone).
#
#   bash jobs/local_cluster.sh python jobs/caption_kinetics.py            # the toy-world Kinetics-style job
#   bash jobs/local_cluster.sh python jobs/instruct.py --limit 100
#
# Env: RAY_NUM_CPUS (default: all), RAY_PORT (6390), RAY_DASHBOARD_PORT (8390), RAY_AUTH_MODE (default disabled:
# a loopback-only throwaway cluster; real clusters use token auth, see docs/batch.md).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/ray ] && export PATH="$PWD/.venv/bin:$PATH"   # the job's `python` is the head's PATH python
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
PORT="${RAY_PORT:-6390}"
DASH="${RAY_DASHBOARD_PORT:-8390}"
TMP="$(mktemp -d /tmp/mmspec-ray-XXXXXX)"   # own temp dir: plain `ray.init()` elsewhere will not attach to it

stop_head() {
  # `ray stop` would stop every Ray instance on the host; end only the processes of this head's temp dir.
  local pids
  pids="$(pgrep -f -- "$TMP" || true)"
  [ -n "$pids" ] && kill $pids 2>/dev/null || true
  sleep 2
  pids="$(pgrep -f -- "$TMP" || true)"
  [ -n "$pids" ] && kill -9 $pids 2>/dev/null || true
  rm -rf "$TMP"
}
trap stop_head EXIT

ray start --head --node-ip-address 127.0.0.1 --port "$PORT" --dashboard-host 127.0.0.1 --dashboard-port "$DASH" \
  --include-dashboard true --temp-dir "$TMP" \
  --disable-usage-stats ${RAY_NUM_CPUS:+--num-cpus "$RAY_NUM_CPUS"} >/dev/null
# Right after `ray start` the head may not yet have a job agent ("No available agent to submit job"): in that case
# no job was created, so retry; any other failure (including the job's own) ends here with its exit status.
for attempt in $(seq 1 30); do
  set +e
  ray job submit --address "http://127.0.0.1:$DASH" --working-dir . -- "$@" 2>&1 | tee "$TMP/submit.log"
  rc=${PIPESTATUS[0]}
  set -e
  if [ "$rc" -eq 0 ] || ! grep -q "No available agent" "$TMP/submit.log"; then
    exit "$rc"
  fi
  sleep 2
done
exit 1
