"""The shared tier's engine on a real Mooncake Store: chunks published from one engine's pool
are promoted into another's byte for byte, and every way a part can be missing or wrong ends in
a job that fails as corrupt (the chunk leaves the tier), never in bytes from somewhere else."""

from __future__ import annotations

import dataclasses
import itertools
import time

import pytest
import torch

from raykv.core.step import TierMove
from raykv.transfer.checksums import RowChecksums
from raykv.transfer.layout import allocate_pool
from raykv.transfer.shared import SharedTransferEngine, SharedUnavailable
from raykv.transfer.shared_store import StoreEndpoint, _idle, object_key
from tests.transfer.test_disk_engine import KEYS  # keys up to 72 bits
from tests.transfer.test_disk_engine import LAYOUT as DISK_LAYOUT
from tests.transfer.test_shared_store import SECRET

LAYOUT = dataclasses.replace(DISK_LAYOUT, num_slots=8)
_names = itertools.count()


def endpoint(address: str) -> StoreEndpoint:
    """The store at ``address``, joined with this session's cluster secret."""
    return StoreEndpoint(address, secret=SECRET)


@pytest.fixture()
def namespace() -> str:
    return f"engine-{time.time_ns()}-{next(_names)}"


def filled_pool(seed: int) -> torch.Tensor:
    pool = allocate_pool(LAYOUT, zero=True)
    torch.manual_seed(seed)
    pool.copy_(torch.randn(pool.shape).to(pool.dtype))
    return pool


def run(eng: SharedTransferEngine, move: TierMove) -> tuple[list[int], list[int], list[int]]:
    eng.submit(move)
    eng.flush([move.job_id])
    completed, failed = eng.poll()
    return completed, failed, eng.take_corrupt()


def test_published_chunks_are_promoted_by_another_engine_byte_for_byte(
    shared_store: str, namespace: str
) -> None:
    source, target = filled_pool(1), allocate_pool(LAYOUT, zero=True)
    a = SharedTransferEngine(endpoint(shared_store), namespace, 0, source, LAYOUT)
    b = SharedTransferEngine(endpoint(shared_store), namespace, 0, target, LAYOUT)
    try:
        assert run(a, TierMove.of(1, False, KEYS, [0, 1, 2], False)) == ([1], [], [])
        assert b.exists(KEYS) == [True, True, True]
        assert run(b, TierMove.of(2, True, KEYS, [5, 6, 7], False)) == ([2], [], [])
        assert torch.equal(target[5:8], source[0:3])
        stats = b.take_stats()
        assert stats.shared_read_chunks == 3 and stats.shared_read_bytes == 3 * LAYOUT.chunk_bytes
        # published again (another engine, the same key at once): the store keeps one part
        assert run(b, TierMove.of(3, False, KEYS[:1], [5], False)) == ([3], [], [])
    finally:
        a.shutdown()
        b.shutdown()


def test_a_missing_or_spoiled_part_fails_the_promotion_as_corrupt(
    shared_store: str, namespace: str
) -> None:
    pool = filled_pool(2)
    eng = SharedTransferEngine(endpoint(shared_store), namespace, 0, pool, LAYOUT)
    try:
        assert run(eng, TierMove.of(1, False, KEYS[:1], [0], False)) == ([1], [], [])
        before = pool[3].clone()
        # never published
        assert run(eng, TierMove.of(2, True, KEYS[1:2], [3], False)) == ([], [2], [2])
        # another writer's bytes under a key's name: its header names another key
        client = eng.chunks._client
        name = object_key(namespace, KEYS[2], 0)
        header = eng.format.header(KEYS[0], eng.chunks.page_crcs(0))
        assert client.put(name, bytes(header) + pool[0].view(torch.uint8).numpy().tobytes()) == 0
        assert run(eng, TierMove.of(3, True, KEYS[2:3], [3], False)) == ([], [3], [3])
        assert eng.take_stats().shared_corrupt == 1  # its removal asked (once its lease ends)
        # read again: never served
        assert run(eng, TierMove.of(4, True, KEYS[2:3], [4], False)) == ([], [4], [4])
        del before
    finally:
        eng.shutdown()


def test_a_publish_of_bytes_changed_since_their_store_puts_nothing(
    shared_store: str, namespace: str
) -> None:
    pool = filled_pool(3)
    rows = pool.view(LAYOUT.num_slots * LAYOUT.blocks_per_chunk, -1)
    sums = RowChecksums(rows)
    sums.record(range(rows.shape[0]))
    eng = SharedTransferEngine(endpoint(shared_store), namespace, 0, pool, LAYOUT, sums=sums)
    try:
        pool[1].view(torch.uint8)[7] ^= 0xFF  # a bit flipped in the CPU pool after the store
        assert run(eng, TierMove.of(1, False, KEYS[:2], [0, 1], True)) == ([], [1], [1])
        assert eng.exists(KEYS[:2]) == [True, False]
    finally:
        eng.shutdown()


def test_an_unreachable_master_is_a_configuration_error_naming_the_key() -> None:
    from raykv.transfer.shared_master import free_port
    from raykv.transfer.shared_store import mooncake_problem

    if mooncake_problem():
        pytest.skip(mooncake_problem() or "")
    pool = filled_pool(4)
    with pytest.raises(SharedUnavailable, match=r"offload\.shared\.master"):
        SharedTransferEngine(endpoint(f"127.0.0.1:{free_port()}"), "x", 0, pool, LAYOUT)


def test_a_read_the_store_gave_up_on_is_reported_unsettled_and_a_missing_part_is_not(
    shared_store: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A promotion whose read failed in transit (Mooncake's TRANSFER_FAIL, or the call raised)
    may still have bytes landing in its slots: it is reported ``unsettled`` (the scheduler holds
    the slots); a part that was never there is not. The failures in transit are forced by
    replacing the client's read with one that answers TRANSFER_FAIL or raises: a real store
    cannot be made to time out on demand."""
    pool = filled_pool(4)
    eng = SharedTransferEngine(endpoint(shared_store), namespace, 0, pool, LAYOUT)
    try:
        assert run(eng, TierMove.of(1, False, KEYS[:2], [0, 1], False)) == ([1], [], [])
        assert run(eng, TierMove.of(2, True, KEYS[2:3], [4], False)) == ([], [2], [2])
        assert eng.take_unsettled() == []  # never published: nothing was in transit
        client = eng.chunks._client

        class Answering:
            """The real client, but for its reads: ``read`` answers them."""

            def __init__(self, read: object) -> None:
                self.batch_get_into_multi_buffers = read

            def __getattr__(self, name: str) -> object:
                return getattr(client, name)

        monkeypatch.setattr(eng.chunks, "_client", Answering(lambda names, *_: [-800] * len(names)))
        assert run(eng, TierMove.of(3, True, KEYS[:2], [5, 6], False)) == ([], [3], [])
        assert eng.take_unsettled() == [3]

        def broken(*_: object) -> list[int]:
            raise RuntimeError("the transfer engine's call failed")

        monkeypatch.setattr(eng.chunks, "_client", Answering(broken))
        assert run(eng, TierMove.of(4, True, KEYS[:1], [5], False)) == ([], [4], [])
        assert eng.take_unsettled() == [4]
    finally:
        monkeypatch.undo()
        eng.shutdown()
    # a client that failed is closed, not kept for the next engine in the process (what it
    # knows of the pool may be stale)
    assert all(kept is not client for kept in _idle.get(endpoint(shared_store), []))
