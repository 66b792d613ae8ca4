"""The CPU tier's directory and its eviction policies (plain Python: no torch, no ray)."""

from raykv.core.keys import key_group, key_hash, make_key
from raykv.offload.directory import (
    HIT,
    HIT_PENDING,
    MISS,
    Directory,
    DirectoryStats,
    LookupResult,
    StorePlan,
)
from raykv.offload.events import MEDIUM_CPU, BlockRemoved, BlockStored, EventLog, KVEvent
from raykv.offload.policies import CachePolicy, make_policy, policy_names, register_policy

__all__ = [
    "HIT",
    "HIT_PENDING",
    "MEDIUM_CPU",
    "MISS",
    "BlockRemoved",
    "BlockStored",
    "CachePolicy",
    "Directory",
    "DirectoryStats",
    "EventLog",
    "KVEvent",
    "LookupResult",
    "StorePlan",
    "key_group",
    "key_hash",
    "make_key",
    "make_policy",
    "policy_names",
    "register_policy",
]
