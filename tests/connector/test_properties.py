"""Property test: random workloads through the whole engine, against its invariants.

Each example draws a configuration (1-4 ranks, tiny GPU pools that force block reuse and
preemption, one to three KV groups including two sliding windows of different sizes, every
policy, a store threshold, chunk sizes, finished requests kept or forgotten, a disk tier under
the CPU tier or none, with failed or corrupted disk I/O) and, per rank,
seeded delays both for when a copy really runs and for when its completion is reported (or real
copy threads). A hostile client (the fuzzer's ``Chaos``) aborts requests at random moments,
resets the CPU tier mid-run and reuses the ids of requests that are gone. The engine checks the
fence on every rank before each write (a violation raises), and after every step the scheduler
side checks its books: each job acked at most once per rank and finalized once, the fence exactly
the blocks of unfinished stores, one load xor stores per request. At the end the run must be
drained, every loaded block and every chunk left in the CPU tier verified, and the tokens those
of a run without offloading and without the client's mischief.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

import hypothesis.strategies as st
from hypothesis import given, settings

from raykv.config import load_config
from raykv.engine.core import EngineCore
from raykv.engine.workers import LocalWorkerGroup
from raykv.workload.requests import synthetic_chat


def _load_fuzzer():
    path = Path(__file__).resolve().parents[2] / "scripts" / "fuzz.py"
    spec = importlib.util.spec_from_file_location("raykv_fuzz", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


fuzz = _load_fuzzer()


@st.composite
def scenarios(draw):
    tp = draw(st.sampled_from([1, 2, 3, 4]))
    groups = draw(st.sampled_from(fuzz.GROUPS))
    n_groups = groups.count("kind")
    keep_finished = draw(st.booleans())
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
        f"offload.store_threshold={draw(st.sampled_from([0, 2]))}",
        f"offload.load_in_step={draw(st.sampled_from(['true', 'false']))}",
        f"engine.schedule_policy={draw(st.sampled_from(['fcfs', 'shortest-prefill']))}",
        f"engine.max_bypass_steps={draw(st.sampled_from([1, 4, 16]))}",
        f"engine.short_prefill_alone={draw(st.sampled_from([0, 16, 64]))}",
        f"engine.async_scheduling={draw(st.sampled_from(['true', 'false']))}",
        f"engine.max_num_seqs={draw(st.sampled_from([1, 3, 6]))}",
        f"engine.max_num_batched_tokens={draw(st.sampled_from([8, 16, 48]))}",
        f"engine.keep_finished={'true' if keep_finished else 'false'}",
    ]
    chaos = fuzz.Chaos(
        abort_rate=draw(st.sampled_from([0.0, 0.02, 0.08])),
        reset_steps=set(draw(st.lists(st.integers(0, 80), max_size=2))),
        reuse_ids=not keep_finished and draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )
    seed = draw(st.integers(0, 2**16))
    arrival = draw(st.sampled_from([0.0, 0.7, 3.0]))
    max_exec = draw(st.integers(0, 3))
    # late reports: each rank holds some of its completions back a few steps
    late = [
        f"delay-acks:rank={r}:steps={draw(st.integers(1, 3))}:rate=0.5:seed={seed + r}"
        for r in range(tp)
        if draw(st.booleans())
    ]
    if draw(st.booleans()):  # a disk tier (in a fresh directory: the test places it)
        sets += [
            "offload.disk.enabled=true",
            f"offload.disk.path={fuzz.DISK_PATH}",
            f"offload.disk.capacity={draw(st.sampled_from(['64KiB', '1MiB']))}",
            f"offload.disk.reserve_fraction={draw(st.sampled_from([0.125, 0.5]))}",
            "offload.take_hits=always",
        ]
        late += draw(
            st.sampled_from([[], ["fail-disk:rate=0.2:seed=5"], ["corrupt-disk:rate=0.3:seed=6"]])
        )
    sets.append("faults=[" + ",".join(f'"{f}"' for f in late) + "]")
    threaded = draw(st.sampled_from([False, False, False, True]))
    return sets, seed, arrival, tp, max_exec, chaos, threaded


def delays(seed: int, tp: int, most: int, salt: int) -> dict:
    # a fixed pseudo-random delay per (rank, job): reproducible, different on each rank
    return {
        r: (lambda j, r=r: (j * 2654435761 + r * 97 + seed * 31 + salt) % (most + 1))
        for r in range(tp)
    }


@settings(max_examples=30, deadline=None)
@given(scenarios())
def test_random_runs_keep_every_invariant_and_match_the_run_without_offload(scenario) -> None:
    sets, seed, arrival, tp, max_exec, chaos, threaded = scenario
    with tempfile.TemporaryDirectory(prefix="raykv-test-disk-") as disk:
        placed = [s.replace(fuzz.DISK_PATH, disk) for s in sets]
        run_scenario(placed, seed, arrival, tp, max_exec, chaos, threaded)


def run_scenario(
    sets: list[str], seed: int, arrival: float, tp: int, max_exec: int, chaos, threaded: bool
) -> None:
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
    workers = LocalWorkerGroup(
        cfg,
        cfg.cpu_slots(),
        exec_delays=None if threaded else delays(seed, tp, max_exec, 2),
        threaded=threaded,
    )
    with workers:
        engine = EngineCore(cfg, workers, verify=True)
        outputs, aborted, seen = fuzz.drive(engine, specs, chaos)
        fuzz.check_drained(engine, workers, seen)
    fuzz.compare(outputs, aborted, fuzz.reference_outputs(sets, specs))
