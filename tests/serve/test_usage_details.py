"""Where a request's cached prompt tokens came from, as the replica hands them over and the
answer's ``usage.prompt_tokens_details`` reports them: the GPU prefix cache, the CPU tier and
the disk tier apart. No Ray session: the hand-over and the usage are plain Python."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("ray.serve")

from raykv.core.request import Request
from raykv.serve.answers import usage_of
from raykv.serve.messages import EngineUpdate
from raykv.serve.replica import EngineReplica


class FakeStream:
    """What ``EngineReplica._hand`` needs of a stream: how far it got, where items go."""

    def __init__(self) -> None:
        self.delivered = 0
        self.items: list[Any] = []

    def put(self, item: Any) -> None:
        self.items.append(item)


def test_the_replica_hands_over_the_lower_tiers_tokens_apart() -> None:
    req = Request("r", 0, list(range(1, 101)), 4)
    req.num_gpu_hit_tokens, req.num_cpu_hit_tokens, req.num_disk_hit_tokens = 16, 32, 40
    req.num_shared_hit_tokens = 8
    stream = FakeStream()
    replica = EngineReplica.__new__(EngineReplica)  # _hand reads nothing of the replica
    replica._hand(stream, req, "finished_length")  # type: ignore[arg-type]
    (item,) = stream.items
    assert item[3] == (16, 32, 40, 8)


def test_usage_reports_the_lower_tiers_tokens_apart() -> None:
    last = EngineUpdate(
        finish_reason="length",
        prompt_tokens=100,
        completion_tokens=4,
        cached_tokens=96,
        cpu_tier_tokens=32,
        disk_tier_tokens=40,
        shared_tier_tokens=8,
    )
    details = usage_of(last)["prompt_tokens_details"]
    assert details == {
        "cached_tokens": 96,
        "gpu_cache_tokens": 16,
        "cpu_tier_tokens": 32,
        "disk_tier_tokens": 40,
        "shared_tier_tokens": 8,
    }
