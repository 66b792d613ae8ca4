"""vLLM's KV event stream as raykv's router reads it.

A vLLM engine with ``KVEventsConfig(publisher="zmq")`` publishes, after each scheduler step,
one ``KVEventBatch`` as a ZeroMQ multipart message: the topic, an 8-byte big-endian sequence
number, and the batch in MessagePack. The batch is an array ``[ts, events, dp_rank]``; each
event is a map tagged by ``"type"`` (vLLM 0.32's encoding) or an array whose first element is
the tag (the encoding of earlier releases, and of other publishers that mimic it). Both are
read here, field by field, so a field a later release appends is ignored, not an error.

Events become raykv's ``WireEvent`` tuples in a mirror of the replica (``VllmKVMirror``), which
the replica's KV feed serves to routers as it serves raykv's own engine's events:

- ``GPU`` (or no medium): vLLM's prefix cache, one key per block hash;
- ``CPU``: raykv's CPU tier; ``STORAGE`` owned by ``raykv-disk`` (or of ``LOCAL`` locality):
  its disk tier; ``STORAGE`` owned by ``raykv-shared`` (or ``REMOTE``): its shared tier, which
  the router credits to every replica. A tier names a chunk by the hash of its last block (the
  self-describing events list every block of the chunk; the placeholders only that one).

A key is the low 64 bits of vLLM's block hash with the KV group (``make_key``): what vLLM's
own integer form of a hash keeps (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), so either form of
the stream gives the same keys, and ``raykv.vllm.block_hashes`` hashes a prompt to them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from raykv.core.keys import make_key
from raykv.core.kv_events import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_GPU, MEDIUM_SHARED
from raykv.serve.kv_index import ReplicaKV, Snapshot, WireEvent

log = logging.getLogger(__name__)

_LOW_64 = (1 << 64) - 1
# the positional fields of each event in the array encoding (after the tag), in vLLM's order
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
_FIELDS = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS, "AllBlocksCleared": ()}
OWNER_DISK = "raykv-disk"
OWNER_SHARED = "raykv-shared"


class EventFormatError(ValueError):
    """A message that is not a KV event batch vLLM could have sent."""


@dataclass(slots=True)
class VllmEvent:
    """One decoded KV event: ``kind`` (BlockStored, BlockRemoved, AllBlocksCleared), the
    block hashes as keys' hashes (low 64 bits), and where (raykv's medium name)."""

    kind: str
    hashes: list[int]
    medium: str
    group: int = 0
    block_size: int = 0
    token_ids: list[int] | None = None
    parent: int | None = None


def block_key_hash(block_hash: Any) -> int:
    """The low 64 bits of a vLLM block hash (bytes, or vLLM's int form of it)."""
    if isinstance(block_hash, bytes | bytearray | memoryview):
        return int.from_bytes(bytes(block_hash)[-8:], "big")
    if isinstance(block_hash, int) and not isinstance(block_hash, bool):
        return block_hash & _LOW_64
    raise EventFormatError(f"a block hash must be bytes or an int, not {type(block_hash).__name__}")


def _medium(fields: dict[str, Any]) -> str:
    medium = fields.get("medium")
    if medium in (None, "GPU"):
        return MEDIUM_GPU
    if medium == "CPU":
        return MEDIUM_CPU
    owner, locality = fields.get("ownership"), fields.get("locality")
    if owner == OWNER_SHARED or (owner != OWNER_DISK and locality == "REMOTE"):
        return MEDIUM_SHARED
    return MEDIUM_DISK  # STORAGE, LOCAL or unspecified: a tier on this replica's machine


def _event(raw: Any) -> VllmEvent | None:
    """One event of either encoding; None for an event of a kind raykv does not mirror."""
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    elif isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _FIELDS.get(kind, ())
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise EventFormatError(f"an event must be a map or a tagged array, not {raw!r:.80}")
    if kind not in _FIELDS:
        return None
    if kind == "AllBlocksCleared":
        return VllmEvent(kind, [], MEDIUM_GPU)
    hashes = fields.get("block_hashes")
    if not isinstance(hashes, list):
        raise EventFormatError(f"{kind}: block_hashes must be a list")
    group = fields.get("group_idx") or 0
    parent = fields.get("parent_block_hash")
    return VllmEvent(
        kind,
        [block_key_hash(h) for h in hashes],
        _medium(fields),
        int(group),
        int(fields.get("block_size") or 0),
        fields.get("token_ids"),
        block_key_hash(parent) if parent is not None else None,
    )


def decode_batch(payload: bytes) -> list[VllmEvent]:
    """The events of one batch's MessagePack payload (array or map encoding)."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventFormatError(f"not MessagePack: {exc}") from None
    if isinstance(batch, dict):
        events = batch.get("events")
    elif isinstance(batch, list) and len(batch) >= 2:
        events = batch[1]
    else:
        raise EventFormatError("a batch must be [ts, events, ...] or a map with events")
    if not isinstance(events, list):
        raise EventFormatError("a batch's events must be a list")
    return [e for e in map(_event, events) if e is not None]


class VllmKVMirror:
    """What one vLLM replica holds, from its decoded events, with raykv's sequence numbers:
    ``take`` gives the wire events since the last call, ``state`` the whole as a snapshot.

    ``blocks_per_chunk``: blocks per tier chunk (a self-describing tier event lists them all;
    the chunk's key is its last)."""

    def __init__(self, blocks_per_chunk: int = 1) -> None:
        self.blocks_per_chunk = blocks_per_chunk
        self.kv = ReplicaKV(synced=True)
        self._pending: list[WireEvent] = []
        self._lock = threading.Lock()
        self.batches = 0  # batches applied
        self.gaps = 0  # batches missed (the mirror started again from nothing each time)
        self._last_seq: int | None = None

    def apply(self, seq: int | None, events: Iterable[VllmEvent]) -> None:
        """Apply one batch, numbered ``seq`` by the publisher (None: not numbered). A batch
        that does not follow the last one means some were lost: what the mirror held may be
        wrong, so it says it holds nothing (the router then weighs this replica by its load
        alone) until events tell it again."""
        with self._lock:
            if seq is not None and self._last_seq is not None and seq != self._last_seq + 1:
                self.gaps += 1
                log.warning("vLLM's KV events skipped from %d to %d", self._last_seq, seq)
                for medium in (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK, MEDIUM_SHARED):
                    held = self.kv.held(medium)
                    if held:
                        self._record(False, medium, list(held))
            if seq is not None:
                self._last_seq = seq
            for event in events:
                self._apply_one(event)
            self.batches += 1

    def _apply_one(self, event: VllmEvent) -> None:
        medium = event.medium
        if event.kind == "AllBlocksCleared":
            if self.kv.gpu:
                self._record(False, MEDIUM_GPU, list(self.kv.gpu))
            return
        stored = event.kind == "BlockStored"
        if medium == MEDIUM_GPU:
            keys = [make_key(h, event.group) for h in event.hashes]
        elif stored:
            hashes = event.hashes
            step = self.blocks_per_chunk
            chunks = hashes[step - 1 :: step] if len(hashes) > 1 else hashes
            keys = [make_key(h, event.group) for h in chunks]
        else:  # removals list every block of the chunks they remove; the chunks' keys count
            held = self.kv.held(medium) or set()
            keys = [k for k in (make_key(h, event.group) for h in event.hashes) if k in held]
        if keys:
            self._record(stored, medium, keys)

    def _record(self, stored: bool, medium: str, keys: Sequence[int]) -> None:
        event = (self.kv.next_seq, stored, medium, tuple(keys))
        self.kv.apply([event])
        self._pending.append(event)

    def take(self) -> list[WireEvent]:
        with self._lock:
            taken, self._pending = self._pending, []
            return taken

    def state(self) -> Snapshot:
        """The whole state (what was pending is in it)."""
        with self._lock:
            self._pending = []
            return self.kv.snapshot()


class EventSubscriber:
    """A thread reading a vLLM engine's ZeroMQ KV event stream into a mirror."""

    def __init__(self, endpoint: str, mirror: VllmKVMirror, topic: str = "") -> None:
        import zmq

        self.mirror = mirror
        self.errors = 0
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt_string(zmq.SUBSCRIBE, topic)
        self._socket.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raykv-vllm-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(200):
                    continue
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                continue
            try:
                seq, events = _frames(frames)
                self.mirror.apply(seq, events)
            except Exception as exc:  # a message not understood never ends the reading
                self.errors += 1
                if self.errors <= 3:
                    log.warning("a KV event message was not read: %s", exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        with contextlib.suppress(Exception):
            self._socket.close(linger=0)


def _frames(frames: list[bytes]) -> tuple[int | None, list[VllmEvent]]:
    """(sequence number, events) of a multipart message: topic, seq, payload (or the payload
    alone)."""
    if len(frames) == 3:
        if len(frames[1]) != 8:
            raise EventFormatError("the sequence frame must be 8 bytes")
        return int.from_bytes(frames[1], "big", signed=True), decode_batch(frames[2])
    if len(frames) == 1:
        return None, decode_batch(frames[0])
    raise EventFormatError(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
