"""What the KV-aware router knows about each replica's KV: the keys its GPU prefix cache, its
CPU tier and its disk tier hold, and those it knows the cluster's shared tier to hold, mirrored
from the replica's KV events, and how much of a prompt each could serve. Plain Python: the feed
actor and the router both use it, and tests drive it directly.

Events travel as ``WireEvent`` tuples (sequence number, stored or removed, medium, keys): cheap
to pickle, and the same shape whether they come from the engine's log or a snapshot.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice

from raykv.core.hashing import block_hashes, salted_root
from raykv.core.keys import make_key
from raykv.core.kv_events import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    MEDIUM_SHARED,
    BlockStored,
    KVEvent,
)

# (seq, stored, medium, keys): one KV event on the wire
WireEvent = tuple[int, bool, str, tuple[int, ...]]


def to_wire(events: Iterable[KVEvent]) -> list[WireEvent]:
    """The engine's events as wire tuples."""
    return [(e.seq, isinstance(e, BlockStored), e.medium, e.keys) for e in events]


@dataclass(slots=True)
class Snapshot:
    """A replica's whole KV state: the next event's sequence number and the keys per medium
    (``EngineCore.kv_state``)."""

    next_seq: int
    held: dict[str, list[int]]


@dataclass(slots=True)
class ReplicaKV:
    """One replica's keys per medium, kept by applying its events in sequence order.

    ``apply`` refuses a batch that does not start at ``next_seq`` (a gap: events were missed,
    so the mirror can no longer be trusted until ``load`` gives it a snapshot). Events of a
    medium the mirror does not keep (a tier added after this router was written) advance the
    sequence and change nothing: counting them as another medium would misprice the hit."""

    gpu: set[int] = field(default_factory=set)
    cpu: set[int] = field(default_factory=set)
    disk: set[int] = field(default_factory=set)
    # chunks this replica published to the shared tier or found there: every replica can load
    # them, so the router takes the union over the replicas (``SharedView``)
    shared: set[int] = field(default_factory=set)
    next_seq: int = 0
    synced: bool = False  # False until the first snapshot, and again after a gap

    def held(self, medium: str) -> set[int] | None:
        """The keys ``medium`` holds, or None for a medium the mirror does not keep."""
        if medium == MEDIUM_GPU:
            return self.gpu
        if medium == MEDIUM_CPU:
            return self.cpu
        if medium == MEDIUM_DISK:
            return self.disk
        if medium == MEDIUM_SHARED:
            return self.shared
        return None

    def apply(self, events: Sequence[WireEvent]) -> bool:
        """Apply events in order; False (nothing applied) when they do not follow on."""
        if not self.synced:
            return False
        if events and events[0][0] != self.next_seq:
            self.synced = False
            return False
        for seq, stored, medium, keys in events:
            held = self.held(medium)
            if held is not None:
                if stored:
                    held.update(keys)
                else:
                    held.difference_update(keys)
            self.next_seq = seq + 1
        return True

    def load(self, snapshot: Snapshot) -> None:
        """Start again from a whole state."""
        self.gpu = set(snapshot.held.get(MEDIUM_GPU, ()))
        self.cpu = set(snapshot.held.get(MEDIUM_CPU, ()))
        self.disk = set(snapshot.held.get(MEDIUM_DISK, ()))
        self.shared = set(snapshot.held.get(MEDIUM_SHARED, ()))
        self.next_seq = snapshot.next_seq
        self.synced = True

    def snapshot(self) -> Snapshot:
        """The whole state, as ``EngineCore.kv_state`` gives it."""
        return Snapshot(
            self.next_seq,
            {
                MEDIUM_GPU: list(self.gpu),
                MEDIUM_CPU: list(self.cpu),
                MEDIUM_DISK: list(self.disk),
                MEDIUM_SHARED: list(self.shared),
            },
        )


class EventRing:
    """A replica's recent events with a mirror of its whole state, so any number of readers,
    each at its own position, get what they missed: the events since their position while the
    ring still holds them, a snapshot otherwise."""

    def __init__(self, capacity: int = 4096) -> None:
        self.mirror = ReplicaKV(synced=True)
        self._ring: deque[WireEvent] = deque(maxlen=capacity)

    @property
    def next_seq(self) -> int:
        return self.mirror.next_seq

    def push(self, events: Sequence[WireEvent]) -> bool:
        """Record events; False when they do not follow on (the writer must ``reset``)."""
        if not self.mirror.apply(events):
            return False
        self._ring.extend(events)
        return True

    def reset(self, snapshot: Snapshot) -> None:
        self.mirror.load(snapshot)
        self._ring.clear()

    def since(self, seq: int) -> list[WireEvent] | Snapshot:
        """The events from ``seq`` on, or a snapshot when the ring no longer holds them all (or
        ``seq`` is not a position this stream ever had)."""
        if not self.mirror.synced:
            return Snapshot(-1, {})  # the writer owes a reset; readers wait for it
        if seq == self.next_seq:
            return []
        first = self._ring[0][0] if self._ring else self.next_seq
        if first <= seq < self.next_seq:
            return list(islice(self._ring, seq - first, None))
        return self.mirror.snapshot()


@dataclass(slots=True)
class KVLayout:
    """How the engine turns a prompt into keys: tokens per block, blocks per CPU chunk, and the
    KV groups a hit must cover (the full-attention ones: a sliding-window group needs only its
    window, which a full-attention hit of the same prefix implies in practice)."""

    block_size: int
    blocks_per_chunk: int
    groups: tuple[int, ...] = (0,)
    # whose block hashes: raykv's engine's, or vLLM's (``vllm:ALGO``, with its seed; None:
    # vLLM's default seed)
    hasher: str = "raykv"
    hash_seed: str | None = None

    def hashes(self, token_ids: Sequence[int], cache_salt: str | None) -> list[int]:
        """The block hashes of a prompt, as its engine computes them."""
        if self.hasher == "raykv":
            return block_hashes(token_ids, self.block_size, salted_root(cache_salt))
        from raykv.vllm.block_hashes import prompt_hashes

        algo = self.hasher.removeprefix("vllm:")
        return prompt_hashes(token_ids, self.block_size, cache_salt, algo, self.hash_seed)

    @property
    def tokens_per_chunk(self) -> int:
        return self.block_size * self.blocks_per_chunk


@dataclass(slots=True)
class PromptKeys:
    """A prompt's keys: per block (the GPU prefix cache's) and per chunk (the CPU and disk
    tiers', which key a chunk alike), each a tuple over the layout's groups, up to the last
    block the engine may reuse (the last token is always computed); and ``published``, the
    keys of every full block of the prompt, which the replica's GPU cache holds once the prompt
    is computed."""

    gpu: list[tuple[int, ...]]
    cpu: list[tuple[int, ...]]
    num_tokens: int
    published: list[int] = field(default_factory=list)

    @classmethod
    def of(
        cls, token_ids: Sequence[int], layout: KVLayout, cache_salt: str | None = None
    ) -> PromptKeys:
        """The keys of a prompt of ``token_ids`` under ``cache_salt`` (its tenant's: no other
        tenant's block is a hit for it, here as in the engine)."""
        bs, bpc = layout.block_size, layout.blocks_per_chunk
        hashes = layout.hashes(token_ids, cache_salt)
        usable = max(0, len(token_ids) - 1) // bs
        gpu = [tuple(make_key(h, g) for g in layout.groups) for h in hashes[:usable]]
        chunks = usable // bpc
        cpu = [
            tuple(make_key(hashes[(c + 1) * bpc - 1], g) for g in layout.groups)
            for c in range(chunks)
        ]
        published = [make_key(h, g) for h in hashes for g in layout.groups]
        return cls(gpu, cpu, len(token_ids), published)


class SharedView:
    """The chunks the shared tier holds as far as the router knows: those any followed
    replica published there or found there (each replica mirrors only its own share)."""

    def __init__(self, replicas: Iterable[ReplicaKV]) -> None:
        self._sets = [kv.shared for kv in replicas if kv.shared]

    def __contains__(self, key: object) -> bool:
        return any(key in held for held in self._sets)


@dataclass(slots=True)
class Hit:
    """Prompt tokens a replica could take from its GPU cache, then from its CPU tier, its disk
    tier (a chunk only the disk holds is promoted into the CPU tier, then loaded) and the shared
    tier (read from the store into the CPU tier, then loaded); the rest are computed."""

    gpu_tokens: int
    cpu_tokens: int
    computed_tokens: int
    disk_tokens: int = 0
    shared_tokens: int = 0

    @property
    def reused_tokens(self) -> int:
        """The prompt tokens not computed, from any medium."""
        return self.gpu_tokens + self.cpu_tokens + self.disk_tokens + self.shared_tokens


def prompt_hit(
    keys: PromptKeys,
    kv: ReplicaKV,
    layout: KVLayout,
    expected: Container[int] = (),
    shared: Container[int] = (),
) -> Hit:
    """The engine's own rule, from the mirror: the longest prefix of blocks in the GPU cache,
    then the chunks that follow on from the chunk where that hit ends, each held by the CPU
    tier, the disk tier or the shared tier (the engine's lookup over the tiers together). A
    chunk counts for the slowest medium it needs: the CPU tier where it holds every group's
    key, else the disk where the two hold them all, else the shared tier (``shared``: what the
    router knows the store holds, for every replica alike). The first such chunk counts only
    its tokens past the GPU hit. ``expected``: GPU keys taken as held though no event announced
    them yet (a prompt just sent to the replica)."""
    gpu_blocks = 0
    for block in keys.gpu:
        if not all(k in kv.gpu or k in expected for k in block):
            break
        gpu_blocks += 1
    gpu_tokens = gpu_blocks * layout.block_size
    tpc = layout.tokens_per_chunk
    cpu, disk = kv.cpu, kv.disk
    cpu_tokens = disk_tokens = shared_tokens = 0
    done = gpu_tokens  # prompt tokens accounted for so far
    for chunk in keys.cpu[gpu_tokens // tpc :]:
        tokens = done // tpc * tpc + tpc - done  # the chunk's tokens past what is accounted for
        if all(k in cpu for k in chunk):
            cpu_tokens += tokens
        elif all(k in cpu or k in disk for k in chunk):
            disk_tokens += tokens
        elif all(k in cpu or k in disk or k in shared for k in chunk):
            shared_tokens += tokens
        else:
            break
        done += tokens
    return Hit(gpu_tokens, cpu_tokens, keys.num_tokens - done, disk_tokens, shared_tokens)
