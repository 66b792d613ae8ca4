#!/usr/bin/env bash
# Proves `ray job submit --working-dir . -- raykv run --config configs/synthetic.yaml` against a
# `ray start --head` cluster on this machine: starts a head node on loopback (its own temp dir),
# submits the job with Ray 2.60's token auth, checks the job succeeded and printed a report with
# zero mismatches, then stops exactly the processes this script started.
#
# Usage: scripts/job_submit_check.sh [extra raykv run args...]   (run from the repository root)
#        scripts/job_submit_check.sh serve [extra raykv serve args...]
#   serve: submits `raykv serve --config configs/serve-vllm.yaml` (vLLM replicas; make vllm)
#   instead, waits for /health, asks one completion twice (the second is cached), stops the job
#   with `ray job stop` (SIGTERM: the replicas stop, their tiers written through to disk) and
#   checks it ended and left no replica process.
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

# the head's job agent comes up a little after `ray start` returns: until then a submission is
# refused ("No available agent to submit job"), before anything is submitted, so it is retried
wait_for_agent() {
  for _ in $(seq 1 30); do
    ray job list --address "http://127.0.0.1:$DASH_PORT" > /dev/null 2>&1 && return 0
    sleep 2
  done
}

echo "== starting a Ray head on 127.0.0.1:$GCS_PORT (dashboard $DASH_PORT)"
ray start --head --node-ip-address 127.0.0.1 --port "$GCS_PORT" --num-cpus 4 \
  --include-dashboard true --dashboard-host 127.0.0.1 --dashboard-port "$DASH_PORT" \
  --temp-dir "$TMP" --disable-usage-stats > "$TMP/start.log" 2>&1 || { cat "$TMP/start.log"; exit 1; }

wait_for_agent

if [ "${1:-}" = "serve" ]; then
  shift
  SERVE_PORT=$((DASH_PORT + 1))
  echo "== ray job submit: raykv serve --config configs/serve-vllm.yaml (port $SERVE_PORT)"
  for _ in $(seq 1 30); do
    ray job submit --address "http://127.0.0.1:$DASH_PORT" --working-dir . --no-wait \
      --submission-id "raykv-serve-$GCS_PORT" -- \
      raykv serve --config configs/serve-vllm.yaml --port "$SERVE_PORT" \
      --set serve.replicas=1 --set "offload.disk.path=$TMP/disk" "$@" > "$TMP/job.log" 2>&1 \
      && break
    grep -q "No available agent" "$TMP/job.log" || { cat "$TMP/job.log"; exit 1; }
    sleep 5
  done
  grep -q "submitted successfully" "$TMP/job.log" || { cat "$TMP/job.log"; exit 1; }
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$SERVE_PORT/health" > /dev/null && break
    sleep 1
  done
  curl -sf "http://127.0.0.1:$SERVE_PORT/health" > /dev/null \
    || { ray job logs --address "http://127.0.0.1:$DASH_PORT" "raykv-serve-$GCS_PORT" | tail -40; exit 1; }
  "$VENV_BIN/python" - "$SERVE_PORT" <<'PY'
import json, sys, time, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}/v1"
model = json.load(urllib.request.urlopen(base + "/models"))["data"][0]["id"]
body = {"model": model, "prompt": "the river and the stone " * 60, "max_tokens": 4,
        "temperature": 0}
def ask():
    request = urllib.request.Request(base + "/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    return json.load(urllib.request.urlopen(request, timeout=120))["usage"]
ask()
time.sleep(1)
details = ask()["prompt_tokens_details"]
assert details["cached_tokens"] > 0, details
print("== cached on the second ask:", details)
PY
  ray job stop --address "http://127.0.0.1:$DASH_PORT" "raykv-serve-$GCS_PORT"
  for _ in $(seq 1 120); do
    status=$(ray job status --address "http://127.0.0.1:$DASH_PORT" "raykv-serve-$GCS_PORT" \
      2>/dev/null | tail -1 | tr '[:lower:]' '[:upper:]')
    case "$status" in *STOPPED*|*SUCCEEDED*|*FAILED*) break ;; esac
    sleep 1
  done
  echo "== $status"
  case "$status" in *STOPPED*|*SUCCEEDED*) ;; *) exit 1 ;; esac
  exit 0
fi

echo "== ray job submit"
ray job submit --address "http://127.0.0.1:$DASH_PORT" --working-dir . -- \
  raykv run --config configs/synthetic.yaml --num-requests 40 --verify "$@" | tee "$TMP/job.log"

grep -q "Job 'raysubmit_.*' succeeded" "$TMP/job.log" || { echo "job did not succeed"; exit 1; }
grep -q "mismatches 0" "$TMP/job.log" || { echo "no clean integrity line in the report"; exit 1; }
echo "== job succeeded: report printed with zero mismatches"
