"""The chat workload: conversations whose answers feed their next turn. The session's logic on
a stand-in tokenizer (plain functions, so that a turn's token ids can be read back as text),
then SmolLM2 through ``raykv run`` on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raykv.cli import main
from raykv.model.presets import preset_path
from raykv.model.spec import UnsupportedModel
from raykv.workload.chat import TOPICS, ChatSession


def _ids(messages: list[dict]) -> list[int]:
    text = "|".join(f"{m['role']}:{m['content']}" for m in messages)
    return [ord(c) for c in text]


def _text(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def test_each_answer_is_in_the_next_turns_prompt_and_the_session_ends_on_count() -> None:
    session = ChatSession(7, chat_ids=_ids, decode=_text, max_tokens=5, concurrent=2, turns=3)
    first = session.start()
    assert [s.req_id for s in first] == ["chat-0-1", "chat-1-1"]
    assert _text(list(first[0].prompt)) == f"user:{TOPICS[0][0]}"
    follow = session.answered("chat-0-1", [ord(c) for c in "Paris."])
    assert [s.req_id for s in follow] == ["chat-0-2"]
    prompt = _text(list(follow[0].prompt))
    assert prompt == f"user:{TOPICS[0][0]}|assistant:Paris.|user:{TOPICS[0][1]}"
    assert list(follow[0].prompt[: len(first[0].prompt)]) == list(first[0].prompt)  # a prefix
    # a refused turn (no tokens) ends its conversation; the next conversation takes its place
    assert [s.req_id for s in session.answered("chat-1-1", [])] == ["chat-2-1"]
    sent = 4  # two first turns, a follow-up, and the refused turn's replacement
    queue = ["chat-0-2", "chat-2-1"]
    while queue:
        req_id = queue.pop(0)
        nxt = session.answered(req_id, [ord("x")])
        sent += len(nxt)
        queue += [s.req_id for s in nxt]
    assert sent == 7  # exactly num_requests turns, none after
    assert all(e.question for e in session.exchanges) and len(session.exchanges) == 7


def test_raykv_run_chats_with_smollm2_and_the_follow_up_reuses_the_first_turn(
    tmp_path: Path,
) -> None:
    try:
        preset_path("smollm2-135m-instruct")
    except UnsupportedModel as exc:
        pytest.skip(str(exc))
    out = tmp_path / "report.json"
    argv = ["run", "--engine", "local", "--config", "configs/local.yaml", "--json-report", str(out)]
    for s in (
        "workload.num_requests=4",
        "workload.concurrent_conversations=2",
        "workload.chat_turns=2",
        "workload.max_tokens=8",
    ):
        argv += ["--set", s]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["requests_finished"] == 4
    samples = report["samples"]
    assert samples[0]["question"] == TOPICS[0][0]
    assert samples[0]["answer"].startswith("The capital of France is")
    turns = {r["req_id"]: r for r in report["requests"]}
    # the second turn's prompt holds the first turn's prompt and answer: found in a cache
    second = turns["chat-0-2"]
    assert second["prompt_tokens"] > turns["chat-0-1"]["prompt_tokens"] + 1
    assert second["gpu_hit_tokens"] + second["cpu_hit_tokens"] > 0
