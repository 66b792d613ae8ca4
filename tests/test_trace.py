"""The Mooncake trace reader: good lines parse, bad lines name the line and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raykv.workload.requests import TRACE_LOAD, EngineCapacity, trace_requests
from raykv.workload.trace import TraceError, parse_trace_line, read_trace

GOOD = '{"timestamp": 5, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 2]}'


def test_parses_a_good_line() -> None:
    r = parse_trace_line(GOOD, "t:1")
    assert (r.timestamp, r.input_length, r.output_length, r.hash_ids) == (5.0, 1100, 3, (0, 1, 2))
    assert r.full_blocks() == 2


@pytest.mark.parametrize(
    "line,message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"input_length": 1, "output_length": 1, "hash_ids": [0]}', "missing field 'timestamp'"),
        ('{"timestamp": 0, "output_length": 1, "hash_ids": [0]}', "missing field 'input_length'"),
        ('{"timestamp": 0, "input_length": 1, "output_length": 1}', "missing field 'hash_ids'"),
        (
            '{"timestamp": 0, "input_length": "9", "output_length": 1, "hash_ids": [0]}',
            "'input_length' must be int",
        ),
        (
            '{"timestamp": 0, "input_length": true, "output_length": 1, "hash_ids": [0]}',
            "'input_length' must be int",
        ),
        (
            '{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}',
            "'input_length' must be >= 1",
        ),
        (
            '{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [0]}',
            "'timestamp' must be >= 0",
        ),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [-3]}',
            "list of non-negative integers",
        ),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "0"}',
            "list of non-negative integers",
        ),
        (
            '{"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [0]}',
            "1 hash_ids for input_length 2000; expected 4",
        ),
    ],
)
def test_bad_lines_name_the_problem(line: str, message: str) -> None:
    with pytest.raises(TraceError, match=message) as info:
        parse_trace_line(line, "trace.jsonl:7")
    assert str(info.value).startswith("trace.jsonl:7: ")


def test_read_trace_reports_the_line_number(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(GOOD + "\n\n" + GOOD + "\n" + '{"timestamp": 0}\n')
    with pytest.raises(TraceError, match=r"t\.jsonl:4: missing field 'input_length'"):
        read_trace(path)
    assert len(read_trace(path, limit=2)) == 2


def test_read_trace_missing_or_empty_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot open trace"):
        read_trace(tmp_path / "nope.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(empty)


def test_shipped_trace_parses(mooncake_trace: Path) -> None:
    requests = read_trace(mooncake_trace)
    assert len(requests) == 3993
    assert sum(r.full_blocks() for r in requests) == 117888


def _write(tmp_path: Path, timestamps: list[int], input_length: int = 1024) -> Path:
    lines = [
        json.dumps(
            {"timestamp": t, "input_length": input_length, "output_length": 8, "hash_ids": [i, 99]}
        )
        for i, t in enumerate(timestamps)
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_step_arrivals_keep_the_traces_gaps_at_the_asked_mean_rate(tmp_path: Path) -> None:
    path = _write(tmp_path, [0, 0, 100, 400, 500])
    specs = trace_requests(path, vocab_size=100, arrival_rate=0.5, tokens_per_block=4)
    # 4 gaps over 500 ms at 0.5 requests per step: 8 steps, 0.016 steps per ms
    assert [s.arrival for s in specs] == pytest.approx([0.0, 0.0, 1.6, 6.4, 8.0])
    assert all(s.arrival_s is None for s in specs)
    at_once = trace_requests(path, vocab_size=100, arrival_rate=0.0, tokens_per_block=4)
    assert {s.arrival for s in at_once} == {0.0}
    same_time = trace_requests(
        _write(tmp_path, [7, 7, 7]), vocab_size=100, arrival_rate=2.0, tokens_per_block=4
    )
    assert [s.arrival for s in same_time] == [0.0, 0.5, 1.0]


def test_a_traces_default_rate_is_half_what_the_engine_serves(tmp_path: Path) -> None:
    path = _write(tmp_path, [0, 10, 20, 30, 40])  # prompts of 8 tokens, 8 output tokens
    seats = EngineCapacity(max_num_seqs=9, max_num_batched_tokens=10_000, pool_tokens=10_000)
    assert seats.requests_per_step(8, 8) == pytest.approx(1.0)  # 9 seats, 9 steps each
    budget = EngineCapacity(max_num_seqs=100, max_num_batched_tokens=32, pool_tokens=10_000)
    assert budget.requests_per_step(8, 8) == pytest.approx(2.0)  # 16 tokens each, 32 a step
    pool = EngineCapacity(max_num_seqs=100, max_num_batched_tokens=10_000, pool_tokens=48)
    assert pool.requests_per_step(8, 8) == pytest.approx(3 / 9)  # 3 requests fit in the pool
    specs = trace_requests(path, vocab_size=100, tokens_per_block=4, capacity=seats)
    assert specs[-1].arrival == pytest.approx(4 / (TRACE_LOAD * 1.0))
    assert trace_requests(path, vocab_size=100, tokens_per_block=4)[-1].arrival == 2.0


def test_a_wall_clock_replay_keeps_the_timestamps(tmp_path: Path) -> None:
    path = _write(tmp_path, [1000, 1500, 4000])
    specs = trace_requests(path, vocab_size=100, tokens_per_block=4, time_scale=2.0)
    assert [s.arrival_s for s in specs] == pytest.approx([0.0, 1.0, 6.0])
    assert {s.arrival for s in specs} == {0.0}


def test_a_trace_replayed_as_whole_conversations(tmp_path: Path) -> None:
    rows = [
        (0, [1, 2]),  # conversation 1
        (10, [5]),  # conversation 5
        (20, [1, 2, 3]),  # conversation 1's second turn, after another conversation's
        (30, [7, 8]),
        (40, [5, 6]),
    ]
    path = tmp_path / "t.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(
                {"timestamp": t, "input_length": 512 * len(h), "output_length": 2, "hash_ids": h}
            )
            for t, h in rows
        )
    )
    specs = trace_requests(
        path, vocab_size=100, tokens_per_block=4, arrival_rate=0.5, conversations=True
    )
    assert [s.req_id for s in specs] == ["trace-0", "trace-2", "trace-1", "trace-4", "trace-3"]
    assert [s.arrival for s in specs] == [0.0, 2.0, 4.0, 6.0, 8.0]
    # a turn's prompt still starts with its conversation's earlier prompt
    assert specs[1].prompt[: len(specs[0].prompt)] == specs[0].prompt
    from raykv.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="trace_order: conversations"):
        load_config(None, ["workload.trace_order=conversations", "workload.trace_time_scale=1"])
