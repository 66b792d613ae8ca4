"""The interface between the directory and an eviction policy."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from typing import ClassVar


class CachePolicy(ABC):
    """Decides what the CPU tier keeps.

    The directory owns slots and states; a policy owns only the order in which resident keys are
    given up, and optionally which new keys are worth storing at all. The directory tells it every
    state change, always with keys in prefix order (a request's first chunk first):

    - ``insert``: new resident keys, being written (never evictable while written);
    - ``ready``: their writes completed, now readable and evictable;
    - ``pin`` / ``unpin``: the first reader arrived / the last reader left;
    - ``remove``: keys dropped without eviction (a failed store); no history is kept for them;
    - ``touch``: a request used these keys (keys not resident are ignored);
    - ``evict``: choose victims, atomically.
    """

    name: ClassVar[str] = ""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"policy capacity must be positive, got {capacity}")
        self.capacity = capacity

    def admit(self, keys: list[int], free: int, protected: Collection[int]) -> list[int]:
        """Of these keys (not resident, in prefix order), the ones worth storing. ``free`` slots
        are available without eviction; ``protected`` keys may not be evicted for them. Keys
        returned beyond ``free`` will be followed by ``evict``. Default: all."""
        return keys

    @abstractmethod
    def insert(self, keys: list[int]) -> None: ...

    @abstractmethod
    def ready(self, keys: list[int]) -> None: ...

    @abstractmethod
    def pin(self, keys: list[int]) -> None: ...

    @abstractmethod
    def unpin(self, keys: list[int]) -> None: ...

    @abstractmethod
    def remove(self, keys: list[int]) -> None: ...

    @abstractmethod
    def touch(self, keys: Sequence[int]) -> None: ...

    @abstractmethod
    def evict(self, n: int, protected: Collection[int]) -> list[int] | None:
        """Remove and return exactly n evictable keys that are not in ``protected``, or return
        None and change nothing when that many cannot be found."""

    @abstractmethod
    def clear(self) -> None: ...

    def stats(self) -> dict[str, float]:
        """Policy-specific gauges for reports (adaptive targets, ghost sizes, ...)."""
        return {}
