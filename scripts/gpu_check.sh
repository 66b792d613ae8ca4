#!/usr/bin/env bash
# The GPU checks of raykv, in one prepared run, for a machine whose torch has CUDA (no internet
# needed, no Ray needed): the tests in tests/gpu (the real model on CUDA against transformers
# among them, its bfloat16 logprob differences printed), the transfer benchmark against the copy
# limit, `raykv run` on CUDA ranks compared with CPU ranks (CPU tier; CPU and disk tiers; the
# disk tier under its faults), TTFT recomputed against loaded from each tier on a random
# checkpoint of SmolLM2's shape, the disk tier's I/O against plain I/O on that machine's disk,
# and the trace with and without the tiers; where Ray is installed, the per-step fan-out bench.
# Results go to DIR (first argument, else $OUT, else ./gpu-results); summary.txt has the verdicts.
# Every step has a time limit of its own, so one that hangs costs its limit, not the lease.
#
# Packages the machine lacks (pydantic on the lent H200 image) are installed from .whl/ when it
# is there: run scripts/fetch_gpu_wheels.sh first and carry .whl along.
set -uo pipefail
cd "$(dirname "$0")/.."
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
step() {  # step NAME LIMIT_S COMMAND...: output to DIR/NAME.txt, a line of its verdict
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
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
tail -3 "$DIR/gpu-tests.txt"

step transfer-cuda 60 "${RAYKV[@]}" bench transfer --device cuda --page-kib 16,64,256,1024,4096 \
  --blocks 1024 --direction store,load,both --repeat 5 --json "$DIR/transfer-cuda.json"

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
  step offload-cuda 180 "${RAYKV[@]}" bench offload --engine local --model "$SCRATCH/smol" \
    --workload "trace:$TRACE" --num-requests 300 --set workload.trace_tokens_per_block=4 \
    --set workload.max_tokens=4 --set parallel.device=cuda --set model.dtype=bfloat16 \
    --set offload.cpu_bytes=512MiB --set offload.disk.capacity=4GiB --tiers cpu,disk \
    --against none --disk-path "$SCRATCH/offload-disk" --json "$DIR/offload-cuda.json"
else
  echo "offload-cuda: not run (no trace at $TRACE)"
fi

if "$PY" -c "import ray" 2>/dev/null; then
  step fanout 120 "${RAYKV[@]}" bench step --engine ray --tp 2,4,8 --model none --repeat 5 \
    --json "$DIR/fanout.json"
else
  echo "fanout: not run (no ray here)"
fi

"$PY" - "$DIR" <<'PYEOF' 2>&1 | tee "$DIR/summary.txt"
import json, sys
d = sys.argv[1]
ok = True


def load(name):
    try:
        return json.load(open(f"{d}/{name}.json"))
    except Exception as exc:
        print(f"{name}: no results ({exc})")
        return None


cpu = load("run-cpu")
for name in ("run-cuda", "run-cuda-disk", "run-cuda-disk-faults"):
    run = load(name)
    if run is None or cpu is None:
        ok = False
        continue
    same = run["output_digest"] == cpu["output_digest"]
    ok &= same and run["integrity"]["mismatches"] == 0
    tiers = run.get("tiers", {})
    print(f"{name}: digest {run['output_digest'][:16]} (cpu ranks {cpu['output_digest'][:16]}) "
          f"same={same} mismatches={run['integrity']['mismatches']} "
          f"verified={run['integrity']['blocks_verified']} cpu_hits={run['cpu_hit_tokens']} "
          f"disk_hits={run.get('disk_hit_tokens', 0)} "
          f"disk={ {k: v for k, v in tiers.get('disk', {}).items() if not isinstance(v, dict)} }")
rows = (load("transfer-cuda") or {}).get("results", [])
for r in rows:
    print(f"transfer cuda {r['page_kib']:>5} KiB {r['direction']:>5}: {r['gbps']:7.2f} GB/s, "
          f"copy_ {r['baseline_gbps']:7.2f}, ratio {r['ratio']:.2f}")
for r in (load("transfer-disk") or {}).get("results", []):
    print(f"transfer disk {r['page_kib']:>5} KiB {r['direction']:>5} {r.get('mode', '')}: "
          f"{r['gbps']:7.2f} GB/s, plain {r['baseline_gbps']:7.2f}, ratio {r['ratio']:.2f}")
for dtype in ("float32", "bfloat16"):
    for r in (load(f"ttft-cuda-{dtype}") or {}).get("results", []):
        print(f"ttft cuda {dtype} {r}")
offload = load("offload-cuda")
if offload is not None:
    print("offload cuda:", json.dumps(offload.get("comparison", offload))[:2000])
sys.exit(0 if ok else 1)
PYEOF
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "gpu_check: $([ $status -eq 0 ] && echo PASS || echo FAIL) (results in $DIR)"
exit $status
