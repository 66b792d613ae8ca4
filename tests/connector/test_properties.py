"""Property test: random workloads through the whole engine, against its invariants.

Each example draws a configuration (1-4 ranks, tiny GPU pools that force block reuse and
preemption, one or two KV groups, every policy, chunk sizes) and, per rank, seeded delays both
for when a copy really runs and for when its completion is reported. The engine checks the
fence on every rank before each write (a violation raises), and after every step the scheduler
side checks its books: each job acked at most once per rank and finalized once, the fence exactly
the blocks of unfinished stores, one load xor stores per request. At the end the run must be
drained, every loaded block verified, and the output identical to a run without offloading.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from raykv.config import load_config
from raykv.engine.core import EngineCore
from raykv.engine.run import run_workload
from raykv.engine.workers import LocalWorkerGroup
from raykv.workload.requests import synthetic_chat

GROUPS = [
    "[{kind: full_attention}]",
    "[{kind: full_attention}, {kind: sliding_window, window_tokens: 12}]",
    "[{kind: sliding_window, window_tokens: 20}]",
]


@st.composite
def scenarios(draw):
    tp = draw(st.sampled_from([1, 2, 3, 4]))
    groups = draw(st.sampled_from(GROUPS))
    n_groups = groups.count("kind")
    sets = [
        f"parallel.tensor_parallel_size={tp}",
        f"model.num_kv_heads={tp}",
        f"model.num_layers={n_groups}",
        "model.head_dim=4",
        f"model.eos_every={draw(st.sampled_from([0, 5]))}",
        f"cache.groups={groups}",
        f"cache.block_size={draw(st.sampled_from([4, 8]))}",
        f"cache.num_gpu_blocks={draw(st.integers(12, 40))}",
        f"offload.blocks_per_chunk={draw(st.sampled_from([1, 2, 3]))}",
        f"offload.cpu_slots={draw(st.sampled_from([3, 8, 32]))}",
        f"offload.policy={draw(st.sampled_from(['lru', 'arc', 'recall']))}",
        f"engine.max_num_seqs={draw(st.sampled_from([1, 3, 6]))}",
        f"engine.max_num_batched_tokens={draw(st.sampled_from([8, 16, 48]))}",
    ]
    seed = draw(st.integers(0, 2**16))
    arrival = draw(st.sampled_from([0.0, 0.7, 3.0]))
    max_exec = draw(st.integers(0, 3))
    max_ack = draw(st.integers(0, 3))
    return sets, seed, arrival, tp, max_exec, max_ack


def delays(seed: int, tp: int, most: int, salt: int) -> dict:
    # a fixed pseudo-random delay per (rank, job): reproducible, different on each rank
    return {
        r: (lambda j, r=r: (j * 2654435761 + r * 97 + seed * 31 + salt) % (most + 1))
        for r in range(tp)
    }


@settings(max_examples=30, deadline=None)
@given(scenarios())
def test_random_runs_keep_every_invariant_and_match_the_run_without_offload(scenario) -> None:
    sets, seed, arrival, tp, max_exec, max_ack = scenario
    cfg = load_config(None, sets)
    specs = synthetic_chat(
        18,
        vocab_size=cfg.model.vocab_size,
        seed=seed,
        max_tokens=5,
        system_prompts=2,
        system_prompt_tokens=20,
        user_tokens=8,
        answer_tokens=6,
        mean_turns=4,
        concurrent_conversations=3,
        arrival_rate=arrival,
    )
    reports = []
    for offload in (True, False):
        workers = LocalWorkerGroup(
            cfg,
            cfg.cpu_slots(),
            ack_delays=delays(seed, tp, max_ack, 1) if offload else None,
            exec_delays=delays(seed, tp, max_exec, 2) if offload else None,
            threaded=False,
        )
        with workers:
            engine = EngineCore(cfg, workers, offload=offload, verify=True)
            report = run_workload(engine, specs, check_invariants=True, max_idle_steps=500)
            if offload:
                c = engine.connector
                assert len(c.jobs) == 0 and not c.fence and c.tracked() == 0
                stats = c.directory.stats()
                assert stats.writing == stats.reading == 0
                assert all(w.connector.held == 0 for w in workers.workers)
            assert engine.pool.num_free == engine.pool.num_usable
        reports.append(report)
    with_offload, without = reports
    assert with_offload["integrity"]["mismatches"] == 0
    assert with_offload["requests_finished"] + len(with_offload["rejected"]) == len(specs)
    assert with_offload["output_digest"] == without["output_digest"]
