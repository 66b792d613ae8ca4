"""Mooncake Store as raykv's shared tier: a client of the store, and one rank's chunks put into it
and read back, each from and into the rank's own CPU-pool shard.

A chunk goes to the store as one object per rank, ``<namespace>/<chunk key>/<rank>``, holding the
same header a disk file has (``disk_files.ChunkFormat``: the key, the sizes, the namespace, rank and
TP size it is for, every page's CRC-32) followed by the pages, and sealed with the cluster's secret
(``transfer/seal.py``: a keyed hash of the header and the pages). The pages travel straight from and
into the pool's shared memory, which the rank registers with its client once (Mooncake's zero-copy
calls: no Python loop over bytes, no pickling); the headers go through a small registered buffer of
their own. A read checks the header and the seal before the bytes count: an object of another key,
geometry, namespace, rank or TP size, torn, spoiled, or put by a writer without the secret is never
served.

The pool's memory itself is not the ranks': a client that gives the pool a segment of its DRAM
(``SegmentHolder``) is held by one long-lived process per node (the store actor,
``cluster/store_actor.py``, or a bench's child process), so that an engine's death or restart
loses nothing of it. A rank's client gives no segment; it only reads and writes.

Mooncake's client logs through glog on stderr; its library needs a few system libraries
(``mooncake_problem`` says which are missing). No torch here: pools are buffers.
"""

from __future__ import annotations

import ctypes
import mmap
import socket
import struct
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Any

from raykv.config import ConfigError
from raykv.config.shared import SharedTierConfig
from raykv.transfer.crc import crc32
from raykv.transfer.disk_files import ChunkFileError, ChunkFormat
from raykv.transfer.seal import Sealer

P2P = "P2PHANDSHAKE"  # clients exchange their transfer metadata directly (no metadata server)
SYSTEM_LIBRARIES = "libibverbs1 librdmacm1 libnuma1 liburing2 libcurl4 rdma-core"
# Mooncake's statuses (its ErrorCode): the pool had no room; an object of another size than
# asked for; a key that is not there (or was evicted); one that is there already
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705


LOCAL_BUFFER = 1 << 20  # each client's own transfer buffer (our bytes go through registered ones)
PIPELINE_PARTS = 8  # parts a read asks for at once, checked while the next ones come


class SharedUnavailable(ConfigError):
    """The shared tier's store cannot be used as configured (``offload.shared.*``): named in
    the message (a configuration problem: ``raykv`` exits 2)."""


class SharedStoreError(RuntimeError):
    """The shared tier's store cannot be reached or refused an operation (named)."""


def mooncake_problem() -> str | None:
    """Why Mooncake Store cannot be used in this process (None: it can)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        if "mooncake" in str(exc) and "No module named" in str(exc):
            return (
                "the shared tier needs Mooncake Store: pip install 'raykv[shared]' "
                "(mooncake-transfer-engine-non-cuda, or mooncake-transfer-engine on CUDA nodes)"
            )
        return (
            f"Mooncake Store does not load ({exc}); it needs the system libraries "
            f"{SYSTEM_LIBRARIES} (Debian: apt-get install {SYSTEM_LIBRARIES})"
        )
    return None


@dataclass(frozen=True, slots=True)
class StoreEndpoint:
    """Where the store's master listens, how this node's clients move bytes, and the cluster's
    secret that seals every part (``transfer/seal.py``; empty for clients that only give a
    segment or ask what the store holds)."""

    master: str  # host:port of the master's RPC
    host: str = "127.0.0.1"  # this node's address, for the transfers to and from it
    protocol: str = "tcp"
    devices: str = ""  # RDMA devices (empty: found by Mooncake)
    timeout_s: float = 5.0  # a master nothing answers for is refused within this
    secret: bytes = field(default=b"", repr=False)

    @classmethod
    def of(
        cls, shared: SharedTierConfig, master: str, secret: bytes, host: str = "127.0.0.1"
    ) -> StoreEndpoint:
        """Where a client on ``host`` (its node's address) joins the store at ``master``, as
        ``offload.shared`` says it moves bytes, sealing parts with ``secret``."""
        return cls(
            master,
            host=host,
            protocol=shared.protocol,
            devices=shared.devices,
            timeout_s=shared.timeout_s,
            secret=secret,
        )


# The master's RPC is yalantinglibs' coro_rpc: a request header of 20 bytes (magic 0x15, version
# 0, serialization, message type, a sequence number the reply echoes, function id, body and
# attachment lengths), answered by a 16-byte header with the same magic, version and sequence
# number. A request for function 0 (registered by nobody) is answered with an error and changes
# nothing: a probe that tells a master from whatever else listens there (an HTTP server sends
# nothing back to it, a closed port refuses it).
_CORO_MAGIC = 0x15
_PROBE_SEQ = 0x52_4B_56_31
_REQUEST = struct.Struct("<BBBBIIII")
_REPLY = struct.Struct("<BBBBIII")


def speaks_mooncake(address: str, timeout_s: float) -> str | None:
    """Why nothing that speaks Mooncake's master RPC answers at ``host:port`` within
    ``timeout_s`` (None: a master does)."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            sock.sendall(_REQUEST.pack(_CORO_MAGIC, 0, 0, 0, _PROBE_SEQ, 0, 0, 0))
            reply = b""
            while len(reply) < _REPLY.size:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                part = sock.recv(_REPLY.size - len(reply))
                if not part:
                    return "it closed the connection without answering as a master does"
                reply += part
    except TimeoutError:
        return f"nothing answered as a master does within {timeout_s:g} s"
    except (OSError, ValueError) as exc:
        return f"nothing answers ({getattr(exc, 'strerror', None) or exc})"
    magic, version, _, _, seq, _, _ = _REPLY.unpack(reply)
    if (magic, version, seq) != (_CORO_MAGIC, 0, _PROBE_SEQ):
        return "what answers is not a Mooncake master"
    return None


def reachable(address: str, timeout_s: float) -> bool:
    """Something accepts TCP connections at ``host:port`` within ``timeout_s``."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def connect(endpoint: StoreEndpoint, segment_bytes: int, local_buffer_bytes: int) -> Any:
    """A set-up ``MooncakeDistributedStore`` client (``segment_bytes``: DRAM it gives the
    pool, 0 for a client that only reads and writes); ``SharedStoreError`` naming the master
    when it cannot be set up. A master nothing answers for is refused within the endpoint's
    ``timeout_s`` (Mooncake's own setup retries for a minute and more)."""
    timeout_s = endpoint.timeout_s
    problem = mooncake_problem()
    if problem:
        raise SharedStoreError(problem)
    # Mooncake's own setup, pointed at something else, waits 30 s and logs a dozen lines
    why = speaks_mooncake(endpoint.master, timeout_s)
    if why is not None:
        raise SharedStoreError(
            f"no Mooncake master at {endpoint.master} (the shared tier's master): {why}"
        )
    if segment_bytes == 0 and local_buffer_bytes == LOCAL_BUFFER:
        client = _idle_client(endpoint)
        if client is not None:
            return client
    from mooncake.store import MooncakeDistributedStore

    from raykv.transfer.bind_address import bind_mooncake_to

    # its listeners on this node's address, not on every interface (the library binds the
    # wildcard whatever ``local_hostname`` says)
    bind_mooncake_to(endpoint.host)
    client = MooncakeDistributedStore()
    rc = client.setup(
        endpoint.host,
        P2P,
        segment_bytes,
        local_buffer_bytes,
        endpoint.protocol,
        endpoint.devices,
        endpoint.master,
    )
    if rc != 0:
        raise SharedStoreError(
            f"cannot join the shared tier's store at {endpoint.master} (setup returned {rc})"
        )
    return client


class SegmentHolder:
    """A client that gives the pool ``segment_bytes`` of this node's DRAM and keeps them there
    while it lives (the store actor holds one per node)."""

    def __init__(self, endpoint: StoreEndpoint, segment_bytes: int) -> None:
        self.segment_bytes = segment_bytes
        self._client = connect(endpoint, segment_bytes, LOCAL_BUFFER)

    def healthy(self) -> bool:
        """The master answers this client."""
        return self._client.health_check() == 0

    def close(self) -> None:
        self._client.close()


# Clients that give no segment, idle, by where they join: Mooncake's close holds the
# interpreter's lock for about a second (its threads' last beat), which every engine's shutdown
# would pay per rank; the next engine in this process takes them up instead (a rank actor's
# process ends with its client anyway).
_idle: dict[StoreEndpoint, list[Any]] = {}
_idle_lock = threading.Lock()
MAX_IDLE = 8  # per endpoint; one more is closed


def _idle_client(endpoint: StoreEndpoint) -> Any | None:
    with _idle_lock:
        idle = _idle.get(endpoint)
        return idle.pop() if idle else None


def release(endpoint: StoreEndpoint, client: Any, failed: bool = False) -> None:
    """Give back a client of ``connect(endpoint, 0, ...)`` whose buffers are all unregistered:
    kept for the next one joining there (closed where enough are kept, or where it ``failed``
    an operation: what it knows of the pool's segments may be stale, a master started again
    since, and the next engine would inherit its failures)."""
    if failed:
        client.close()
        return
    with _idle_lock:
        idle = _idle.setdefault(endpoint, [])
        if len(idle) < MAX_IDLE:
            idle.append(client)
            return
    client.close()


def close_idle(master: str) -> None:
    """Close the idle clients kept for the store at ``master`` (it is about to stop: nobody
    would take them up, and each would go on beating against a dead master)."""
    with _idle_lock:
        gone = [key for key in _idle if key.master == master]
        clients = [client for key in gone for client in _idle.pop(key)]
    for client in clients:
        client.close()


def object_bytes(fmt: ChunkFormat, ranks: int) -> int:
    """Bytes of one chunk in the store: every rank's part, header and pages."""
    return (fmt.header_bytes + fmt.data_bytes) * ranks


def chunks_in_segment(segment: int, fmt: ChunkFormat, ranks: int, field: str) -> int:
    """How many chunks (every rank's part) ``segment`` bytes of the pool hold: what the
    scheduler's index of the store tracks (the store evicts on its own: a chunk gone is found
    out by its read). ``ConfigError`` naming ``field`` (where the segment is set) when it holds
    none."""
    slots = segment // object_bytes(fmt, ranks)
    if slots < 1:
        raise ConfigError(
            f"{field} ({segment}) is smaller than one chunk in the store "
            f"({object_bytes(fmt, ranks)} bytes on all ranks)"
        )
    return slots


def object_key(namespace: str, key: int, rank: int) -> str:
    """A rank's part of chunk ``key`` in the store."""
    return f"{namespace}/{key:x}/{rank}"


class SharedChunks:
    """One rank's chunks in the store, put from and read into the slots of its CPU-pool shard
    (``pool_ptr``, ``num_slots`` rows of ``fmt.data_bytes`` each, registered once), sealed with
    the endpoint's secret (``SharedStoreError`` where it has none). Batches of at most
    ``max_batch`` chunks; each thread has its own registered header buffer."""

    def __init__(
        self,
        endpoint: StoreEndpoint,
        namespace: str,
        rank: int,
        fmt: ChunkFormat,
        pool_ptr: int,
        num_slots: int,
        max_batch: int = 64,
    ) -> None:
        try:
            self._sealer = Sealer(endpoint.secret)
        except ValueError as exc:
            raise SharedStoreError(f"no cluster secret to seal parts with: {exc}") from None
        self.namespace = namespace
        self.rank = rank
        self.format = fmt
        self.max_batch = max_batch
        self.master = endpoint.master
        self._pool_ptr = pool_ptr
        self._num_slots = num_slots
        self._endpoint = endpoint
        self._client = connect(endpoint, 0, LOCAL_BUFFER)
        rc = self._client.register_buffer(pool_ptr, num_slots * fmt.data_bytes)
        if rc != 0:
            self._client.close()
            raise SharedStoreError(f"cannot register the CPU pool with the store ({rc})")
        self._local = threading.local()
        self._headers: list[mmap.mmap] = []  # every thread's, unregistered at close
        self._lock = threading.Lock()
        self._checkers: list[ThreadPoolExecutor] = []  # every I/O thread's, shut at close
        self._closed = False
        self.failed = False  # an operation failed: the client is closed, never kept, at the end

    def _header_buffer(self) -> tuple[mmap.mmap, int]:
        local = self._local
        if not hasattr(local, "buf"):
            buf = mmap.mmap(-1, self.max_batch * self.format.header_bytes)
            ptr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
            rc = self._client.register_buffer(ptr, len(buf))
            if rc != 0:
                raise SharedStoreError(f"cannot register a header buffer with the store ({rc})")
            local.buf, local.ptr = buf, ptr
            with self._lock:
                self._headers.append(buf)
        return local.buf, local.ptr

    def _slot_ptr(self, slot: int) -> int:
        if not 0 <= slot < self._num_slots:
            raise IndexError(f"CPU slot {slot} outside the pool's {self._num_slots}")
        return self._pool_ptr + slot * self.format.data_bytes

    def _slot_view(self, slot: int) -> memoryview:
        nbytes = self.format.data_bytes
        return memoryview((ctypes.c_char * nbytes).from_address(self._slot_ptr(slot))).cast("B")

    def page_crcs(self, slot: int) -> list[int]:
        pb, data = self.format.page_bytes, self._slot_view(slot)
        return [crc32(data[i * pb : (i + 1) * pb]) for i in range(self.format.pages)]

    def put(
        self,
        keys: Sequence[int],
        slots: Sequence[int],
        crcs: Sequence[list[int]] | None = None,
    ) -> list[int]:
        """Put these chunks' parts (``crcs``: their pages' CRC-32s where the caller has them,
        else computed); the store's status of each (0: in the store now; a key already there
        is left as it is, its bytes being the same)."""
        return self._batched(self._put, keys, slots, crcs, split=True)

    def _batched(
        self, call: Any, keys: Sequence[int], slots: Sequence[int], extra: Any, split: bool
    ) -> list[Any]:
        """``call`` over batches of at most ``max_batch`` chunks; ``extra`` goes along (cut in
        batches too where ``split``)."""
        out: list[Any] = []
        step = self.max_batch
        for start in range(0, len(keys), step):
            end = start + step
            given = extra[start:end] if split and extra is not None else extra
            out += call(keys[start:end], slots[start:end], given)
        return out

    def _put(
        self, keys: Sequence[int], slots: Sequence[int], crcs: Sequence[list[int]] | None
    ) -> list[int]:
        fmt = self.format
        hb = fmt.header_bytes
        buf, ptr = self._header_buffer()
        names, ptrs, sizes = [], [], []
        for i, (key, slot) in enumerate(zip(keys, slots, strict=True)):
            sums = self.page_crcs(slot) if crcs is None else crcs[i]
            sealed = fmt.sealed_part(key, sums)
            seal = self._sealer.seal(sealed, self._slot_view(slot))
            buf[i * hb : (i + 1) * hb] = fmt.header_of(sealed, seal)
            names.append(object_key(self.namespace, key, self.rank))
            ptrs.append([ptr + i * hb, self._slot_ptr(slot)])
            sizes.append([hb, fmt.data_bytes])
        return list(self._client.batch_put_from_multi_buffers(names, ptrs, sizes))

    def get(
        self, keys: Sequence[int], slots: Sequence[int], crcs: list[list[int]] | None = None
    ) -> list[str]:
        """Read these chunks' parts into their slots: for each, ``ok``, ``missing`` (not in the
        store: evicted, or never put), ``corrupt`` (the object is not this key's intact part
        for this namespace, rank and TP size, or its seal does not check) or ``failed`` (the
        store did not deliver it: unreachable, or an object of another size); a slot's bytes
        count only where ``ok``. ``crcs`` (where given) gets each chunk's page CRC-32s (the
        seal vouches for them), empty where not ``ok``."""
        return self._batched(self._get, keys, slots, crcs, split=False)

    def _get(
        self, keys: Sequence[int], slots: Sequence[int], crcs: list[list[int]] | None
    ) -> list[str]:
        if self._closed:
            raise SharedStoreError("the shared tier's client is closed")
        fmt = self.format
        hb = fmt.header_bytes
        buf, ptr = self._header_buffer()
        checker = self._checker()
        ptrs = [[ptr + i * hb, self._slot_ptr(slot)] for i, slot in enumerate(slots)]
        # the parts come over in runs: a run's seals are checked on this thread's checking
        # thread while the next run comes over (measured on 2 cores, a 94 MB promotion of 64
        # parts: its 25 ms of checks hidden, 98-124 ms down to 86-110)
        checks: list[Future[list[tuple[str, list[int]]]]] = []
        try:
            for start in range(0, len(keys), PIPELINE_PARTS):
                end = min(start + PIPELINE_PARTS, len(keys))
                names = [object_key(self.namespace, key, self.rank) for key in keys[start:end]]
                sizes = [[hb, fmt.data_bytes]] * (end - start)
                got = self._client.batch_get_into_multi_buffers(names, ptrs[start:end], sizes)
                checks.append(checker.submit(self._check, keys, slots, got, buf, start))
        finally:
            # none left reading the header buffer or the slots once this call is over
            futures_wait(checks)
        out: list[str] = []
        for check in checks:
            for status, recorded in check.result():
                out.append(status)
                if crcs is not None:
                    crcs.append(recorded)
        return out

    def _checker(self) -> ThreadPoolExecutor:
        """This I/O thread's own checking thread (BLAKE3 lets go of the interpreter's lock:
        two I/O threads' reads are checked in parallel, as before the pipeline)."""
        local = self._local
        if not hasattr(local, "checks"):
            with self._lock:
                if self._closed:
                    raise SharedStoreError("the shared tier's client is closed")
                local.checks = ThreadPoolExecutor(1, thread_name_prefix="raykv-seal")
                self._checkers.append(local.checks)
        return local.checks

    def _check(
        self,
        keys: Sequence[int],
        slots: Sequence[int],
        got: Sequence[int],
        buf: mmap.mmap,
        start: int,
    ) -> list[tuple[str, list[int]]]:
        """Each part of a run read from ``start`` on: its status and (where ``ok``) its page
        CRC-32s."""
        fmt = self.format
        hb = fmt.header_bytes
        whole = hb + fmt.data_bytes
        out: list[tuple[str, list[int]]] = []
        for i, n in enumerate(got, start):
            recorded: list[int] | None = None
            if n == OBJECT_NOT_FOUND:
                status = "missing"
            elif n == INVALID_PARAMS or (n >= 0 and n != whole):
                status = "corrupt"  # an object of another size
            elif n < 0:
                status = "failed"
            else:
                header = memoryview(buf)[i * hb : (i + 1) * hb]
                try:
                    recorded = fmt.parse_header(keys[i], header)
                except ChunkFileError:
                    recorded = None
                # the seal covers the header's checksums and the pages: one pass over the
                # bytes, and none of them counts unless a holder of the secret wrote them
                ok = recorded is not None and self._sealer.check(
                    bytes(header[: fmt.sealed_bytes]),
                    self._slot_view(slots[i]),
                    fmt.seal_of(header),
                )
                status = "ok" if ok else "corrupt"
            out.append((status, recorded if status == "ok" and recorded is not None else []))
        return out

    def exists(self, keys: Sequence[int]) -> list[bool]:
        """Whether this rank's part of each chunk is in the store now; ``SharedStoreError``
        when the store could not say (its master unreachable)."""
        names = [object_key(self.namespace, key, self.rank) for key in keys]
        codes = self._client.batch_is_exist(names)
        if any(code < 0 for code in codes):
            self.failed = True
            raise SharedStoreError("the store's master did not answer whether chunks exist")
        return [code == 1 for code in codes]

    def remove(self, keys: Sequence[int], force: bool = False) -> None:
        """Remove these chunks' parts (found corrupt); a part another client reads (under its
        lease) is left, unless ``force`` (a bench removing its own parts)."""
        names = [object_key(self.namespace, key, self.rank) for key in keys]
        self._client.batch_remove(names, force)

    def spoil(self, key: int) -> None:
        """Fault hook (``corrupt-shared``): this rank's part of ``key`` put again with one byte
        of its pages flipped, as a store that flips bytes would (a part not there is left)."""
        name = object_key(self.namespace, key, self.rank)
        size = self.format.header_bytes + self.format.data_bytes
        # through a registered buffer of the part's size: the client's own is smaller than a
        # real model's chunk
        buf = mmap.mmap(-1, size)
        ptr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        client = self._client
        if client.register_buffer(ptr, size) != 0:
            raise SharedStoreError("cannot register a buffer to spoil a part with")
        try:
            if client.get_into(name, ptr, size) != size:
                return
            buf[self.format.header_bytes + self.format.data_bytes // 2] ^= 0x5A  # seal fails
            client.remove(name, True)
            if client.put_from(name, ptr, size) != 0:
                raise SharedStoreError(f"the spoiled part of {key:x} was not put back")
        finally:
            client.unregister_buffer(ptr)
            buf.close()

    def lose(self, key: int) -> None:
        """Fault hook (``lose-shared``): this rank's part of ``key`` removed, as one the store
        evicted or whose node's segment went away while the other ranks' parts stay."""
        self._client.remove(object_key(self.namespace, key, self.rank), True)

    def close(self) -> None:
        with self._lock:
            headers, self._headers = self._headers, []
            checkers, self._checkers = self._checkers, []
            self._closed = True
        for checker in checkers:
            checker.shutdown(wait=True)  # no check reads the pool after its buffers go
        for buf in headers:
            self._client.unregister_buffer(ctypes.addressof(ctypes.c_char.from_buffer(buf)))
        self._client.unregister_buffer(self._pool_ptr)
        release(self._endpoint, self._client, self.failed)


class StoreIndex:
    """What the store holds, as the scheduler asks it: a chunk is there only where every rank's
    part is (``present``). A client of its own that gives no segment."""

    def __init__(self, endpoint: StoreEndpoint, namespace: str, num_ranks: int) -> None:
        self.namespace = namespace
        self.num_ranks = num_ranks
        self._master = endpoint.master
        self._suspect = False  # the last question failed: ask only a master that answers
        self._failed = False  # some question failed: the client is not kept at the end
        self._endpoint = endpoint
        self._client = connect(endpoint, 0, LOCAL_BUFFER)

    def present(self, keys: Sequence[int]) -> list[bool]:
        """For each chunk, whether every rank's part is in the store now; ``SharedStoreError``
        when the store cannot say."""
        if not keys:
            return []
        ranks = self.num_ranks
        if self._suspect and not reachable(self._master, 0.2):
            raise SharedStoreError(f"nothing answers at {self._master} (the master)")
        names = [object_key(self.namespace, key, rank) for key in keys for rank in range(ranks)]
        codes = self._client.batch_is_exist(names)
        self._suspect = any(code < 0 for code in codes)
        self._failed |= self._suspect
        if self._suspect:
            raise SharedStoreError("the store's master did not answer whether chunks exist")
        return [
            all(code == 1 for code in codes[i * ranks : (i + 1) * ranks]) for i in range(len(keys))
        ]

    def close(self) -> None:
        release(self._endpoint, self._client, self._failed)
