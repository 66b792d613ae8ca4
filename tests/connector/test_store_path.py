"""What gets stored, when, and what happens when the directory says no (notes 7.2)."""

from __future__ import annotations

from raykv.offload.directory import Directory, StorePlan
from tests.connector.harness import Runner, tokens


class ScriptedDirectory(Directory):
    """A real directory whose prepare_store answers can be overridden per call (a fake, to force
    the None / empty / partial answers that a real directory gives only under pressure)."""

    def __init__(self, *args, answers=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.answers = list(answers or [])
        self.prepare_calls: list[list[int]] = []
        self.complete_calls: list[list[int]] = []
        self._refused: set[int] = set()  # what the last "none" refused

    def prepare_store(self, keys, keep=()):
        self.prepare_calls.append(list(keys))
        # "none": no room for these keys, nor for any part of them (the scheduler then asks
        # for a shorter prefix in the same step: refused too, without using up an answer)
        if keys and set(keys) < self._refused:
            return None
        self._refused = set()
        if self.answers:
            answer = self.answers.pop(0)
            if answer == "none":
                self._refused = set(keys)
                return None
            if answer == "empty":
                return StorePlan([], [], [])
            if isinstance(answer, int):  # accept only the key at this index
                return super().prepare_store([keys[answer]], keep=keep)
        return super().prepare_store(keys, keep=keep)

    def complete_store(self, keys, success=True):
        self.complete_calls.append(list(keys))
        return super().complete_store(keys, success)


def test_only_full_chunks_are_stored_and_the_partial_tail_never() -> None:
    r = Runner(block_size=4)
    r.add("a", tokens(10), max_tokens=4)
    r.step()  # prefill: 10 tokens computed, blocks 0 and 1 full
    assert r.records[0].stored["a"] == [(0, 0), (0, 1)]
    r.run()
    # decode computes positions 10, 11, 12 (the last token sampled gets no KV): block 2 fills,
    # block 3 holds one token and is never stored
    assert r.blocks("stored", "a") == {0, 1, 2}
    r.drained()


def test_chunks_of_several_blocks_are_stored_whole() -> None:
    r = Runner(block_size=4, blocks_per_chunk=3)
    r.add("a", tokens(26), max_tokens=1)
    r.run()
    assert r.blocks("stored", "a") == set(range(6))  # 2 chunks; the 3rd (blocks 6-8) not full
    r.drained()


def test_only_the_keys_prepare_store_returns_are_stored() -> None:
    d = ScriptedDirectory(64, "lru", answers=[1])  # accept the middle chunk only
    r = Runner(block_size=4, blocks_per_chunk=3, directory=d)
    r.add("a", tokens(37), max_tokens=1)
    r.run()
    assert r.blocks("stored", "a") == {3, 4, 5}


def test_none_keeps_the_cursor_and_retries_next_step() -> None:
    d = ScriptedDirectory(64, "lru", answers=["none"])
    r = Runner(block_size=4, directory=d)
    r.add("a", tokens(9), max_tokens=3)
    r.step()
    assert not r.records[0].stored
    r.step()
    assert r.records[1].stored["a"] == [(0, 0), (0, 1)]  # the same chunks, retried
    # refused whole, then a shorter prefix asked for in the same step (refused too)
    assert d.prepare_calls[1] == d.prepare_calls[0][:1]
    assert d.prepare_calls[0] == d.prepare_calls[2][:2]
    assert r.connector.stats.allocation_failures == 1
    r.run()
    r.drained()


def test_a_prompt_longer_than_the_cpu_tier_stores_the_prefix_that_fits() -> None:
    """A prompt of more chunks than the CPU tier holds asked for all of them at once, every
    step, was refused every time and stored nothing (so the disk tier under it got nothing
    either: found serving three 505-token prompts with a small CPU tier)."""
    r = Runner(block_size=4, directory=Directory(3, "lru"))
    r.add("a", tokens(33), max_tokens=2)  # 8 full blocks in its prefill: 8 chunks of 1 block
    r.step()
    assert r.records[0].stored["a"] == [(0, 0), (0, 1), (0, 2)]  # the prefix the tier holds
    r.run()
    # never its suffix over its own prefix: a lookup reaches a chunk only through those before
    assert r.blocks("stored", "a") == {0, 1, 2}
    r.drained()


def test_an_empty_answer_advances_the_cursor() -> None:
    d = ScriptedDirectory(64, "lru", answers=["empty"])
    r = Runner(block_size=4, directory=d)
    r.add("a", tokens(9), max_tokens=4)  # KV for 9 + 3 positions: block 2 fills while decoding
    r.run()
    assert r.blocks("stored", "a") == {2}  # 0 and 1 were declined for good, 2 came later
    assert sum(len(c) for c in d.prepare_calls) == 3  # each chunk offered once
    r.drained()


def test_complete_store_is_per_job_with_that_jobs_keys() -> None:
    d = ScriptedDirectory(64, "lru")
    r = Runner(block_size=4, max_num_batched_tokens=8, directory=d)
    r.add("a", tokens(16), max_tokens=1)
    r.run()  # chunked prefill: 8 tokens per step, one store job per step
    assert [len(c) for c in d.complete_calls] == [2, 2]
    assert set(d.complete_calls[0]).isdisjoint(d.complete_calls[1])
    r.drained()


def test_a_chunk_missing_one_token_is_not_offered() -> None:
    d = ScriptedDirectory(64, "lru")
    r = Runner(block_size=4, directory=d)
    r.add("a", tokens(3), max_tokens=1)  # 3 tokens computed: no full block
    r.run()
    assert d.prepare_calls == []


def test_aborting_a_queued_request_builds_no_store_and_drops_its_state() -> None:
    r = Runner(block_size=4, max_num_seqs=1)
    r.add("a", tokens(8), max_tokens=8)
    r.add("b", tokens(8, 100), max_tokens=1)
    r.step()  # b waits for a seat
    r.engine.abort("b")
    r.run()
    assert not r.all("stored", "b")
    r.drained()


def test_stores_cover_decode_chunks_of_the_answer() -> None:
    r = Runner(block_size=4)
    r.add("a", tokens(4), max_tokens=10)
    r.run()
    # 4 prompt + 9 decoded positions with KV = 13: blocks 0, 1, 2 full
    assert r.blocks("stored", "a") == {0, 1, 2}
    r.drained()
