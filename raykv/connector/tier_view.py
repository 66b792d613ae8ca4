"""The CPU tier and the disk tier seen as one, for a lookup that may reach past the CPU tier.

A chunk is *present* when the CPU tier holds it (ready or being written) or the disk tier holds
it ready; *readable* when it can be loaded now: ready in the CPU tier, or ready on disk and not
in the CPU tier (the disk copy is promoted first). A chunk being promoted is in the CPU tier and
being written: the lookup waits for it, as for any chunk being written. The CPU tier's lookups
were counted by the lookup's first pass, over the CPU tier alone; this view counts only what it
asks of the disk tier.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from raykv.offload.directory import Directory


class UnionView:
    """What the CPU tier and the disk tier hold together (the lookup's view of ``Directory``)."""

    def __init__(self, cpu: Directory, disk: Directory) -> None:
        self.cpu = cpu
        self.disk = disk

    def __contains__(self, key: int) -> bool:
        return key in self.cpu or self.disk.is_readable(key)

    def is_readable(self, key: int) -> bool:
        cpu = self.cpu
        return cpu.is_readable(key) or (key not in cpu and self.disk.is_readable(key))

    def match_prefix(self, keys: Sequence[int], *, count: bool = True) -> tuple[int, int]:
        """``(present, pending)`` over both tiers, as ``Directory.match_prefix``; the disk
        tier's lookups counted (unless ``count`` is false) for the keys the CPU tier lacks."""
        cpu, disk = self.cpu, self.disk
        present = pending = 0
        asked: list[int] = []
        for key in keys:
            if key in cpu:
                present += 1
                pending += not cpu.is_readable(key)
                continue
            asked.append(key)
            if not disk.is_readable(key):
                break
            present += 1
        if count and asked:
            disk.count_lookups(asked)
        return present, pending

    def count_lookups(self, keys: Iterable[int]) -> None:
        cpu = self.cpu
        self.disk.count_lookups(k for k in keys if k not in cpu)

    def touch(self, keys: Sequence[int]) -> None:
        cpu = self.cpu
        cpu.touch(keys)
        self.disk.touch([k for k in keys if k not in cpu])

    def disk_only(self, keys: Iterable[int]) -> list[int]:
        """Of these keys, those a load needs promoted first (on disk, not in the CPU tier)."""
        cpu = self.cpu
        return [k for k in keys if k not in cpu]
