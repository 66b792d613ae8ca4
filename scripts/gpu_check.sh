#!/usr/bin/env bash
# The GPU checks of raykv, in one prepared run, for a machine whose torch has CUDA (no internet
# needed, no Ray needed): the tests in tests/gpu (the real model on CUDA against transformers
# among them, its bfloat16 logprob differences printed), the transfer benchmark against the copy
# limit (raykv's own cache, and the pages in vLLM's per-layer views as raykv's worker inside vLLM
# copies them), `raykv run` on CUDA ranks compared with CPU ranks (CPU tier; CPU and disk tiers; the
# disk tier under its faults), TTFT recomputed against loaded from each tier on a random
# checkpoint of SmolLM2's shape, the disk tier's I/O against plain I/O on that machine's disk,
# and the trace with and without the tiers; where Ray is installed, the per-step fan-out bench.
# Results go to DIR (first argument, else $OUT, else ./gpu-results); summary.txt has the verdicts.
# Every step has a time limit of its own, so one that hangs costs its limit, not the lease.
# STEPS="name ..." runs only the steps named (the names in ALL_STEPS below, each printed with
# its verdict as it ends), for a short lease; an unknown name stops it before anything runs.
# REPEATS=K: pairs of runs of each trace-as-conversations step (2).
#
# Packages the machine lacks (pydantic on the lent H200 image) are installed from .whl/ when it
# is there: run scripts/fetch_gpu_wheels.sh first and carry .whl along.
set -uo pipefail
cd "$(dirname "$0")/.."
ALL_STEPS=(gpu-tests transfer-cuda transfer-cuda-vllm-views transfer-cuda-vllm-views-8b run-cpu
           run-cuda run-cuda-disk run-cuda-disk-faults checkpoint
           ttft-cuda-float32 ttft-cuda-bfloat16 transfer-disk offload-conv-half-cuda
           offload-conv-half-cuda-1io offload-conv-half-cuda-cpu offload-conv-low-cuda offload-cuda
           offload-conv-half-cpu profile-cuda-on profile-cuda-off fanout)
for name in ${STEPS:-}; do
  if [[ " ${ALL_STEPS[*]} " != *" $name "* ]]; then
    echo "STEPS: unknown step '$name' (one of: ${ALL_STEPS[*]})" >&2
    exit 2
  fi
done
DIR="${1:-${OUT:-gpu-results}}"
mkdir -p "$DIR"
PY="${PYTHON:-python3}"
SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/raykv-gpu.XXXXXX")"
trap 'rm -rf "$SCRATCH"' EXIT
export PYTHONUNBUFFERED=1
if ! "$PY" -c "import pydantic, msgspec, isal, yaml, rich" 2>/dev/null && [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/raykv-site .whl/*.whl && export PYTHONPATH="/tmp/raykv-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$(pwd):${PYTHONPATH:-}"
RAYKV=("$PY" -m raykv)
status=0
selected() {  # selected NAME...: whether STEPS (all when unset) names one of them
  local name
  [ -z "${STEPS:-}" ] && return 0
  for name in "$@"; do [[ " $STEPS " == *" $name "* ]] && return 0; done
  return 1
}
step() {  # step NAME LIMIT_S COMMAND...: output to DIR/NAME.txt, a line of its verdict
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  selected "$name" || return 0
  timeout "$limit" "$@" > "$DIR/$name.txt" 2>&1
  rc=$?
  echo "$name: rc=$rc in $((SECONDS - start)) s$([ $rc -eq 124 ] && echo " (timed out)")"
  [ $rc -eq 0 ] || status=1
  return $rc
}

"$PY" - <<'PYEOF' 2>&1 | tee "$DIR/device.txt"
import torch
assert torch.cuda.is_available(), "torch sees no CUDA device"
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__}, {p.name}, {p.total_memory / 2**30:.0f} GiB, "
      f"{torch.cuda.device_count()} device(s)")
PYEOF
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1

step gpu-tests 180 "$PY" -m pytest tests/gpu -q -rP -p no:cacheprovider -o addopts="" \
  --timeout 120
selected gpu-tests && tail -3 "$DIR/gpu-tests.txt"

step transfer-cuda 60 "${RAYKV[@]}" bench transfer --device cuda --page-kib 16,64,256,1024,4096 \
  --blocks 1024 --direction store,load,both --repeat 5 --json "$DIR/transfer-cuda.json"

# the copies of raykv's worker inside vLLM (no vLLM needed): pages in per-layer byte views as
# vLLM's canonical views give them, 30 of 24 KiB (SmolLM2 float32, 16-token blocks) and 32 of
# 64 KiB (a Llama-8B-shaped bfloat16 block), against one copy of the same bytes
step transfer-cuda-vllm-views 60 "${RAYKV[@]}" bench transfer --device cuda --page-kib 720 \
  --pieces 30 --blocks 512 --direction store,load --repeat 5 \
  --json "$DIR/transfer-cuda-vllm-views.json"
step transfer-cuda-vllm-views-8b 60 "${RAYKV[@]}" bench transfer --device cuda --page-kib 2048 \
  --pieces 32 --blocks 256 --direction store,load --repeat 5 \
  --json "$DIR/transfer-cuda-vllm-views-8b.json"

RUN=(run --engine local --config configs/synthetic.yaml --num-requests 200
     --set cache.num_gpu_blocks=96)
DISK=(--set offload.cpu_bytes=2MiB --set offload.disk.enabled=true
      --set offload.disk.capacity=256MiB)
step run-cpu 60 "${RAYKV[@]}" "${RUN[@]}" --set parallel.device=cpu \
  --json-report "$DIR/run-cpu.json"
step run-cuda 60 "${RAYKV[@]}" "${RUN[@]}" --set parallel.device=cuda --verify \
  --json-report "$DIR/run-cuda.json"
step run-cuda-disk 60 "${RAYKV[@]}" "${RUN[@]}" --set parallel.device=cuda --verify "${DISK[@]}" \
  --set offload.disk.path="$SCRATCH/run-disk" --json-report "$DIR/run-cuda-disk.json"
step run-cuda-disk-faults 60 "${RAYKV[@]}" "${RUN[@]}" --set parallel.device=cuda "${DISK[@]}" \
  --set offload.disk.path="$SCRATCH/run-faults" --fault fail-disk:rate=0.05 \
  --fault corrupt-disk:rate=0.05 --fault kill-worker:step=40:rank=1 \
  --json-report "$DIR/run-cuda-disk-faults.json"

# TTFT on a real-sized model: a random checkpoint of SmolLM2-135M's shape (its GGUF is more than
# a device run can carry; the timing depends on the shape, not on the weights' values)
MODEL_STEPS=(ttft-cuda-float32 ttft-cuda-bfloat16 offload-cuda offload-conv-half-cuda
             offload-conv-half-cuda-1io offload-conv-half-cuda-cpu offload-conv-low-cuda
             offload-conv-half-cpu profile-cuda-on profile-cuda-off)
selected "${MODEL_STEPS[@]}" checkpoint && STEPS="${STEPS:+$STEPS checkpoint}" \
  step checkpoint 120 "$PY" scripts/random_checkpoint.py "$SCRATCH/smol"
for dtype in float32 bfloat16; do
  step "ttft-cuda-$dtype" 90 "${RAYKV[@]}" bench ttft --model "$SCRATCH/smol" \
    --set parallel.device=cuda --set model.dtype=$dtype --prompt-tokens 256,1024,2048,4096 \
    --repeat 3 --no-shared --disk-path "$SCRATCH/ttft-disk" --json "$DIR/ttft-cuda-$dtype.json"
done

step transfer-disk 60 "${RAYKV[@]}" bench transfer --device disk --page-kib 64,256,1024 \
  --repeat 3 --path "$SCRATCH" --json "$DIR/transfer-disk.json"

# the tiers against none on the shared trace, the crossover deciding per hit (GPU prefill is cheap)
# (TRACE: the trace's path, from the repository's root; a device run carries it in an ignored
# folder, since ../shared stays behind)
TRACE="${TRACE:-../shared/traces/mooncake_synthetic_trace.jsonl}"
if [ -f "$TRACE" ]; then
  ON_TRACE=(--engine local --model "$SCRATCH/smol" --workload "trace:$TRACE"
            --set workload.trace_tokens_per_block=4 --set workload.max_tokens=4
            --set offload.cpu_bytes=512MiB --set offload.disk.capacity=4GiB)
  OFFLOAD=(bench offload "${ON_TRACE[@]}" --tiers cpu,disk --against none)
  # issue 30's percentile criterion: the trace replayed as whole conversations, SmolLM2's shape
  # in float32, at half load (the default arrival rate) and at a low one, each way REPEATS times
  CONVERSATIONS=(--set workload.trace_order=conversations --set model.dtype=float32
                 --repeat "${REPEATS:-2}")
  step offload-conv-half-cuda 200 "${RAYKV[@]}" "${OFFLOAD[@]}" "${CONVERSATIONS[@]}" \
    --num-requests 300 --set parallel.device=cuda --disk-path "$SCRATCH/conv-half" \
    --json "$DIR/offload-conv-half-cuda.json"
  # one disk I/O thread, not four: whether a cost above grows with the threads beside the model
  step offload-conv-half-cuda-1io 200 "${RAYKV[@]}" "${OFFLOAD[@]}" "${CONVERSATIONS[@]}" \
    --num-requests 300 --set parallel.device=cuda --set offload.disk.io_threads=1 \
    --disk-path "$SCRATCH/conv-half-1io" --json "$DIR/offload-conv-half-cuda-1io.json"
  # the CPU tier alone against none: whether a cost above is the disk tier's
  step offload-conv-half-cuda-cpu 150 "${RAYKV[@]}" "${OFFLOAD[@]}" "${CONVERSATIONS[@]}" \
    --num-requests 300 --set parallel.device=cuda --tiers cpu \
    --json "$DIR/offload-conv-half-cuda-cpu.json"
  step offload-conv-low-cuda 150 "${RAYKV[@]}" "${OFFLOAD[@]}" "${CONVERSATIONS[@]}" \
    --num-requests 100 --set workload.arrival_rate=0.05 --set parallel.device=cuda \
    --disk-path "$SCRATCH/conv-low" --json "$DIR/offload-conv-low-cuda.json"
  step offload-cuda 150 "${RAYKV[@]}" "${OFFLOAD[@]}" --num-requests 300 \
    --set parallel.device=cuda --set model.dtype=bfloat16 \
    --disk-path "$SCRATCH/offload-disk" --json "$DIR/offload-cuda.json"
  # the same on the host's CPUs, where the tiers' copies and writes have cores of their own
  step offload-conv-half-cpu 200 "${RAYKV[@]}" "${OFFLOAD[@]}" "${CONVERSATIONS[@]}" \
    --num-requests 200 --set parallel.device=cpu --disk-path "$SCRATCH/conv-half-cpu" \
    --json "$DIR/offload-conv-half-cpu.json"
  # where a step's time goes with the tiers and without: py-spy (carried in .whl) samples
  # every thread of one run each way; summary.txt has each thread's samples and the main
  # thread's busiest frames
  SPY="$(command -v py-spy || true)"
  if [ -z "$SPY" ] && compgen -G ".whl/py_spy-*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/raykv-spy .whl/py_spy-*.whl \
      && SPY=/tmp/raykv-spy/bin/py-spy
  fi
  RUN_CONV=(run "${ON_TRACE[@]}" --num-requests 300 --set workload.trace_order=conversations
            --set parallel.device=cuda --set model.dtype=float32)
  # (--nonblocking: py-spy reads the process without pausing it; a step that times out
  # loses its profile, so the limits are generous)
  SPY_RECORD=(record -r 250 --threads --nonblocking -f raw)
  if [ -n "$SPY" ] && [ -x "$SPY" ]; then
    step profile-cuda-on 150 "$SPY" "${SPY_RECORD[@]}" -o "$DIR/profile-on.txt" -- \
      "${RAYKV[@]}" "${RUN_CONV[@]}" --set offload.disk.enabled=true \
      --set offload.disk.path="$SCRATCH/profile-disk" --json-report "$DIR/profile-on.json"
    step profile-cuda-off 150 "$SPY" "${SPY_RECORD[@]}" -o "$DIR/profile-off.txt" -- \
      "${RAYKV[@]}" "${RUN_CONV[@]}" --no-offload --json-report "$DIR/profile-off.json"
  elif selected profile-cuda-on profile-cuda-off; then
    echo "profile: not run (no py-spy: scripts/fetch_gpu_wheels.sh fetches it)"
  fi
else
  echo "offload: not run (no trace at $TRACE)"
fi

if "$PY" -c "import ray" 2>/dev/null; then
  step fanout 120 "${RAYKV[@]}" bench step --engine ray --tp 2,4,8 --model none --repeat 5 \
    --json "$DIR/fanout.json"
elif selected fanout; then
  echo "fanout: not run (no ray here)"
fi

STEPS="${STEPS:-}" "$PY" - "$DIR" <<'PYEOF' 2>&1 | tee "$DIR/summary.txt"
import json, os, sys
from collections import Counter
d = sys.argv[1]
ok = True
chosen = os.environ["STEPS"].split()


def load(name):
    if chosen and name not in chosen:
        return None
    try:
        return json.load(open(f"{d}/{name}.json"))
    except Exception as exc:
        print(f"{name}: no results ({exc})")
        return None


cpu = load("run-cpu")
for name in ("run-cuda", "run-cuda-disk", "run-cuda-disk-faults"):
    run = load(name)
    if run is None or cpu is None:
        ok &= bool(chosen) and name not in chosen
        continue
    same = run["output_digest"] == cpu["output_digest"]
    ok &= same and run["integrity"]["mismatches"] == 0
    tiers = run.get("tiers", {})
    print(f"{name}: digest {run['output_digest'][:16]} (cpu ranks {cpu['output_digest'][:16]}) "
          f"same={same} mismatches={run['integrity']['mismatches']} "
          f"verified={run['integrity']['blocks_verified']} cpu_hits={run['cpu_hit_tokens']} "
          f"disk_hits={run.get('disk_hit_tokens', 0)} "
          f"disk={ {k: v for k, v in tiers.get('disk', {}).items() if not isinstance(v, dict)} }")
for name in ("transfer-cuda", "transfer-cuda-vllm-views", "transfer-cuda-vllm-views-8b"):
    for r in (load(name) or {}).get("results", []):
        print(f"{name} {r['page_kib']:>5} KiB in {r.get('pieces', 1)} {r['direction']:>5}: "
              f"{r['gbps']:7.2f} GB/s, copy_ {r['baseline_gbps']:7.2f}, ratio {r['ratio']:.2f}")
for r in (load("transfer-disk") or {}).get("results", []):
    print(f"transfer disk {r['page_kib']:>5} KiB {r['direction']:>5} {r.get('mode', '')}: "
          f"{r['gbps']:7.2f} GB/s, plain {r['baseline_gbps']:7.2f}, ratio {r['ratio']:.2f}")
for dtype in ("float32", "bfloat16"):
    for r in (load(f"ttft-cuda-{dtype}") or {}).get("results", []):
        print(f"ttft cuda {dtype} {r}")
for name in ("offload-cuda", "offload-conv-half-cuda", "offload-conv-half-cuda-1io",
             "offload-conv-half-cuda-cpu",
             "offload-conv-low-cuda", "offload-conv-half-cpu"):
    offload = load(name)
    if offload is not None:
        offload.pop("runs", None)
        print(f"{name}:", json.dumps(offload)[:3000])
for way in ("on", "off"):
    if chosen and f"profile-cuda-{way}" not in chosen:
        continue
    try:
        lines = open(f"{d}/profile-{way}.txt").read().splitlines()
    except OSError:
        continue
    threads, frames = Counter(), Counter()
    for line in lines:
        stack, count = line.rsplit(" ", 1)
        parts = stack.split(";")
        threads[parts[0]] += int(count)
        if "MainThread" in parts[0]:
            for frame in set(parts[1:]):
                frames[frame.split(" (")[0]] += int(count)
    print(f"profile {way}: samples by thread {dict(threads.most_common(8))}")
    print(f"profile {way}: main thread's frames {dict(frames.most_common(40))}")
sys.exit(0 if ok else 1)
PYEOF
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "gpu_check: $([ $status -eq 0 ] && echo PASS || echo FAIL) (results in $DIR)"
exit $status
