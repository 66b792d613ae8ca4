"""The CPU tier and the tiers below it (disk, shared store) seen as one, for a lookup that may
reach past the CPU tier.

A chunk is *present* when the CPU tier holds it (ready or being written) or a tier below holds
it ready; *readable* when it can be loaded now: ready in the CPU tier, or ready below and not in
the CPU tier (the copy below is promoted first, from the first tier below that holds it). A
chunk being promoted is in the CPU tier and being written: the lookup waits for it, as for any
chunk being written. The CPU tier's lookups were counted by the lookup's first pass, over the
CPU tier alone; this view counts only what it asks of the tiers below.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from raykv.offload.directory import Directory


class UnionView:
    """What the CPU tier and the tiers below it hold together, nearest first (the lookup's view
    of ``Directory``)."""

    def __init__(self, cpu: Directory, *lowers: Directory) -> None:
        self.cpu = cpu
        self.lowers = lowers

    def _below(self, key: int) -> bool:
        return any(lower.is_readable(key) for lower in self.lowers)

    def __contains__(self, key: int) -> bool:
        return key in self.cpu or self._below(key)

    def is_readable(self, key: int) -> bool:
        cpu = self.cpu
        return cpu.is_readable(key) or (key not in cpu and self._below(key))

    def match_prefix(self, keys: Sequence[int], *, count: bool = True) -> tuple[int, int]:
        """``(present, pending)`` over every tier, as ``Directory.match_prefix``; the lower
        tiers' lookups counted (unless ``count`` is false) for the keys the CPU tier lacks."""
        cpu = self.cpu
        present = pending = 0
        asked: list[int] = []
        for key in keys:
            if key in cpu:
                present += 1
                pending += not cpu.is_readable(key)
                continue
            asked.append(key)
            if not self._below(key):
                break
            present += 1
        if count and asked:
            for lower in self.lowers:
                lower.count_lookups(asked)
        return present, pending

    def count_lookups(self, keys: Iterable[int]) -> None:
        cpu = self.cpu
        below = [k for k in keys if k not in cpu]
        for lower in self.lowers:
            lower.count_lookups(below)

    def touch(self, keys: Sequence[int]) -> None:
        cpu = self.cpu
        cpu.touch(keys)
        below = [k for k in keys if k not in cpu]
        for lower in self.lowers:
            lower.touch(below)

    def sources(self, keys: Iterable[int]) -> list[list[int]]:
        """Of these keys, those a load needs promoted first (not in the CPU tier), by the tier
        below they come from (the nearest that holds each), in ``lowers``' order."""
        cpu, lowers = self.cpu, self.lowers
        out: list[list[int]] = [[] for _ in lowers]
        for key in keys:
            if key in cpu:
                continue
            for i, lower in enumerate(lowers):
                if lower.is_readable(key):
                    out[i].append(key)
                    break
        return out
