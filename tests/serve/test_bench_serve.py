"""``raykv bench serve`` end to end on a tiny model: each router in turn behind two replicas,
a multi-turn workload through the official client, the usage's accounting of every prompt
token; and the KV router keeping every later turn where its earlier turns' KV is."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("openai")

from raykv.bench.serve import (
    RequestResult,
    ServeBenchResult,
    bench_router,
    dependencies,
    format_serve_table,
    percentiles,
    pool,
    reuse_bounds,
    run_order,
    serve_ways,
    summarize,
)
from raykv.config import load_config
from raykv.serve.app import kv_layout
from raykv.serve.kv_index import KVLayout
from raykv.workload.requests import RequestSpec, synthetic_chat

PORT = 8126


def test_a_turn_waits_for_the_turn_it_extends() -> None:
    specs = [
        RequestSpec("a1", (1, 2, 3), 1, 0),
        RequestSpec("b1", (7, 8), 1, 0),
        RequestSpec("a2", (1, 2, 3, 4, 5), 1, 0),
        RequestSpec("c1", (1, 2), 1, 0),  # a prefix of a1, not an extension of it
        RequestSpec("a3", (1, 2, 3, 4, 5, 6), 1, 0),
    ]
    assert dependencies(specs) == [None, None, 0, None, 2]


def test_a_comparison_takes_turns_and_pools_each_way_over_its_runs() -> None:
    ways = serve_ways(["kv", "pow2"], "both")
    assert [w.label for w in ways] == ["kv", "kv+shared", "pow2", "pow2+shared"]
    assert [w.label for w in serve_ways(["kv"], "config")] == ["kv"]
    order = [w.label for w in run_order(ways, 3)]
    # every way three times; the second repeat runs them backwards, so none is always first
    assert order[:4] == order[8:] == ["kv", "kv+shared", "pow2", "pow2+shared"]
    assert order[4:8] == ["pow2+shared", "pow2", "kv+shared", "kv"]

    def run(ttfts: list[float], cached: int, wall: float) -> ServeBenchResult:
        rows = [
            RequestResult(f"r{i}", t, 4, 100, cached, 0, f"replica-{i % 2}")
            for i, t in enumerate(ttfts)
        ]
        return summarize("kv", rows, wall)

    first, second = run([0.1, 0.2, 0.3], 40, 2.0), run([0.5, 0.9], 10, 3.0)
    pooled = pool("kv", [first, second])
    assert pooled.ttft_s == percentiles([0.1, 0.2, 0.3, 0.5, 0.9])
    assert pooled.run_ttft_means == [first.ttft_s["mean"], second.ttft_s["mean"]]
    assert pooled.run_ttft_means[0] != pooled.run_ttft_means[1]
    # prompt tokens per run: the mean of 3 x 40 and 2 x 10 GPU-cache tokens, of 500 and 500
    assert pooled.prefill_tokens["gpu_cache"] == (120 + 20) / 2
    assert pooled.prefill_tokens["computed"] == (300 - 120 + 200 - 20) / 2
    assert (pooled.requests, pooled.errors, pooled.replicas_used) == (5, 0, 2)
    assert pooled.output_tokens_per_s == 5 * 4 / 5.0

    # each row's cached tokens read against pow2 with the shared tier as the row has it
    rows = {label: run([0.1], cached, 1.0) for label, cached in
            [("kv", 60), ("kv+shared", 90), ("pow2", 30), ("pow2+shared", 90)]}  # fmt: skip
    for label, row in rows.items():
        row.router = label
    table = format_serve_table(list(rows.values()), "t")
    against_pow2 = next(c for c in table.columns if c.header == "cached vs pow2")
    assert list(against_pow2.cells) == ["2.00x", "1.00x", "1.00x", "1.00x"]


def _conversations(turns: int, per_turn: int = 32) -> list[RequestSpec]:
    """Two conversations taking turns, each turn its history plus ``per_turn`` new tokens."""
    specs = []
    for turn in range(1, turns + 1):
        for start in (1000, 2000):
            prompt = tuple(range(start, start + turn * per_turn))
            specs.append(RequestSpec(f"c{start}-{turn}", prompt, 1, 0))
    return specs


def test_reuse_bounds_count_each_history_where_it_was_left() -> None:
    layout = KVLayout(block_size=16, blocks_per_chunk=1)
    specs = _conversations(turns=4)
    bounds = reuse_bounds(specs, layout, replicas=2, draws=20)
    # affinity: every later turn finds its whole previous prompt (32, 64, 96 tokens)
    assert bounds.affinity == 2 * (32 + 64 + 96)
    # at random a turn finds only what the last turn sent to its replica left there
    assert 0 < bounds.random < bounds.affinity
    # one replica: there is nowhere else to go
    single = reuse_bounds(specs, layout, replicas=1, draws=3)
    assert single.random == single.affinity == bounds.affinity
    # the last token is always computed: a prompt sent again reuses all but its last block
    again = [specs[0], RequestSpec("again", specs[0].prompt, 1, 0)]
    assert reuse_bounds(again, layout, replicas=1).affinity == 16


# the KV router one request at a time: then nothing but its prompt's hits decides (with more in
# flight, a replica busy prefilling may rightly lose a short history to an idle one). pow2 is
# Serve's own router (every one-replica test serves through it); the accounting checked here is
# the same for every router, so the two of our own making are the cases
@pytest.mark.parametrize("router,concurrency", [("kv", 1), ("prefix", 2)])
def test_each_router_serves_the_workload_and_accounts_for_every_prompt_token(
    router: str, concurrency: int, ray_session, tiny_chat_model: Path, tmp_path: Path
) -> None:
    cfg = load_config(
        None,
        [
            f"model.path={tiny_chat_model}",
            "model.dtype=float32",
            "cache.num_gpu_blocks=96",
            f"offload.shared_pool_dir={tmp_path}",
        ],
    )
    specs = synthetic_chat(
        14,
        vocab_size=49000,
        system_prompts=2,
        system_prompt_tokens=64,
        user_tokens=16,
        answer_tokens=8,
        max_tokens=4,
        mean_turns=4,
        concurrent_conversations=3,
    )
    result = bench_router(cfg, router, 2, specs, concurrency=concurrency, port=PORT)
    assert (result.requests, result.errors) == (len(specs), 0)
    rows = result.requests_list
    assert all(r.ttft_s is not None and r.ttft_s > 0 for r in rows)
    assert [r.prompt_tokens for r in rows] == [len(s.prompt) for s in specs]
    prefill = result.prefill_tokens
    assert sum(prefill.values()) == sum(len(s.prompt) for s in specs)
    assert prefill["computed"] > 0 and result.output_tokens_per_s > 0
    assert result.ttft_s["p50"] <= result.ttft_s["p90"] <= result.ttft_s["p99"]
    if router == "kv":
        # every later turn went back to the replica holding the turns before it
        for spec, row, dep in zip(specs, rows, dependencies(specs), strict=True):
            if dep is not None:
                assert row.replica == rows[dep].replica, spec.req_id
                assert row.gpu_cache_tokens + row.cpu_tier_tokens >= 64, spec.req_id
        # one at a time and nothing evicted: all the workload allows
        bounds = reuse_bounds(specs, kv_layout(cfg), replicas=2)
        assert result.cached_tokens >= bounds.affinity > bounds.random
