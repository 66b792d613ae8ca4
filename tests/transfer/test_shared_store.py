"""A rank's chunks in Mooncake Store (a real master on loopback, a real segment): put from the
pool's own memory and read back checked, namespaced per model and rank, and nothing served that
is not the key's intact part."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from raykv.transfer.disk_files import ChunkFormat
from raykv.transfer.shared_store import SharedChunks, SharedStoreError, StoreEndpoint, object_key

FORMAT = ChunkFormat(16 * 1024, 3)
_namespaces = itertools.count()


def pool(slots: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (slots, FORMAT.data_bytes), dtype=np.uint8)


def chunks(address: str, memory: np.ndarray, namespace: str, rank: int = 0) -> SharedChunks:
    return SharedChunks(
        StoreEndpoint(address), namespace, rank, FORMAT, memory.ctypes.data, len(memory)
    )


@pytest.fixture()
def namespace() -> str:
    """A namespace of the test's own: the session's store outlives every test."""
    return f"test-{time.time_ns()}-{next(_namespaces)}"


def test_a_chunk_put_from_one_pool_is_read_into_another_byte_for_byte(
    shared_store: str, namespace: str
) -> None:
    source, target = pool(seed=1), np.zeros((8, FORMAT.data_bytes), dtype=np.uint8)
    writer, reader = (
        chunks(shared_store, source, namespace),
        chunks(shared_store, target, namespace),
    )
    try:
        assert writer.put([0x11, 0x22], [3, 5]) == [0, 0]
        assert reader.exists([0x11, 0x22, 0x33]) == [True, True, False]
        assert reader.get([0x22, 0x11, 0x33], [0, 1, 2]) == ["ok", "ok", "missing"]
        assert np.array_equal(target[0], source[5]) and np.array_equal(target[1], source[3])
        assert not target[2].any()  # a missing chunk's slot is left as it was
    finally:
        writer.close()
        reader.close()


def test_namespaces_and_ranks_never_see_each_others_parts(
    shared_store: str, namespace: str
) -> None:
    memory = pool(seed=2)
    mine = chunks(shared_store, memory, namespace, rank=0)
    other_rank = chunks(shared_store, memory, namespace, rank=1)
    other_model = chunks(shared_store, memory, namespace + "-other", rank=0)
    try:
        assert mine.put([0x44], [0]) == [0]
        assert other_rank.exists([0x44]) == [False]
        assert other_model.exists([0x44]) == [False]
        assert other_model.get([0x44], [1]) == ["missing"]
    finally:
        for c in (mine, other_rank, other_model):
            c.close()


@pytest.mark.parametrize("spoil", ["page", "key", "short", "long"])
def test_an_object_that_is_not_the_keys_intact_part_is_never_served(
    shared_store: str, namespace: str, spoil: str
) -> None:
    """What another writer (or a bug, or a flipped bit) left under the key's name: a page
    changed, another key's header, an object too short. Written with the store's plain put, as
    a foreign writer would."""
    memory = pool(seed=3)
    store = chunks(shared_store, memory, namespace)
    try:
        key = 0x55
        header = FORMAT.header(0x66 if spoil == "key" else key, store.page_crcs(0))
        body = bytearray(memory[0].tobytes())
        if spoil == "page":
            body[len(body) // 2] ^= 0xFF
        if spoil == "short":
            body = body[: len(body) // 2]
        if spoil == "long":
            body += b"more"
        assert store._client.put(object_key(namespace, key, 0), bytes(header) + bytes(body)) == 0
        # a short object the store itself refuses to deliver (its transfer fails); the rest
        # arrive and fail their checks
        assert store.get([key], [4]) == ["failed" if spoil == "short" else "corrupt"]
    finally:
        store.close()


def test_a_dead_master_fails_operations_instead_of_answering(shared_store: str) -> None:
    """The session's master stays up: this test starts one of its own and kills it."""
    from raykv.transfer.segment_process import HeldSegment
    from raykv.transfer.shared_master import EmbeddedMaster

    master = EmbeddedMaster()
    address = master.start()
    holder = HeldSegment(address, 32 * 2**20)  # a process of its own: ended at once
    holder.start()
    memory = pool(seed=4)
    store = chunks(address, memory, "dead-master")
    try:
        assert store.put([0x77], [0]) == [0]
        master.kill()
        with pytest.raises(SharedStoreError):
            store.exists([0x77])
        assert store.get([0x77], [1]) != ["ok"]
        assert store.put([0x78], [2]) != [0]
    finally:
        store.close()
        holder.stop()
        master.stop()
    assert master.pid is None


def test_an_embedded_master_listens_on_loopback_only(shared_store: str) -> None:
    """Its RPC and its HTTP metrics server both: the metrics server took every interface
    until ``--metrics_host`` was passed (found by the serving test that lists listeners)."""
    import ipaddress

    psutil = pytest.importorskip("psutil")
    from raykv.transfer.shared_master import EmbeddedMaster

    master = EmbeddedMaster()
    master.start()
    try:
        deadline = time.monotonic() + 10
        while True:  # the metrics server may come up a little after the RPC answers
            bound = [
                c.laddr
                for c in psutil.net_connections(kind="tcp")
                if c.pid == master.pid and c.status == psutil.CONN_LISTEN
            ]
            if len(bound) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert len(bound) >= 2, bound  # RPC and metrics
        assert all(ipaddress.ip_address(a.ip).is_loopback for a in bound), bound
    finally:
        master.stop()
