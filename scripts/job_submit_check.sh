#!/usr/bin/env bash
# Proves `ray job submit --working-dir . -- raykv run --config configs/synthetic.yaml` against a
# `ray start --head` cluster on this machine: starts a head node on loopback (its own temp dir),
# submits the job with Ray 2.60's token auth, checks the job succeeded and printed a report with
# zero mismatches, then stops exactly the processes this script started.
#
# Usage: scripts/job_submit_check.sh [extra raykv run args...]   (run from the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV_BIN="$(pwd)/.venv/bin"
export PATH="$VENV_BIN:$PATH"            # the job inherits this PATH: raykv is found there
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0  # keep every Ray listener on 127.0.0.1
export RAY_AUTH_MODE=token               # Ray 2.60 starts with token auth on; clients must match
TMP="$(mktemp -d /tmp/raykv-job-XXXXXX)"
GCS_PORT=$((20000 + RANDOM % 20000))
DASH_PORT=$((GCS_PORT + 1))

cleanup() {
  # stop only what this script started: every process whose command line names our temp dir
  pids=$(pgrep -f "$TMP" || true)
  if [ -n "$pids" ]; then kill $pids 2>/dev/null || true; sleep 2; kill -9 $pids 2>/dev/null || true; fi
  rm -rf "$TMP"
}
trap cleanup EXIT

echo "== starting a Ray head on 127.0.0.1:$GCS_PORT (dashboard $DASH_PORT)"
ray start --head --node-ip-address 127.0.0.1 --port "$GCS_PORT" --num-cpus 4 \
  --include-dashboard true --dashboard-host 127.0.0.1 --dashboard-port "$DASH_PORT" \
  --temp-dir "$TMP" --disable-usage-stats > "$TMP/start.log" 2>&1 || { cat "$TMP/start.log"; exit 1; }

echo "== ray job submit"
ray job submit --address "http://127.0.0.1:$DASH_PORT" --working-dir . -- \
  raykv run --config configs/synthetic.yaml --num-requests 40 --verify "$@" | tee "$TMP/job.log"

grep -q "Job 'raysubmit_.*' succeeded" "$TMP/job.log" || { echo "job did not succeed"; exit 1; }
grep -q "mismatches 0" "$TMP/job.log" || { echo "no clean integrity line in the report"; exit 1; }
echo "== job succeeded: report printed with zero mismatches"
