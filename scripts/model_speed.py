"""Prefill and decode speed of a real model on raykv's engine against transformers' own forward
pass on the same weights, measured in one run.

    .venv/bin/python scripts/model_speed.py [--model smollm2-135m-instruct] [--tp 1,3]
        [--prompt-tokens 256,1024,2048] [--decode-tokens 32] [--repeat 3] [--json OUT]

TP 1 runs on the one-process engine, TP > 1 on the Ray rank actors (an embedded Ray). Prefill
is the time from submitting one prompt alone to its first token (``max_tokens`` 1); decode is
tokens per second over ``--decode-tokens`` more, one request alone. Every prompt is fresh
random token ids (no prefix to reuse; the CPU tier is off), the fastest of ``--repeat`` is kept.
transformers' numbers: a forward pass over the prompt (prefill) and ``generate`` with its own KV
cache (decode), float32, the same thread count as the engine's ranks.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from raykv.config import load_config
from raykv.model.checkpoint import configure
from raykv.workload.requests import RequestSpec


def _specs(vocab: int, tokens: int, max_tokens: int, rng: random.Random, tag: str) -> list:
    prompt = tuple(rng.randrange(vocab) for _ in range(tokens))
    return [RequestSpec(tag, prompt, max_tokens, 0.0)]


def engine_times(cfg: Any, lengths: list[int], decode: int, repeat: int) -> dict[int, dict]:
    """{prompt tokens: {"prefill_s", "decode_tok_s"}} on the engine ``cfg`` describes."""
    rng = random.Random(0)
    vocab = cfg.model.vocab_size
    if cfg.parallel.tensor_parallel_size == 1:
        from raykv.engine.core import EngineCore
        from raykv.engine.workers import LocalWorkerGroup
        from raykv.runs.driver import run_engine

        workers = LocalWorkerGroup(cfg, cfg.cpu_slots())
        engine = EngineCore(cfg, workers, keep_finished=False)

        def run(specs: list) -> None:
            run_engine(engine, specs)

        close = workers.shutdown
    else:
        from raykv.cluster.client import RaykvClient

        client = RaykvClient.start(cfg)

        def run(specs: list) -> None:
            client.submit(specs)
            for _ in client.stream():
                pass

        close = client.shutdown
    out: dict[int, dict] = {}
    try:
        run(_specs(vocab, 16, 2, rng, "warm-up"))
        for n in lengths:
            best_prefill, best_total = float("inf"), float("inf")
            for r in range(repeat):
                start = time.perf_counter()
                run(_specs(vocab, n, 1, rng, f"p{n}-{r}"))
                best_prefill = min(best_prefill, time.perf_counter() - start)
                start = time.perf_counter()
                run(_specs(vocab, n, decode + 1, rng, f"d{n}-{r}"))
                best_total = min(best_total, time.perf_counter() - start)
            out[n] = {
                "prefill_s": best_prefill,
                "decode_tok_s": decode / max(best_total - best_prefill, 1e-9),
            }
    finally:
        close()
    return out


def transformers_times(path: Path, lengths: list[int], decode: int, repeat: int) -> dict:
    import torch

    from raykv.bench.ttft import transformers_model

    model = transformers_model(path, "float32")
    vocab = model.config.vocab_size
    rng = random.Random(1)
    out = {}
    for n in lengths:
        best_prefill, best_decode = float("inf"), float("inf")
        for _ in range(repeat):
            ids = torch.tensor([[rng.randrange(vocab) for _ in range(n)]])
            with torch.inference_mode():
                start = time.perf_counter()
                model(ids)
                best_prefill = min(best_prefill, time.perf_counter() - start)
                start = time.perf_counter()
                model.generate(
                    ids, max_new_tokens=decode + 1, min_new_tokens=decode + 1, do_sample=False
                )
                best_decode = min(best_decode, time.perf_counter() - start)
        out[n] = {
            "prefill_s": best_prefill,
            "decode_tok_s": decode / max(best_decode - best_prefill, 1e-9),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tp", default="1,3")
    parser.add_argument("--prompt-tokens", default="256,1024,2048")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    lengths = [int(n) for n in args.prompt_tokens.split(",")]
    results: dict[str, Any] = {"model": args.model, "engine": {}}
    for tp in (int(t) for t in args.tp.split(",")):
        overrides = [
            f"model.path={args.model}",
            "model.dtype=float32",
            f"parallel.tensor_parallel_size={tp}",
            "offload.enabled=false",
            f"cache.num_gpu_blocks={max(lengths) // 16 + args.decode_tokens // 16 + 8}",
            f"engine.max_num_batched_tokens={max(lengths)}",
        ]
        cfg, _, path = configure(load_config(None, overrides))
        results["engine"][f"tp{tp}"] = engine_times(cfg, lengths, args.decode_tokens, args.repeat)
        print(f"tp {tp}: {results['engine'][f'tp{tp}']}", file=sys.stderr)
    results["transformers"] = transformers_times(path, lengths, args.decode_tokens, args.repeat)
    print(
        f"{'tokens':>7} "
        + " ".join(
            f"{k + ' prefill_s':>15} {k + ' tok/s':>11}"
            for k in [*results["engine"], "transformers"]
        )
    )
    for n in lengths:
        cells = []
        for k in [*results["engine"], "transformers"]:
            row = results["engine"][k][n] if k != "transformers" else results["transformers"][n]
            cells.append(f"{row['prefill_s']:>15.3f} {row['decode_tok_s']:>11.1f}")
        print(f"{n:>7} " + " ".join(cells))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
