"""A rank's chunks in Mooncake Store (a real master on loopback, a real segment): put from the
pool's own memory and read back checked, namespaced per model and rank, and nothing served that
is not the key's intact part, sealed by a holder of the cluster's secret."""

from __future__ import annotations

import hashlib
import itertools
import time

import numpy as np
import pytest

from raykv.transfer.crc import crc32
from raykv.transfer.disk_files import NO_SEAL, ChunkFormat, ChunkIdentity
from raykv.transfer.seal import Sealer
from raykv.transfer.shared_store import (
    PIPELINE_PARTS,
    SharedChunks,
    SharedStoreError,
    StoreEndpoint,
    object_key,
)

FORMAT = ChunkFormat(16 * 1024, 3)
SECRET = b"this test session's cluster secret"
_namespaces = itertools.count()


def pool(slots: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (slots, FORMAT.data_bytes), dtype=np.uint8)


def identity(namespace: str, rank: int = 0, tp_size: int = 2) -> ChunkIdentity:
    return ChunkIdentity(
        hashlib.blake2b(namespace.encode(), digest_size=16).digest(), rank, tp_size
    )


def chunks(
    address: str,
    memory: np.ndarray,
    namespace: str,
    rank: int = 0,
    secret: bytes = SECRET,
    tp_size: int = 2,
) -> SharedChunks:
    fmt = ChunkFormat(FORMAT.page_bytes, FORMAT.pages, identity(namespace, rank, tp_size))
    return SharedChunks(
        StoreEndpoint(address, secret=secret), namespace, rank, fmt, memory.ctypes.data, len(memory)
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


def test_a_read_of_several_runs_keeps_each_parts_status_and_checksums_in_order(
    shared_store: str, namespace: str
) -> None:
    """A read comes over in runs of ``PIPELINE_PARTS`` checked on another thread while the next
    one comes: a missing part and a spoiled one in different runs, and each answer (with its
    page CRC-32s) still lands on its own chunk."""
    count = 2 * PIPELINE_PARTS + 3
    source = pool(count, seed=7)
    target = np.zeros((count, FORMAT.data_bytes), dtype=np.uint8)
    writer, reader = (
        chunks(shared_store, source, namespace),
        chunks(shared_store, target, namespace),
    )
    keys = [0x1000 + i for i in range(count)]
    missing, spoiled = 2, PIPELINE_PARTS + 5
    try:
        put = [k for i, k in enumerate(keys) if i != missing]
        assert writer.put(put, [i for i in range(count) if i != missing]) == [0] * len(put)
        writer.spoil(keys[spoiled])
        slots = list(reversed(range(count)))  # chunk i into slot count-1-i
        crcs: list[list[int]] = []
        statuses = reader.get(keys, slots, crcs)
        expected = ["ok"] * count
        expected[missing], expected[spoiled] = "missing", "corrupt"
        assert statuses == expected
        for i, slot in enumerate(slots):
            if expected[i] != "ok":
                assert crcs[i] == []
                continue
            assert np.array_equal(target[slot], source[i])
            assert crcs[i] == writer.page_crcs(i)
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
        fmt = store.format
        sealed = fmt.sealed_part(0x66 if spoil == "key" else key, store.page_crcs(0))
        # sealed with the secret, as a holder of it would: what fails is the part, not the seal
        header = fmt.header_of(sealed, Sealer(SECRET).seal(sealed, memoryview(memory[0])))
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


@pytest.mark.parametrize(
    "forgery", ["unsealed", "another secret", "another rank", "another namespace", "another TP"]
)
def test_a_part_not_sealed_for_this_rank_by_a_holder_of_the_secret_is_never_served(
    shared_store: str, namespace: str, forgery: str
) -> None:
    """Anyone who reaches the master can put an object under a name anyone can compute
    (``<namespace>/<key>/<rank>``) with CRC-32s that match the bytes they chose: it was served.
    A part sealed under another secret, or a genuine one of another rank, namespace or TP size
    moved under this one's name, is refused too."""
    memory = pool(seed=6)
    store = chunks(shared_store, memory, namespace)
    key, theirs = 0x5A5A, np.random.default_rng(7).integers(0, 255, FORMAT.data_bytes, np.uint8)
    who = {
        "another rank": identity(namespace, rank=1),
        "another namespace": identity(namespace + "-other"),
        "another TP": identity(namespace, tp_size=4),
    }.get(forgery, store.format.identity)
    pb = FORMAT.page_bytes
    crcs = [crc32(theirs[i * pb : (i + 1) * pb].tobytes()) for i in range(FORMAT.pages)]

    def part(fmt: ChunkFormat, secret: bytes | None) -> bytes:
        sealed = fmt.sealed_part(key, crcs)
        seal = NO_SEAL if secret is None else Sealer(secret).seal(sealed, memoryview(theirs))
        return bytes(fmt.header_of(sealed, seal)) + theirs.tobytes()

    secret = {"unsealed": None, "another secret": b"a secret that is not the cluster's"}
    forged = part(ChunkFormat(pb, FORMAT.pages, who), secret.get(forgery, SECRET))
    name = object_key(namespace, key, 0)
    try:
        assert store._client.put(name, forged) == 0
        verified: list[list[int]] = []
        assert store.get([key], [4], verified) == ["corrupt"]
        assert verified == [[]]  # no checksum of it reaches the CPU tier's books
        # the same bytes, sealed for this rank with the cluster's secret, load: what refused
        # the forgery was its seal or its identity
        store._client.remove(name, True)
        assert store._client.put(name, part(store.format, SECRET)) == 0
        assert store.get([key], [4]) == ["ok"]
        assert np.array_equal(memory[4], theirs)
    finally:
        store.remove([key])
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
    try:
        pid = master.pid
        # started again where its clients look for it, the store empty
        assert master.restart() == address and master.pid != pid
        again = chunks(address, memory, "dead-master")
        try:
            assert again.exists([0x77]) == [False]
        finally:
            again.close()
    finally:
        master.stop()
    assert master.pid is None
    with pytest.raises(SharedStoreError, match="never started"):
        EmbeddedMaster().restart()


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
