"""The Mooncake trace reader: good lines parse, bad lines name the line and the field."""

from __future__ import annotations

from pathlib import Path

import pytest

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
