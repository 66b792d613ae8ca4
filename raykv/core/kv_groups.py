"""KV-cache groups: layers that share one attention pattern and one block table per request."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from raykv.core.arith import cdiv


class GroupKind(str, Enum):
    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV group. A sliding-window group attends to the last ``window_tokens`` positions: the
    token at position p reads positions p - window_tokens + 1 .. p."""

    index: int
    kind: GroupKind
    window_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.kind is GroupKind.SLIDING_WINDOW and (self.window_tokens or 0) <= 0:
            raise ValueError(f"group {self.index}: a sliding window needs window_tokens > 0")

    @property
    def is_sliding(self) -> bool:
        return self.kind is GroupKind.SLIDING_WINDOW

    def first_needed_position(self, next_position: int) -> int:
        """The earliest position a token at ``next_position`` (or later) still reads."""
        if not self.is_sliding:
            return 0
        assert self.window_tokens is not None
        return max(0, next_position - self.window_tokens + 1)

    def first_needed_block(self, next_position: int, block_size: int) -> int:
        """Blocks before this index hold nothing a token at ``next_position`` reads."""
        return self.first_needed_position(next_position) // block_size

    def window_chunks(self, tokens_per_chunk: int) -> int:
        """Chunks a load must bring for this group to resume at a chunk boundary (W)."""
        if not self.is_sliding:
            return 0
        assert self.window_tokens is not None
        return max(1, cdiv(self.window_tokens - 1, tokens_per_chunk))
