"""``raykv bench transfer --device shared``: a rank's chunks put into Mooncake Store and read back,
against a local copy of the same bytes.

For each page size a CPU pool of N chunks (``blocks_per_chunk`` pages each) lives in anonymous
memory, as a rank's shared-memory shard does, registered with the rank's store client. The
pool's DRAM segment is given by another process (``SegmentHolder`` in a child, as the store
actor of a node gives it), so every byte crosses the store's transport (TCP on loopback here)
as it would between nodes. Direction ``store`` puts every chunk (header with its page
checksums, then the pages straight from the pool: a publish); ``load`` reads them back into the
pool (checked: a shared hit's read); each on two threads, one run of the chunks each, as a
rank's shared engine moves a job. The limit it is held against is measured in
the same run, alternating with it: one copy of the same bytes between two buffers of this
process (what a load from a local CPU tier costs at most). ``ratio`` is the store's GB/s over
the copy's; both count the pages' bytes. Every part is sealed with a cluster secret
(``transfer/seal.py``); ``unsealed_gbps`` is the same put or read, alternating with it, with a
seal that computes nothing (the bench's own stand-in: raykv itself never skips the seal), and
``seal_ratio`` the sealed GB/s over it: what the seal costs.

The master is started for the run on loopback (``EmbeddedMaster``) unless ``master`` names a
running one; every object the bench put is removed when its row ends.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from raykv.bench.transfer import best_pair
from raykv.core.keys import make_key
from raykv.transfer.disk_files import NO_SEAL, ChunkFormat
from raykv.transfer.seal import new_secret
from raykv.transfer.segment_process import HeldSegment
from raykv.transfer.shared_master import EmbeddedMaster
from raykv.transfer.shared_store import SharedChunks, SharedStoreError, StoreEndpoint

SHARED_DIRECTIONS = ("store", "load")
DEFAULT_SHARED_BLOCKS = 1024
IO_THREADS = 2  # a rank's shared engine's (``SharedTransferEngine``)
DEFAULT_SHARED_MAX_BYTES = 256 * 2**20
_SEED = 31


class _NoSeal:
    """A stand-in for the seal that computes nothing: the bench's way to measure what the seal
    costs (never used by raykv itself)."""

    def seal(self, sealed_part: bytes, pages: memoryview) -> bytes:
        return NO_SEAL

    def check(self, sealed_part: bytes, pages: memoryview, seal: bytes) -> bool:
        return True


def _keys(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    keys: dict[int, None] = {}
    while len(keys) < count:
        keys[make_key(rng.getrandbits(64))] = None
    return list(keys)


def _bench_page(
    master: str, kib: int, chunks: int, blocks_per_chunk: int, directions: list[str], repeat: int
) -> list[dict[str, object]]:
    fmt = ChunkFormat(kib * 1024, blocks_per_chunk)
    pool = np.random.default_rng(kib).integers(0, 255, (chunks, fmt.data_bytes), dtype=np.uint8)
    other = np.empty_like(pool)
    keys = _keys(chunks, _SEED + kib)
    slots = list(range(chunks))
    nbytes = chunks * fmt.data_bytes
    store = SharedChunks(
        StoreEndpoint(master, secret=new_secret()),
        f"raykv-bench-{kib}",
        0,
        fmt,
        pool.ctypes.data,
        chunks,
    )

    sealer = store._sealer
    threads = ThreadPoolExecutor(IO_THREADS)
    # one run of the chunks per I/O thread, as a rank's shared engine splits a job
    runs = [(keys[i::IO_THREADS], slots[i::IO_THREADS]) for i in range(IO_THREADS)]

    def put() -> None:
        codes = [c for out in threads.map(lambda run: store.put(*run), runs) for c in out]
        failed = [code for code in codes if code != 0]
        if failed:
            raise SharedStoreError(
                f"{len(failed)} of {chunks} puts failed (status {failed[0]}: store full?)"
            )

    def get() -> None:
        got = [g for out in threads.map(lambda run: store.get(*run), runs) for g in out]
        bad = [g for g in got if g != "ok"]
        if bad:
            raise SharedStoreError(f"{len(bad)} of {chunks} reads failed: {bad[0]}")

    def unsealed(op: Any) -> Any:
        def run() -> None:
            store._sealer = _NoSeal()
            try:
                op()
            finally:
                store._sealer = sealer

        return run

    def copy_out() -> None:
        np.copyto(other, pool)

    def copy_in() -> None:
        np.copyto(pool, other)

    def before_store(which: int) -> None:
        del which  # every put starts from an empty store: one of a key there writes nothing
        store.remove(keys, force=True)

    timed = {"store": (put, copy_out, before_store), "load": (get, copy_in, None)}
    rows: list[dict[str, object]] = []
    try:
        for direction in directions:
            if direction == "load":  # every part there, sealed with the secret
                store.remove(keys, force=True)
                put()
            first, second, before = timed[direction]
            store_s, copy_s = best_pair(first, second, repeat, before)
            sealed_s, unsealed_s = best_pair(first, unsealed(first), repeat, before)
            gbps, base = nbytes / store_s / 1e9, nbytes / copy_s / 1e9
            rows.append(
                {
                    "page_kib": kib,
                    "direction": direction,
                    "blocks": chunks * blocks_per_chunk,
                    "blocks_per_chunk": blocks_per_chunk,
                    "chunks": chunks,
                    "bytes": nbytes,
                    "gbps": gbps,
                    "baseline_gbps": base,
                    "ratio": gbps / base,
                    "unsealed_gbps": nbytes / unsealed_s / 1e9,
                    "seal_ratio": unsealed_s / sealed_s,
                }
            )
    finally:
        threads.shutdown()
        store.remove(keys, force=True)
        store.close()
    return rows


def run_shared_bench(
    page_kib: Sequence[int],
    blocks: int,
    directions: Sequence[str],
    repeat: int = 3,
    master: str | None = None,
    blocks_per_chunk: int = 1,
    max_bytes: int = DEFAULT_SHARED_MAX_BYTES,
) -> dict[str, object]:
    """Measure the store's put and read GB/s per page size against a local copy of the same
    bytes. Returns ``{"device": "shared", "master", "protocol", "blocks_per_chunk", "repeat",
    "results": [{"page_kib", "direction", "blocks", "blocks_per_chunk", "chunks", "bytes",
    "gbps", "baseline_gbps", "ratio"}, ...]}`` (GB = 10^9 bytes)."""
    for direction in directions:
        if direction not in SHARED_DIRECTIONS:
            raise ValueError(
                f"direction must be one of {SHARED_DIRECTIONS} for the store, got {direction!r}"
            )
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    if blocks_per_chunk < 1 or blocks < blocks_per_chunk:
        raise ValueError(f"blocks ({blocks}) must be >= blocks_per_chunk ({blocks_per_chunk}) >= 1")
    sizes = []
    for kib in page_kib:
        pages = min(blocks, max(1, max_bytes // (kib * 1024)))
        sizes.append((kib, max(1, pages // blocks_per_chunk)))
    biggest = max(chunks * kib * 1024 * blocks_per_chunk for kib, chunks in sizes)
    # the objects' headers and the store's own bookkeeping need room beside the pages
    segment = int(biggest * 1.5) + (64 << 20)
    embedded = EmbeddedMaster() if master is None else None
    address = embedded.start() if embedded is not None else str(master)
    try:
        rows: list[dict[str, object]] = []
        with HeldSegment(address, segment):
            for kib, chunks in sizes:
                rows.extend(
                    _bench_page(address, kib, chunks, blocks_per_chunk, list(directions), repeat)
                )
    finally:
        if embedded is not None:
            embedded.stop()
    return {
        "device": "shared",
        "master": "embedded" if master is None else master,
        "protocol": "tcp",
        "blocks_per_chunk": blocks_per_chunk,
        "repeat": repeat,
        "results": rows,
    }


def format_shared_table(result: dict[str, object]) -> str:
    """The shared-store bench's result as a plain-text table."""
    chunk = result["blocks_per_chunk"]
    lines = [
        f"transfer bench to Mooncake Store ({result['master']} master, {result['protocol']}; "
        f"{chunk} block{'s' if chunk != 1 else ''} an object; against one local copy)",
        f"{'page KiB':>9} {'direction':>9} {'blocks':>7} {'GB/s':>8} "
        f"{'copy GB/s':>10} {'ratio':>6} {'unsealed GB/s':>14} {'seal ratio':>11}",
    ]
    rows = result["results"]
    assert isinstance(rows, list)
    for row in rows:
        lines.append(
            f"{row['page_kib']:>9} {row['direction']:>9} {row['blocks']:>7} {row['gbps']:>8.2f} "
            f"{row['baseline_gbps']:>10.2f} {row['ratio']:>6.2f} "
            f"{row['unsealed_gbps']:>14.2f} {row['seal_ratio']:>11.2f}"
        )
    return "\n".join(lines)
