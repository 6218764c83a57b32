#!/usr/bin/env bash
# Run a batch job the way a cluster runs it: start a local Ray head, `ray job submit --working-dir .` the job to it,
# then stop that head (only its own processes: other Ray instances on this host are left alone).
#
#   bash jobs/local_cluster.sh python jobs/caption_kinetics.py            # the toy-world Kinetics-style job
#   bash jobs/local_cluster.sh python jobs/instruct.py --limit 100
#
# Env: RAY_NUM_CPUS (default: all), RAY_PORT (6390), RAY_DASHBOARD_PORT (8390), RAY_AUTH_MODE (default disabled:
# a loopback-only throwaway cluster; real clusters use token auth, see docs/batch.md), RAY_DASHBOARD_AGENT_PORT
# (default 0: the OS picks a free one), RAY_CLIENT_PORT (default Ray's 10001).
#
# The dashboard agent's HTTP port is what `ray job submit` reaches the head through. Ray's default, 52365, is the
# same for every Ray instance on a host (a plain `ray.init()` starts an agent on it too): when another instance
# holds it, this head's agent serves no jobs ("No available agent" until the retries run out; seen with another
# local Ray running beside it), and a job can reach the other instance's agent, whose GCS lacks the uploaded
# working dir (the likely cause of a "Failed to download runtime_env file package gcs://_ray_pkg_..." seen once).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/ray ] && export PATH="$PWD/.venv/bin:$PATH"   # the job's `python` is the head's PATH python
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
# With auth off, a single-machine head: Ray then takes 127.0.0.1 as the node IP and its servers listen on loopback
# only (`--node-ip-address 127.0.0.1` alone is resolved back to the machine's network address).
[ "$RAY_AUTH_MODE" = disabled ] && export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
PORT="${RAY_PORT:-6390}"
DASH="${RAY_DASHBOARD_PORT:-8390}"
TMP="$(mktemp -d /tmp/mmspec-ray-XXXXXX)"   # own temp dir: plain `ray.init()` elsewhere will not attach to it

head_pids() {
  # This head's processes: those naming its temp dir on their command line (GCS, raylet, dashboard ...) and those
  # holding a file open in it (its logs): the agents renamed `ray::DashboardAgent` / `ray::RuntimeEnvAgent`, the
  # client server and the workers, which name no temp dir and outlive the raylet (left behind, an agent kept
  # Ray's fixed agent port from every later head on this host).
  {
    pgrep -f -- "$TMP" || true
    local fd
    for fd in /proc/[0-9]*/fd; do
      if ls -l "$fd" 2>/dev/null | grep -qF -- "$TMP/"; then fd="${fd#/proc/}"; echo "${fd%/fd}"; fi
    done
  } | { grep -vx -- "$$" || true; } | sort -u
}

stop_head() {
  # `ray stop` would stop every Ray instance on the host; end only this head's processes.
  local pids
  pids="$(head_pids)"
  [ -n "$pids" ] && kill $pids 2>/dev/null || true
  sleep 2
  pids="$(head_pids)"
  [ -n "$pids" ] && kill -9 $pids 2>/dev/null || true
  rm -rf "$TMP"
}
trap stop_head EXIT

ray start --head --node-ip-address 127.0.0.1 --port "$PORT" --dashboard-host 127.0.0.1 --dashboard-port "$DASH" \
  --include-dashboard true --temp-dir "$TMP" --dashboard-agent-listen-port "${RAY_DASHBOARD_AGENT_PORT:-0}" \
  ${RAY_CLIENT_PORT:+--ray-client-server-port "$RAY_CLIENT_PORT"} \
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
