"""``raykv bench plan``: what the step message costs per decode step as contexts grow, sent as
it is (block-table changes, the ranks keeping the tables) against the same plans carrying each
request's whole table, as a step did before the ranks kept them.

N requests of C prompt tokens each are admitted into one GPU pool and decode, one token each per
step, through the engine's own batch builder (``engine/batch.py``). For every timed step, both
forms of the same plan are built, encoded and decoded, and the changes are applied to a rank's
kept tables (``engine/rank_tables.py``), in turn, so both meet the same moment of the machine.
Reported per form: the plan's bytes, the scheduler's side (building the batch and encoding it)
and a rank's side (decoding, plus applying the changes where there are any), medians in us.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import msgspec

from raykv.cluster import wire
from raykv.connector.scheduled import ScheduledRequest
from raykv.core.arith import cdiv
from raykv.core.block_pool import BlockPool
from raykv.core.kv_cache import KVCacheManager
from raykv.core.kv_groups import GroupKind, KVGroup
from raykv.core.request import Request
from raykv.core.step import ModelEntry, StepPlan
from raykv.engine.batch import model_batch
from raykv.engine.rank_tables import RankTables

BLOCK_SIZE = 16
_VOCAB = 30_000


def _whole(entry: ModelEntry, req: Request, block_size: int) -> ModelEntry:
    """The entry as a step sent it before the ranks kept tables: every table whole."""
    blocks = cdiv(entry.end, block_size)
    tables = [table[:blocks] for table in req.block_tables]
    return msgspec.structs.replace(entry, block_tables=tables, table_from=0)


def _decoding(
    requests: int, context: int, groups: int, steps: int
) -> tuple[KVCacheManager, list[Request]]:
    """``requests`` requests whose ``context`` prompt tokens are computed, about to decode
    ``steps`` tokens each (the pool holds them all)."""
    per_request = groups * cdiv(context + steps, BLOCK_SIZE)
    kv = KVCacheManager(
        BlockPool(requests * per_request + 1),
        [KVGroup(g, GroupKind.FULL_ATTENTION) for g in range(groups)],
        BLOCK_SIZE,
        max_num_batched_tokens=8192,
    )
    reqs = []
    for i in range(requests):
        prompt = [(i * 7919 + k) % _VOCAB + 1 for k in range(context)]
        req = Request(f"r{i}", i, prompt, max_tokens=1 << 20)
        req.reset_blocks(groups)
        if not kv.admit(req, [[] for _ in range(groups)], 0, context):
            raise RuntimeError("the bench's pool is too small")  # sized above: a bug
        req.num_computed = context - 1  # the last prompt token is the first decode's input
        reqs.append(req)
    return kv, reqs


def run_plan_bench(
    requests: int, context: int, steps: int = 64, groups: int = 1, parent_hashes: bool = True
) -> dict[str, Any]:
    """``{"requests", "context", "groups", "steps", "changes": {...}, "whole": {...},
    "bytes_ratio", "scheduler_ratio", "rank_ratio"}``; each form ``{"plan_bytes",
    "scheduler_us", "rank_us"}`` (medians over the timed steps, the first step, which sends
    every table whole in both forms, left out); a ratio is changes over whole.
    ``parent_hashes``: the synthetic model's plans (False: a real model's)."""
    if requests < 1 or context < 1 or steps < 2 or groups < 1:
        raise ValueError(
            f"need requests, context, groups >= 1 and steps >= 2 "
            f"(got {requests}, {context}, {groups}, {steps})"
        )
    kv, reqs = _decoding(requests, context, groups, steps)
    tables = RankTables(0)
    times: dict[str, dict[str, list[float]]] = {
        form: {"plan_bytes": [], "scheduler_us": [], "rank_us": []} for form in ("changes", "whole")
    }
    for step in range(steps):
        scheduled = [ScheduledRequest(req, 1) for req in reqs]
        for req in reqs:  # the step's new token gets its block (one in BLOCK_SIZE steps)
            if not kv.grow(req, req.num_computed + 1):
                raise RuntimeError("the bench's pool is too small")
        started = time.perf_counter()
        batch = model_batch(scheduled, kv, parent_hashes)
        blob = wire.encode(StepPlan(step, batch=batch, tables_epoch=kv.tables_epoch))
        built = time.perf_counter()
        tables.apply(wire.decode_plan(blob))
        applied = time.perf_counter()
        whole = [_whole(e, r, BLOCK_SIZE) for e, r in zip(batch, reqs, strict=True)]
        whole_blob = wire.encode(StepPlan(step, batch=whole))
        whole_built = time.perf_counter()
        wire.decode_plan(whole_blob)
        whole_done = time.perf_counter()
        if step == 0:
            continue
        # both forms share the batch builder; the whole form adds what copying the tables costs
        # (what the builder did before) plus its own encoding
        build = built - started
        for form, size, scheduler, rank in (
            ("changes", len(blob), build, applied - built),
            ("whole", len(whole_blob), build + (whole_built - applied), whole_done - whole_built),
        ):
            times[form]["plan_bytes"].append(size)
            times[form]["scheduler_us"].append(scheduler * 1e6)
            times[form]["rank_us"].append(rank * 1e6)
        for req in reqs:
            req.tokens.append(1)
            req.num_computed += 1
    result: dict[str, Any] = {
        "requests": requests,
        "context": context,
        "groups": groups,
        "steps": steps - 1,
    }
    for form, series in times.items():
        result[form] = {key: statistics.median(values) for key, values in series.items()}
    for key, name in (
        ("plan_bytes", "bytes_ratio"),
        ("scheduler_us", "scheduler_ratio"),
        ("rank_us", "rank_ratio"),
    ):
        result[name] = result["changes"][key] / result["whole"][key]
    return result


def format_plan_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "the step message of a decode step: block-table changes (as sent) against whole tables "
        "(as before the ranks kept them), medians per step",
        f"{'requests':>8} {'context':>8} {'bytes':>10} {'whole':>11} {'sched us':>9} "
        f"{'whole':>9} {'rank us':>8} {'whole':>9} {'bytes x':>8} {'rank x':>7}",
    ]
    for r in rows:
        c, w = r["changes"], r["whole"]
        lines.append(
            f"{r['requests']:>8} {r['context']:>8} {c['plan_bytes']:>10,.0f} "
            f"{w['plan_bytes']:>11,.0f} {c['scheduler_us']:>9.0f} {w['scheduler_us']:>9.0f} "
            f"{c['rank_us']:>8.0f} {w['rank_us']:>9.0f} {r['bytes_ratio']:>8.4f} "
            f"{r['rank_ratio']:>7.3f}"
        )
    return "\n".join(lines)
