#!/usr/bin/env python3
"""Policies against Belady on traces of different shapes, not just the shipped one.

Policy ideas are easy to over-fit to one file. This script builds three families of traces in the
Mooncake format (seeded, reproducible), replays them with ``raykv bench policy`` machinery, and
prints each policy's token hit rate as a fraction of Belady's:

- ``noisy-N``: the shipped trace with N one-shot requests (fresh blocks, lengths drawn from the
  trace) after each request, so most blocks are never reused;
- ``chat-*``: multi-turn conversations on Zipf-popular system prompts; each turn resends the
  whole history plus new text, and a conversation continues with probability p;
- ``tool-*``: agent sessions: long Zipf-popular tool prefixes with unique suffixes.

Usage: python scripts/policy_robustness.py [--policies lru,arc,recall] [--out results.json]
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
from pathlib import Path

from raykv.bench.policy import BELADY, prepare_accesses, run_policy_bench
from raykv.workload.trace import TraceRequest, read_trace

B = 512
CAPACITIES = [1_000_000, 3_000_000, 10_000_000]


class _Ids:
    def __init__(self, start: int = 0) -> None:
        self.next = start

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _request(t: float, ids: list[int], rng: random.Random) -> TraceRequest:
    length = len(ids) * B - rng.randint(0, B - 1)
    return TraceRequest(t, length, rng.randint(1, 300), tuple(ids))


def noisy(base: list[TraceRequest], per_request: int, seed: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    ids = _Ids(1 + max(h for r in base for h in r.hash_ids))
    out = []
    for r in base:
        out.append(r)
        for _ in range(per_request):
            other = rng.choice(base)
            out.append(
                TraceRequest(
                    r.timestamp, other.input_length, 1, tuple(ids.take(len(other.hash_ids)))
                )
            )
    return out


def chat(n: int, p_continue: float, n_prompts: int, zipf: float, seed: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    ids = _Ids()
    prompts = [ids.take(rng.randint(1, 8)) for _ in range(n_prompts)]
    weights = [1 / (i + 1) ** zipf for i in range(n_prompts)]
    out: list[TraceRequest] = []
    waiting: list[tuple[float, int, list[int]]] = []
    t, conv = 0.0, 0
    while len(out) < n:
        t += rng.expovariate(1.0)
        history = rng.choices(prompts, weights)[0] + ids.take(rng.randint(1, 40))
        heapq.heappush(waiting, (t, conv, history))
        conv += 1
        while waiting and waiting[0][0] <= t and len(out) < n:
            when, c, hist = heapq.heappop(waiting)
            r = _request(when, hist, rng)
            out.append(r)
            if rng.random() < p_continue:
                nxt = hist[: r.input_length // B] + ids.take(rng.randint(1, 6))
                heapq.heappush(waiting, (when + rng.expovariate(1 / 60), c, nxt))
    return out


def tool(n: int, n_prefixes: int, zipf: float, p_continue: float, seed: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    ids = _Ids()
    prefixes = [ids.take(rng.randint(4, 30)) for _ in range(n_prefixes)]
    weights = [1 / (i + 1) ** zipf for i in range(n_prefixes)]
    out: list[TraceRequest] = []
    pending: list[list[int]] = []
    for i in range(n):
        if pending and rng.random() < 0.5:
            hist = pending.pop(rng.randrange(len(pending)))
        else:
            hist = rng.choices(prefixes, weights)[0] + ids.take(rng.randint(2, 60))
        r = _request(float(i), hist, rng)
        out.append(r)
        if rng.random() < p_continue:
            pending.append(hist[: r.input_length // B] + ids.take(rng.randint(1, 8)))
    return out


def traces(shipped: Path) -> dict[str, list[TraceRequest]]:
    out: dict[str, list[TraceRequest]] = {}
    if shipped.exists():
        base = read_trace(shipped)
        out["mooncake"] = base
        out["noisy-1"] = noisy(base, 1, seed=1)
        out["noisy-3"] = noisy(base, 3, seed=2)
    out["chat-a"] = chat(6000, 0.5, 200, 1.0, seed=1)
    out["chat-b"] = chat(6000, 0.8, 50, 1.2, seed=2)
    out["chat-c"] = chat(6000, 0.3, 1000, 0.8, seed=3)
    out["tool-a"] = tool(8000, 100, 1.1, 0.2, seed=11)
    out["tool-b"] = tool(8000, 400, 0.9, 0.05, seed=12)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default="lru,arc,recall")
    ap.add_argument(
        "--trace",
        type=Path,
        default=Path(__file__).resolve().parents[2]
        / "shared/traces/mooncake_synthetic_trace.jsonl",
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    policies = args.policies.split(",")
    results: dict[str, dict] = {}
    print(
        f"{'trace':10} {'capacity':>10}  " + "  ".join(f"{p:>14}" for p in policies) + "   belady"
    )
    for name, reqs in traces(args.trace).items():
        report = run_policy_bench(prepare_accesses(reqs), CAPACITIES, policies, trace=name)
        results[name] = report.as_json()["capacities"]
        for cap, row in report.rows.items():
            best = row[BELADY].token_hit_rate
            cells = "  ".join(
                f"{row[p].token_hit_rate:6.2%} ({row[p].token_hit_rate / best:.2f})"
                for p in policies
            )
            print(f"{name:10} {cap:>10,}  {cells}   {best:6.2%}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
