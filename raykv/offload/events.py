"""The CPU tier's KV events: the engine-wide stream of ``core/kv_events.py`` (the GPU prefix
cache records into the same log, so one sequence orders both media)."""

from raykv.core.kv_events import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    BlockRemoved,
    BlockStored,
    EventLog,
    KVEvent,
)

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_DISK",
    "MEDIUM_GPU",
    "BlockRemoved",
    "BlockStored",
    "EventLog",
    "KVEvent",
]
