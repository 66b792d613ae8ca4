"""Loads: what is loaded, deferral, concurrent lookups, abort while loading (notes 7.3)."""

from __future__ import annotations

from raykv.offload.directory import Directory
from tests.connector.harness import Runner, tokens


class CountingDirectory(Directory):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.match_calls = 0

    def match_prefix(self, keys, **kwargs):
        self.match_calls += 1
        return super().match_prefix(keys, **kwargs)


def test_a_prefix_gone_from_the_gpu_is_loaded_back() -> None:
    r = Runner(block_size=4)
    prompt = tokens(13)
    r.offload("a", prompt)
    assert r.blocks("stored", "a") == {0, 1, 2}
    b = r.add("b", [*prompt, 99, 98, 97, 96])
    r.run()
    assert r.blocks("loaded", "b") == {0, 1, 2}
    assert (b.num_gpu_hit_tokens, b.num_cpu_hit_tokens) == (0, 12)
    assert r.engine.totals.transfer.blocks_verified == 3
    assert r.engine.totals.transfer.mismatches == 0
    r.drained()


def test_after_a_gpu_hit_only_the_rest_is_loaded() -> None:
    r = Runner(block_size=4)
    prompt = tokens(13)
    r.offload("a", prompt, gpu_blocks_kept=1)
    b = r.add("b", [*prompt, 99])
    r.run()
    assert r.blocks("loaded", "b") == {1, 2}
    assert (b.num_gpu_hit_tokens, b.num_cpu_hit_tokens) == (4, 8)
    r.drained()


def test_no_lookup_below_one_chunk_and_one_for_a_single_chunk() -> None:
    d = CountingDirectory(64)
    r = Runner(block_size=4, directory=d)
    r.add("short", tokens(4))  # (4 - 1) // 4 == 0 chunks could ever load
    r.run()
    assert d.match_calls == 0
    r.add("one", tokens(5, 50))  # exactly one chunk is loadable
    r.run()
    assert d.match_calls == 1


def test_concurrent_lookups_of_one_prefix_load_it_once() -> None:
    r = Runner(block_size=4)
    prompt = tokens(13)
    r.offload("a", prompt)
    r.add("b", [*prompt, 99])
    c = r.add("c", [*prompt, 98])
    r.run()
    assert r.blocks("loaded", "b") == {0, 1, 2}
    assert not r.all("loaded", "c")  # deferred, then found the blocks b brought back
    assert c.num_cpu_hit_tokens == 0 and c.num_gpu_hit_tokens == 12
    assert r.connector.stats.deferred_lookups >= 1
    assert r.connector.stats.load_jobs == 1
    r.drained()


def test_an_aborted_loading_request_is_kept_until_its_load_lands() -> None:
    r = Runner(block_size=4)
    prompt = tokens(13)
    r.offload("a", prompt)
    r.pause_copies()
    b = r.add("b", [*prompt, 99])
    r.step()
    assert b.load_job is not None
    r.engine.abort("b")
    r.step(3)
    assert r.connector.tracked() == 1  # its load is still writing into its blocks
    held = [blk for t in b.block_tables for blk in t if blk]
    assert held and all(r.engine.pool.ref_count(blk) > 0 for blk in held)
    r.resume_copies()
    r.run()
    r.drained()
    assert r.engine.pool.num_free == r.engine.pool.num_usable


def test_loads_never_enter_the_fence() -> None:
    r = Runner(block_size=4)
    prompt = tokens(13)
    r.offload("a", prompt)
    r.pause_copies()
    b = r.add("b", [*prompt, 99])
    r.step(2)
    assert b.load_job is not None
    assert not r.connector.fence  # only stores are fenced; a load's blocks wait with b
    r.resume_copies()
    r.run()
    r.drained()


def test_a_request_with_jobs_in_flight_defers_its_lookup() -> None:
    r = Runner(block_size=4)
    r.pause_copies()
    a = r.add("a", tokens(9), max_tokens=5)
    r.step()
    assert r.in_flight("a")
    lookups = r.connector.directory.stats().lookups
    assert r.connector.lookup(a, 0) is None
    assert r.connector.directory.stats().lookups == lookups  # nothing was even looked up
    r.resume_copies()
    r.run()
    r.drained()
